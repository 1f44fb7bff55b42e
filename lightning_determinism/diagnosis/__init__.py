"""Where two runs diverge and why: the divergence probe and its files.

``recorder`` (any loop) and ``probe`` (the Trainer callback) write a probe file per run (``probe_file``, built from
``digest`` and the module ``hooks``).
"""

from lightning_determinism.diagnosis.probe import DivergenceProbe
from lightning_determinism.diagnosis.probe_file import ProbeFileError, load_probe
from lightning_determinism.diagnosis.recorder import ProbeRecorder

__all__ = ["DivergenceProbe", "ProbeFileError", "ProbeRecorder", "load_probe"]
