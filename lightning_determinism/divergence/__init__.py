"""Whether and where two runs diverged: fingerprints, baselines, the probe, diagnosis, bisection, the command line.

Layer: beside callbacks' inputs; imports ``seeding``, ``metrics``' exact sums and the leaves; the command reads
files, so format constants live with the formats here, never in a callback.
"""
