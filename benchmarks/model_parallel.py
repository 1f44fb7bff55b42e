"""Step time: DeterministicModelParallelStrategy against Lightning's ModelParallelStrategy, same model and mesh.

A small tensor-parallel language-model block (embedding 64, MLP 256, LayerNorm, dropout on a replicated and on a
sharded activation), tensor_parallel_size=2 on 2 CPU processes (gloo, Lightning's popen launcher for both), 60 steps
of batch 16 x 32 tokens; the median step time of steps 10-60 on rank 0, each variant run `--repeats` times in
alternation. Also the cost of one ReplicaGuard check (digests of the replicated tensors, gathered over the
tensor-parallel group), which the strategy runs every 100 steps by default.

    python benchmarks/model_parallel.py [--repeats 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 60


def run(variant: str, out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_determinism import DeterministicModelParallelStrategy, ReplicaGuard, get_rng_tracker

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(128, 64)
            self.up = nn.Linear(64, 256)
            self.down = nn.Linear(256, 64)
            self.norm = nn.LayerNorm(64)
            self.head = nn.Linear(64, 128)

        def forward(self, tokens):
            h = torch.relu(self.up(self.embed(tokens)))
            if variant == "deterministic":
                with get_rng_tracker().fork():
                    h = nn.functional.dropout(h, 0.1)
            else:
                h = nn.functional.dropout(h, 0.1)
            h = nn.functional.dropout(self.down(h), 0.1)
            return self.head(self.norm(h))

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, trainer, *args) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *args) -> None:
            self.times.append(time.perf_counter() - self.start)

        def on_train_end(self, trainer, pl_module) -> None:
            guard = ReplicaGuard(0)
            start, diverged = time.perf_counter(), None
            try:
                for _ in range(5):
                    guard.check(trainer, pl_module)
            except RuntimeError as error:  # stock: rank 0 computes with more threads, so the replicas drift
                diverged = str(error).split("] ", 1)[-1].split(": tensor-parallel peers")[0]
            if trainer.is_global_zero:
                check = (time.perf_counter() - start) / 5
                record = {"steps": self.times, "check": check, "diverged": diverged}
                (out / "times.json").write_text(json.dumps(record))

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                self.model = Block()
                parallelize_module(self.model, self.device_mesh["tensor_parallel"],
                                   {"up": ColwiseParallel(), "down": RowwiseParallel()})  # fmt: skip

        def training_step(self, batch, batch_idx):
            logits = self.model(batch[0][:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, 128), batch[0][:, 1:].reshape(-1))

        def train_dataloader(self):
            tokens = torch.randint(128, (16 * STEPS, 33), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(tokens), batch_size=16)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    if variant == "deterministic":
        strategy = DeterministicModelParallelStrategy(seed=1, tensor_parallel_size=2, debug_mode="warn")
        callbacks = [Timer(), ReplicaGuard(0)]  # the step alone; the guard's cost is measured apart
    else:
        L.seed_everything(1)
        strategy = ModelParallelStrategy(tensor_parallel_size=2)
        callbacks = [Timer()]
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(LM())


def measure(variant: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "LDET_BENCH_OUT": tmp}
        done = subprocess.run([sys.executable, __file__, "--variant", variant], env=env, capture_output=True, text=True)
        path = Path(tmp) / "times.json"
        if not path.exists():  # written at the end of training, before the processes exit
            raise SystemExit(f"{variant}: no figures ({done.returncode}): {done.stderr[-2000:]}")
        return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=["stock", "deterministic"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        run(args.variant, Path(os.environ["LDET_BENCH_OUT"]))
        return
    medians: dict[str, list[float]] = {"stock": [], "deterministic": []}
    checks, diverged = [], {}
    for _ in range(args.repeats):
        for variant in medians:
            result = measure(variant)
            medians[variant].append(statistics.median(result["steps"][10:]))
            diverged[variant] = result["diverged"]
            if variant == "deterministic":
                checks.append(result["check"])
    stock, ours = statistics.median(medians["stock"]), statistics.median(medians["deterministic"])
    print("| tensor_parallel_size=2, 2 CPU processes | median step (ms) | ratio |")
    print("|---|---|---|")
    print(f"| ModelParallelStrategy (stock) | {stock * 1e3:.2f} | 1.00 |")
    print(f"| DeterministicModelParallelStrategy | {ours * 1e3:.2f} | {ours / stock:.2f} |")
    print(
        f"| one ReplicaGuard check | {statistics.median(checks) * 1e3:.2f} | {statistics.median(checks) / stock:.2f} |"
    )
    print(f"replicas after {STEPS} steps (ReplicaGuard): stock {diverged['stock'] or 'equal'};"
          f" deterministic {diverged['deterministic'] or 'equal'}")  # fmt: skip
    print(f"per repeat, stock: {[round(m * 1e3, 2) for m in medians['stock']]}, ours: "
          f"{[round(m * 1e3, 2) for m in medians['deterministic']]}")  # fmt: skip


if __name__ == "__main__":
    main()
