"""One process, DDP, FSDP2 and tensor parallel side by side: numbers first, then memory and communication.

The method: record a numerical baseline on one process (loss, whole-tensor gradient norms, parameter digests per
step), check that each distributed run stays within tolerance of it on the same global batch, and only then compare
their peak memory and communication time. Each run records 20 optimizer steps of a tiny language model (the corpus
and sizes of ``tensor_parallel_lm.py``, no dropout: plain DDP draws its masks per rank) with ``NumericalBaseline``,
then one ``lightning-determinism compare`` prints the table and draws the plot (loss per step per run; gradient-norm
differences from the one-process run), ``compare_parallelisms.png`` next to this file.

Every run sees the same 8 sequences per step, in order: one process takes all 8; under DDP and FSDP2 each of the 2
data-parallel ranks takes every other one (Lightning's ``DistributedSampler``, no shuffling); under tensor parallel
both ranks take all 8. All start from the same weights (built under the base seed in ``configure_model``; the
model-parallel strategies shard that one-process model). They may differ by the order of float sums only.

    python examples/compare_parallelisms.py            # 1 process, DDP 2, FSDP2 2, tensor parallel 2
    python examples/compare_parallelisms.py --four     # ... and FSDP2 x tensor parallel, 2 x 2 on 4 processes
    python examples/compare_parallelisms.py --json     # the table as JSON
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
from tensor_parallel_lm import VOCAB, WIDTH, corpus  # noqa: E402  (one intra-op thread; the corpus and sizes)

from lightning_determinism import (  # noqa: E402
    DeterministicDDPStrategy,
    DeterministicModelParallelStrategy,
    NumericalBaseline,
)
from lightning_determinism.divergence.cli import main as cli  # noqa: E402

GLOBAL_BATCH = 8
SEED = 7
PLOT = Path(__file__).resolve().with_suffix(".png")

# name: (devices, data_parallel_size, tensor_parallel_size, model parallel strategy?)
RUNS = {
    "one": (1, 1, 1, False),
    "ddp2": (2, 2, 1, False),
    "fsdp2": (2, 2, 1, True),
    "tp2": (2, 1, 2, True),
    "fsdp2xtp2": (4, 2, 2, True),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))  # column- then row-parallel under tensor parallelism
        return self.head(self.norm(h))


class ParallelLM(L.LightningModule):
    """The same model on any strategy; under ``ModelParallelStrategy`` the plan is applied in ``configure_model``."""

    def __init__(self, data_parallel: int = 1, lr: float = 3e-3) -> None:
        super().__init__()
        self.data_parallel, self.lr = data_parallel, lr
        self.model: Net | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = Net()
        if not isinstance(self.trainer.strategy, DeterministicModelParallelStrategy):
            return
        from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            parallelize_module(self.model, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if dp.size() > 1:
            fully_shard(self.model, mesh=dp)

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self.model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def train_dataloader(self):
        # No shuffling: one process takes sequences 0-7 per step, 2 data-parallel ranks 0, 2, 4, 6 and 1, 3, 5, 7.
        return DataLoader(TensorDataset(corpus()), batch_size=GLOBAL_BATCH // self.data_parallel, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def trainer_for(name: str, steps: int, callbacks: Sequence[L.Callback]) -> L.Trainer:
    """A Trainer for run ``name`` of :data:`RUNS`: forked CPU processes under gloo, ``steps`` optimizer steps."""
    devices, dp, tp, model_parallel = RUNS[name]
    if model_parallel:
        strategy: L.pytorch.strategies.Strategy = DeterministicModelParallelStrategy(
            seed=SEED, data_parallel_size=dp, tensor_parallel_size=tp, start_method="fork"
        )
    else:
        strategy = DeterministicDDPStrategy(seed=SEED, start_method="fork")
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def record(
    name: str, path: Path, steps: int = 20, lr: float = 3e-3, callbacks: Sequence[L.Callback] = (), comm_every: int = 5
) -> Path:
    """Record run ``name`` of :data:`RUNS` into ``path`` (``callbacks`` run before the baseline: faults, in tests)."""
    baseline = NumericalBaseline(path, steps=steps, comm_every=comm_every)
    trainer_for(name, steps, [*callbacks, baseline]).fit(ParallelLM(data_parallel=RUNS[name][1], lr=lr))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--four", action="store_true", help="also FSDP2 x tensor parallel, 2 x 2 on 4 processes")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="where to keep the baseline files (default: a temporary folder)")
    parser.add_argument("--plot", default=str(PLOT), help=f"the PNG to write (default: {PLOT.name} next to this file)")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    names = [name for name in RUNS if args.four or RUNS[name][0] <= 2]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        plot = ["--plot", str(Path(args.plot).resolve())]
        if importlib.util.find_spec("matplotlib") is None:  # the plot needs the `plot` extra
            print('(no plot: matplotlib is not installed; pip install -e ".[plot]")', flush=True)
            plot = []
        for name in names:
            record(name, out / f"{name}.json", steps=args.steps)
        here = os.getcwd()
        os.chdir(out)  # the table names the runs by their files: one.json, ddp2.json, ...
        try:
            return cli(["compare", *(f"{name}.json" for name in names), *plot, *(["--json"] * args.json)])
        finally:
            os.chdir(here)


if __name__ == "__main__":
    raise SystemExit(main())
