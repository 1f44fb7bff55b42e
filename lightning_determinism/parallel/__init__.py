"""Model-parallel randomness: the parallel ``Topology`` and its seed streams, Lightning's device mesh as a topology.

Layer: above seeding; imports ``seeding`` and the leaves only.
"""
