"""The world-size-invariant reduction at scale: counted on 2, 4 and 8 gloo processes, then modelled for a cluster.

1. Simulation. A ~1.1M-parameter MLP (dropout, LayerNorm; FSDP2: every Linear and the root `fully_shard`-ed) trains
   for a few optimizer steps of B = 32 samples in M = 16 micro-batches of 2 on W = 2, 4 and 8 forked CPU processes,
   under the invariant mode and under stock DDP / stock FSDP2 with the same accumulation (K = M / W). Per process and
   optimizer step: the bytes its collectives send (torch.distributed's collectives wrapped in the main process before
   the fork, counted as tests/helpers/collective_bytes.py says; FSDP2's all-gathers of parameters, the same in both,
   left out), its collective calls, the gradient bytes it holds between micro-batches (DDP: `.grad` and the
   invariant tree's subtree sums; FSDP2: the sharded `.grad` and the invariant reduction's kept chunks) and the
   median step time. 0.1.0's column comes from the cost model (`lightning_determinism.invariance.cost`), which the
   counts check: the "model" column next to each count.
   8 processes on this machine's cores are oversubscribed: step times there say little about a cluster.
2. The cost model for W = 64, 256 and 1,024 and a 7B-parameter model with float32 gradients (N = 28 GB), M = 1,024
   micro-batches per step.

    python benchmarks/invariant_scale.py [--sizes 2 4 8] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_determinism import DeterministicDDPStrategy, DeterministicModelParallelStrategy  # noqa: E402
from lightning_determinism._compat.checks import available  # noqa: E402
from lightning_determinism._compat.features import INVARIANT_FSDP2  # noqa: E402
from lightning_determinism.invariance.cost import reduction_cost  # noqa: E402
from tests.helpers import collective_bytes  # noqa: E402

B, M_SIZE = 32, 2
MICRO_BATCHES = B // M_SIZE
WIDTH = 512
WARMUP = 2  # steps left out of the median time


def _layers() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, WIDTH), nn.LayerNorm(WIDTH), nn.ReLU(), nn.Dropout(0.1), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1),
    )  # fmt: skip


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard
    return local.numel() * local.element_size()


class Measured(L.LightningModule):
    """Rank-wise: bytes and calls of the collectives, gradient bytes held between micro-batches, step times."""

    def __init__(self, out: str, fsdp: bool) -> None:
        super().__init__()
        self.out, self.fsdp = out, fsdp
        self.net: nn.Sequential | None = None
        self.held: list[int] = []
        self.stamps: list[float] = []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = _layers()
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self) -> None:
        collective_bytes.start()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        held = sum(_local_bytes(p.grad) for p in self.parameters())
        if self.fsdp:
            from torch.distributed.fsdp import FSDPModule

            for module in self.net.modules():
                scatter = getattr(module, "_ldet_reduce_scatter", None) if isinstance(module, FSDPModule) else None
                held += scatter.held_bytes() if scatter is not None else 0
        else:
            invariant = getattr(self.trainer.strategy, "invariant", None)
            tree = getattr(invariant, "_tree", None)
            for _, sums in getattr(tree, "_stack", []):
                held += sum(_local_bytes(s) for s in sums if s.numel())
        self.held.append(held)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.stamps.append(time.perf_counter())

    def on_train_end(self) -> None:
        collective_bytes.stop()
        steps = int(self.trainer.global_step)
        counts = collective_bytes.counts()
        gradient = sum(sent for name, sent in counts["by_name"].items() if not name.startswith("all_gather"))
        if not self.fsdp:
            gradient = counts["bytes"]  # DDP gathers gradients, not parameters
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)][WARMUP - 1 :]
        record = {
            "bytes": gradient / steps,
            "calls": counts["calls"] / steps,
            "held": max(self.held),
            "step_ms": statistics.median(gaps) * 1e3 if gaps else float("nan"),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in _layers().parameters()),
        }
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(record))

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        samples = B * self.trainer.max_steps
        data = TensorDataset(torch.randn(samples, 64, generator=gen), torch.randn(samples, 1, generator=gen))
        return DataLoader(data, batch_size=M_SIZE, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class _StockDDP(DDPStrategy):
    """Lightning's DDP with torch's Python all-reduce hook (what DDP's C++ reduction does), which the wrapper sees."""

    def _register_ddp_hooks(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.model.register_comm_hook(None, allreduce_hook)


def fit(root: Path, kind: str, ranks: int, steps: int) -> dict:
    """One fit; ``kind``: ddp / fsdp2 (invariant) or stock-ddp / stock-fsdp2; the worst rank's figures."""
    out = root / f"{kind}-{ranks}"
    out.mkdir()
    invariant = {"global_batch_size": B, "micro_batch_size": M_SIZE}
    extra: dict = {}
    parallel = {"data_parallel_size": ranks, "tensor_parallel_size": 1, "start_method": "fork"}
    if kind == "ddp":
        strategy = DeterministicDDPStrategy(seed=3, start_method="fork", **invariant)
    elif kind == "fsdp2":
        strategy = DeterministicModelParallelStrategy(seed=3, **parallel, **invariant)
    elif kind == "stock-ddp":
        strategy = _StockDDP(start_method="fork")
        extra["accumulate_grad_batches"] = MICRO_BATCHES // ranks
    else:  # FSDP2's own reduce-scatter (ours without the mode: Lightning's ModelParallelStrategy cannot fork)
        strategy = DeterministicModelParallelStrategy(seed=3, **parallel)
        extra["accumulate_grad_batches"] = MICRO_BATCHES // ranks
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=ranks, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, **extra,
    )  # fmt: skip
    trainer.fit(Measured(str(out), fsdp="fsdp2" in kind))
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    return {key: max(record[key] for record in records) for key in records[0]}


def _mb(value: float) -> str:
    return f"{value / 2**20:7.2f}"


def simulate(sizes: list[int], steps: int) -> None:
    import pytest

    kinds = [("ddp", "DDP")] + ([("fsdp2", "FSDP2")] if available(INVARIANT_FSDP2) else [])
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        collective_bytes.wrap_collectives(patch)  # the forked ranks inherit the wrappers
        runs = {(kind, w): fit(Path(tmp), kind, w, steps) for kind, _ in kinds for w in sizes}
        runs.update(
            {(f"stock-{kind}", w): fit(Path(tmp), f"stock-{kind}", w, steps) for kind, _ in kinds for w in sizes}
        )
    gradient = runs[kinds[0][0], sizes[0]]["parameter_bytes"]
    print(f"1. Simulation: {gradient / 2**20:.2f} MiB of float32 gradients, M = {MICRO_BATCHES} micro-batches per"
          f" step, {steps} steps; per process and optimizer step (MiB, ms)")  # fmt: skip
    for kind, name in kinds:
        print(
            f"\n{name:5} W  K | sent: stock  invariant (model)  0.1.0 (model) ours/stock | calls (all): stock  ours"
            " | held: stock  ours (model) | step ms: stock  ours"
        )
        for w in sizes:
            stock, ours = runs[f"stock-{kind}", w], runs[kind, w]
            model = reduction_cost(kind, "invariant", w, MICRO_BATCHES, gradient)
            old = reduction_cost(kind, "0.1.0", w, MICRO_BATCHES, gradient)
            print(f"{'':5} {w:<2} {MICRO_BATCHES // w:>2} | {_mb(stock['bytes'])} {_mb(ours['bytes'])}"
                  f" ({_mb(model.bytes_sent)}) {_mb(old.bytes_sent)}       {ours['bytes'] / stock['bytes']:5.3f}x"
                  f" | {stock['calls']:15.1f} {ours['calls']:5.1f} | {_mb(stock['held'])} {_mb(ours['held'])}"
                  f" ({_mb(model.gradient_bytes)}) | {stock['step_ms']:9.1f} {ours['step_ms']:6.1f}")  # fmt: skip
    print("\nheld: the most seen between micro-batches; the model's figure is the peak, with the gradient of the"
          " micro-batch in its backward\n(8 processes share this machine's cores: oversubscribed, their step times are"
          " not a cluster's)")  # fmt: skip


def model_at_scale() -> None:
    n, micro = 7e9 * 4, 1024
    print(f"\n2. Cost model: a 7B-parameter model, float32 gradients (N = {n / 1e9:.0f} GB), M = {micro} micro-batches"
          " per step; per process and optimizer step (GB)")  # fmt: skip
    for strategy in ("ddp", "fsdp2"):
        print(
            f"\n{strategy.upper():5} {'W':>5} {'K':>4} | sent: stock invariant   0.1.0 | rounds: stock inv 0.1.0"
            " | held: stock invariant   0.1.0"
        )
        for w in (64, 256, 1024):
            cost = {r: reduction_cost(strategy, r, w, micro, n) for r in ("stock", "invariant", "0.1.0")}
            sent = " ".join(f"{cost[r].bytes_sent / 1e9:{width}.2f}" for r, width in
                            (("stock", 11), ("invariant", 9), ("0.1.0", 7)))  # fmt: skip
            rounds = " ".join(
                f"{cost[r].rounds:{width}}" for r, width in (("stock", 13), ("invariant", 3), ("0.1.0", 5))
            )
            held = " ".join(f"{cost[r].gradient_bytes / 1e9:{width}.2f}" for r, width in
                            (("stock", 11), ("invariant", 9), ("0.1.0", 7)))  # fmt: skip
            print(f"{'':5} {w:>5} {micro // w:>4} |{sent} |{rounds} |{held}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's advice on small CPU runs: the ranks inherit the filter
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_determinism"):
        logging.getLogger(name).setLevel(logging.ERROR)
    simulate(args.sizes, args.steps)
    model_at_scale()


if __name__ == "__main__":
    main()
