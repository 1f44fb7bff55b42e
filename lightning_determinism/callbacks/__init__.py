"""Lightning callbacks: worker seeding, RNG-state checkpointing, numerical baselines."""
