"""Preemption latency during a long validation pass: signal -> checkpoint on disk -> every process gone.

A 2-rank fork job (DeterministicDDPStrategy, gloo) whose validation pass takes `--batches` x `--batch-seconds` per
rank; the whole process group gets SIGTERM once both ranks are inside the pass. Before, PreemptionCheckpoint waited
for the pass to end (and for the next training step): the latency was the pass's length. Printed side by side:
the pass's length, the time to the checkpoint and the time until the job has exited.

    python benchmarks/preemption.py [--batches 40] [--batch-seconds 0.1] [--repeats 3]
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(out: Path, batches: int, seconds: float) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_determinism import DeterministicDDPStrategy, PreemptionCheckpoint

    torch.set_num_threads(1)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def validation_step(self, batch, batch_idx):
            if batch_idx == 1 and not self.trainer.sanity_checking:
                (out / f"in-validation{self.global_rank}").write_text("")
            time.sleep(seconds)  # a long validation step

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)

        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(2 * batches, 8)), batch_size=1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        strategy=DeterministicDDPStrategy(seed=1, start_method="fork"), accelerator="cpu", devices=2, max_epochs=2,
        callbacks=[PreemptionCheckpoint(out)], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(out), enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(Net())


def once(batches: int, seconds: float) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        command = [sys.executable, __file__, "--child", str(out), str(batches), str(seconds)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                start_new_session=True)  # fmt: skip
        while not all((out / f"in-validation{r}").exists() for r in (0, 1)):
            if proc.poll() is not None:
                raise SystemExit(f"the job ended early ({proc.returncode})")
            time.sleep(0.001)
        start = time.perf_counter()
        os.killpg(proc.pid, signal.SIGTERM)
        while not (out / "preempted.ckpt").exists():
            if proc.poll() is not None:
                raise SystemExit(f"the job ended without a checkpoint ({proc.returncode})")
            time.sleep(0.001)
        saved = time.perf_counter() - start
        proc.wait()
        return saved, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=40, help="validation batches per rank")
    parser.add_argument("--batch-seconds", type=float, default=0.1, help="seconds per validation batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = [once(args.batches, args.batch_seconds) for _ in range(args.repeats)]
    length = args.batches * args.batch_seconds
    print(f"validation pass: {args.batches} batches x {args.batch_seconds:.2f} s = {length:.2f} s per rank")
    print("| | before (waited for the pass to end) | now: signal -> checkpoint | now: signal -> job exited |")
    print("|---|---|---|---|")
    saved = statistics.median(r[0] for r in runs)
    gone = statistics.median(r[1] for r in runs)
    print(f"| median of {args.repeats} | >= {length:.2f} s | {saved:.2f} s | {gone:.2f} s |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
