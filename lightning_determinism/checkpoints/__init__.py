"""Checkpoint files: atomic writes, the ``CheckpointIO`` of the strategies, what a damaged file gets, digests.

Layer: above seeding; ``file`` is a leaf without torch (the light command-line entry uses it). Imports the leaves and
``seeding`` only.
"""
