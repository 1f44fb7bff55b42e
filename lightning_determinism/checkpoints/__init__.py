"""Checkpoints: atomic writes, the strategies' ``CheckpointIO``, what a damaged file gets, digests, DCP directories.

``distributed`` reads Lightning's distributed checkpoint directories whole on one process.

Layer: above seeding; ``file`` is a leaf without torch (the light command-line entry uses it). Imports the leaves and
``seeding`` only.
"""
