"""Step time: world-size-invariant FSDP2 against stock FSDP2 (Lightning's ModelParallelStrategy), 2 CPU processes.

An MLP of 4 layers 512 wide (about 1 M parameters), each layer and the root `fully_shard`-ed over the data-parallel
mesh; 16 samples per optimizer step in micro-batches of 4 (2 per rank per step: Lightning's gradient accumulation for
the stock run, the invariant mode's own for ours); Adam. The median step time of steps 5-40 on rank 0 (from one
`on_train_batch_start` at a step's first micro-batch to the next), each variant in fresh forked ranks, `--repeats`
times in alternation, Lightning's popen launcher for both. Ours: DeterministicModelParallelStrategy(
global_batch_size=16, micro_batch_size=4).

    python benchmarks/invariant_fsdp.py [--repeats 3]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_determinism import DeterministicModelParallelStrategy  # noqa: E402

STEPS, WARMUP = 40, 5


class Net(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out, self.net, self.times, self._start = out, None, [], None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        from torch.distributed.fsdp import fully_shard

        layers = [nn.Linear(64, 512), nn.ReLU()] + [m for _ in range(3) for m in (nn.Linear(512, 512), nn.ReLU())]
        self.net = nn.Sequential(*layers, nn.Linear(512, 1))
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if batch_idx % 2 == 0:  # a step's first micro-batch on this rank
            now = time.perf_counter()
            if self._start is not None:
                self.times.append(now - self._start)
            self._start = now

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            Path(self.out).write_text(str(statistics.median(self.times[WARMUP:]) * 1e3))

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16 * (STEPS + 1), 64, generator=gen), torch.randn(16 * (STEPS + 1), 1))
        return DataLoader(data, batch_size=4)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def fit(variant: str, out: str) -> None:
    if variant == "stock":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        extra = {"accumulate_grad_batches": 2}
    else:
        strategy = DeterministicModelParallelStrategy(
            seed=1, data_parallel_size=2, tensor_parallel_size=1, global_batch_size=16, micro_batch_size=4
        )
        extra = {}
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, **extra,
    )  # fmt: skip
    torch.manual_seed(1)
    trainer.fit(Net(out))


def run(variant: str) -> float:
    """One variant in its own processes (Lightning's popen launcher for both)."""
    import os
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "median")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, __file__, "--variant", variant, "--out", out], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        return float(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.variant is not None:  # a run (and, under the popen launcher, its second rank)
        fit(args.variant, args.out)
        return
    times: dict[str, list[float]] = {"stock": [], "invariant": []}
    for _ in range(args.repeats):
        for variant in times:
            times[variant].append(run(variant))
    stock = statistics.median(times["stock"])
    print(f"median step (ms) over {args.repeats} repeats, 2 CPU processes, FSDP2, 16 samples per step")
    for variant, values in times.items():
        ratio = statistics.median(values) / stock
        spread = f"{min(values):.2f}-{max(values):.2f}"
        print(f"{variant:>10}: {statistics.median(values):7.2f} ms  (spread {spread})  {ratio:.2f}x")


if __name__ == "__main__":
    main()
