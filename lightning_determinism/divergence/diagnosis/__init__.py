"""Where two runs diverge and why: the divergence probe, its files, the diagnosis and the checkpoint bisection.

``recorder`` (any loop) and ``probe`` (the Trainer callback) write a probe file per run (``probe_file``, built from
``digest`` and the module ``hooks``); ``records`` lines two files up and ``diagnose`` names the first record whose
output differs while its inputs matched; ``bisect`` finds the interval of two runs' checkpoints where they part.
"""

from lightning_determinism.divergence.diagnosis.bisect import (
    Bisection,
    bisect_checkpoints,
    checkpoint_fingerprint,
    diagnose_checkpoints,
)
from lightning_determinism.divergence.diagnosis.diagnose import CAUSES, PHASES, diagnose, format_diagnosis
from lightning_determinism.divergence.diagnosis.probe import DivergenceProbe
from lightning_determinism.divergence.diagnosis.probe_file import ProbeFileError, load_probe
from lightning_determinism.divergence.diagnosis.recorder import ProbeRecorder

__all__ = [
    "CAUSES",
    "PHASES",
    "Bisection",
    "DivergenceProbe",
    "ProbeFileError",
    "ProbeRecorder",
    "bisect_checkpoints",
    "checkpoint_fingerprint",
    "diagnose",
    "diagnose_checkpoints",
    "format_diagnosis",
    "load_probe",
]
