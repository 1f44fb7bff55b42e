"""Invariance: world-size-invariant training (micro-batch seeds, the fixed gradient tree, elastic rescaling of loop
counters) and batch-invariant evaluation (matrix products in probed tiles, attention in fixed key blocks).

Layer: above seeding; imports ``seeding``, ``data`` and the leaves, never ``strategies`` or ``callbacks``.
"""
