"""A fit whose ranks record their pids after one training step and then block: the launcher tests kill its main
process and check that no rank outlives it.

python launch_checks.py fork OUT    # ddp_fork_deterministic, 1 device, after the parent used its OpenMP pool
python launch_checks.py popen OUT   # ddp_deterministic (popen), 2 devices
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning as L  # noqa: E402
from torch import nn  # noqa: E402

import lightning_determinism  # noqa: E402, F401  (registers the strategies)


class Blocking(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.layer = nn.Linear(256, 256)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).square().mean()  # a multi-threaded op where the fork hang happened
        pid_file = Path(self.out, f"rank{self.global_rank}.pid")
        pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
        pid_file.with_suffix(".tmp").replace(pid_file)  # appears whole: the test reads it as soon as it exists
        time.sleep(600)  # stand-in for a rank stuck in a collective
        return loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 256), batch_size=32)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "fork":
        torch.set_num_threads(2)
        torch.randn(1500, 1500) @ torch.randn(1500, 1500)  # the parent's OpenMP pool is now running
        strategy, devices = "ddp_fork_deterministic", 1
    else:
        strategy, devices = "ddp_deterministic", 2
    if "LOCAL_RANK" not in os.environ:  # the popen launcher's child script runs this file again
        main_file = Path(out, "main.pid")
        main_file.with_suffix(".tmp").write_text(str(os.getpid()))
        main_file.with_suffix(".tmp").replace(main_file)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Blocking(out))
