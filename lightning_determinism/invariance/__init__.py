"""Invariance: world-size-invariant training and batch-invariant evaluation.

Micro-batch seeds, the fixed gradient tree, elastic rescaling of loop counters; matrix products in probed tiles and
attention in fixed key blocks.

Layer: above seeding; imports ``seeding``, ``data`` and the leaves, never ``strategies`` or ``callbacks``.
"""
