"""Seeding: ``set_seed``, ``derive_seed`` and its hash, backends, per-rank RNG state, the tracker, evaluation streams.

Layer: the lowest concept; imports only the leaves (``errors``, ``_compat``, ``_process``) and Lightning's rank
utilities, never another folder of the package.
"""
