"""The Trainer and Fabric strategies (mixin, DDP, FSDP, single device, model parallel), launchers, argument checks.

The seeding steps both families share live here too.

Layer: the top one below the package face. May import every folder below (callbacks, data, invariance, parallel,
checkpoints, seeding) and the leaves; nothing imports it but the face.
"""
