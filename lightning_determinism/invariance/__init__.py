"""World-size-invariant training: micro-batch seeds, the fixed gradient tree, elastic rescaling of loop counters.

Layer: above seeding; imports ``seeding``, ``data`` and the leaves, never ``strategies`` or ``callbacks``.
"""
