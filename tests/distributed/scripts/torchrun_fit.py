"""Started by torchrun on each 'node': a short fit under the deterministic DDP strategy."""

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning_determinism  # noqa: E402, F401  (registers the strategies)
from tests.lightning_models import RecordingModule, quiet_trainer  # noqa: E402

if __name__ == "__main__":
    out_dir = sys.argv[1]
    trainer = quiet_trainer("ddp_deterministic", devices=1, num_nodes=2, max_epochs=1)
    trainer.fit(RecordingModule(out_dir, n=16))
