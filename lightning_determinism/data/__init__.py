"""The data side: streams (iterable datasets resumed at the exact sample) and loaders with a state of their own."""
