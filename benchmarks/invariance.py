"""The cost and the accuracy of world-size-invariant training on 2 gloo processes.

1. Median optimizer-step time of the invariant mode against `DeterministicDDPStrategy` with the same micro-batches
   (accumulate_grad_batches = K), for the tiny LM of examples/tiny_lm.py and a ~10M-parameter MLP (target <= 1.05x),
   and where the invariant mode's own time goes: local accumulation (taking each micro-batch's gradient into the
   tree), exchange calls (starting each bucket's chunk exchange during the last backward, and the owner's sum and
   all-gather when its chunks arrive), finishing the tree (waiting for what the backward started, dividing the root,
   setting the gradients).
2. Accuracy: the averaged gradient of one step against a float64 reference, for the invariant tree and for float32
   DDP (local accumulation in .grad, then a gloo all-reduce): the largest relative error over the gradient's elements
   (denominators at least 1e-3 of the largest) and the relative L2 error, worst over a few steps.
   Both sum the same float32 micro-batch gradients (16 per step, 8 per process); the reference sums them in float64.

    python benchmarks/invariance.py [--steps 12] [--rounds 3] [--reseed-only]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from tiny_lm import TinyLM, build_data  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Subset, TensorDataset  # noqa: E402

import lightning_determinism.invariance.exchange as exchange  # noqa: E402
import lightning_determinism.invariance.tree as tree  # noqa: E402
from lightning_determinism import DeterministicDDPStrategy  # noqa: E402

TIMES: dict[str, float] = {"local accumulation": 0.0, "exchange calls": 0.0, "finishing the tree": 0.0}


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - start

    return wrapper


def instrument() -> None:
    """Time the invariant mode's own steps (inherited by the forked ranks)."""
    tree.GradientTree.add_leaf = _timed("local accumulation", tree.GradientTree.add_leaf)
    tree.GradientTree.finish = _timed("finishing the tree", tree.GradientTree.finish)
    # Starting the chunk exchange (all_to_all) and its second half (the owner's sum, then all_gather), bucket by bucket
    exchange.ChunkExchange.reduce = _timed("exchange calls", exchange.ChunkExchange.reduce)
    tree.ChunkExchange = _timed("exchange calls", exchange.ChunkExchange)


class StepClock(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.stamps = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.fit_loop._should_accumulate():
            self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            steps = [b - a for a, b in itertools.pairwise(self.stamps[2:])]  # after two warm-up steps
            self.out.write_text(json.dumps({"step": statistics.median(steps), "steps": len(steps), **TIMES}))


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(1024, 2048), nn.ReLU(), nn.Dropout(0.1), nn.Linear(2048, 2048), nn.ReLU(),
            nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 1),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _mlp_data(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1024, generator=gen), torch.randn(n, 1, generator=gen))


def time_steps(name: str, mode: str, steps: int) -> dict:
    if name == "tiny LM":
        train, _, vocab = build_data()
        m, B = 16, 64
        data, module = Subset(train, range(len(train) // B * B)), TinyLM(vocab)
    else:
        m, B = 32, 128
        data, module = _mlp_data(B * (steps + 3)), MLP()
    kwargs = {"global_batch_size": B, "micro_batch_size": m} if mode == "invariant" else {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        trainer = L.Trainer(
            strategy=DeterministicDDPStrategy(seed=0, start_method="fork", **kwargs),
            accelerator="cpu",
            devices=2,
            max_steps=steps + 3,
            accumulate_grad_batches=1 if mode == "invariant" else B // m // 2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[StepClock(out)],
        )
        trainer.fit(module, DataLoader(data, batch_size=m, shuffle=True))
        return json.loads(out.read_text())


METRICS = ("max relative error", "relative L2 error")


def _accuracy_rank(rank: int, world: int, store: str, out: str, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = MLP().net
    data = _mlp_data(128 * steps)
    m, micro = 8, 16  # 16 micro-batches per step, 8 per process
    per_rank = micro // world
    errors = {f"{name}: {metric}": 0.0 for name in ("invariant tree", "float32 DDP") for metric in METRICS}
    parameters = list(model.parameters())
    for step in range(steps):
        leaves = []  # every micro-batch's float32 gradient (loss scaled by 1/K): what both ways sum
        for j in range(micro):
            x, y = data[(step * micro + j) * m : (step * micro + j + 1) * m]
            model.zero_grad()
            (nn.functional.mse_loss(model(x), y) / per_rank).backward()
            leaves.append([p.grad.clone() for p in parameters])
        flat = [torch.cat([g.reshape(-1) for g in leaf]) for leaf in leaves]
        reference = torch.stack([f.double() for f in flat]).sum(dim=0) / world  # float64 sum, then the same scaling
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        ddp = torch.zeros_like(flat[0])
        for j in mine:  # DDP: .grad accumulates the micro-batches one after the other, then all-reduce, / W
            ddp += flat[j]
        dist.all_reduce(ddp)
        ddp /= world
        gradients = tree.GradientTree(parameters, per_rank, world)
        for j in mine:
            for p, g in zip(parameters, leaves[j], strict=True):
                p.grad = g.clone()
            gradients.add_leaf()
        gradients.finish(divide_by=world)
        exact = torch.cat([p.grad.reshape(-1) for p in parameters])
        floor = 1e-3 * float(reference.abs().max())  # relative error, the denominator kept off zero
        for name, value in (("invariant tree", exact), ("float32 DDP", ddp)):
            diff = value.double() - reference
            figures = {
                METRICS[0]: (diff.abs() / reference.abs().clamp_min(floor)).max(),
                METRICS[1]: diff.norm() / reference.norm(),
            }
            for metric, figure in figures.items():
                errors[f"{name}: {metric}"] = max(errors[f"{name}: {metric}"], float(figure))
    if rank == 0:
        Path(out).write_text(json.dumps(errors))
    dist.destroy_process_group()


def accuracy(steps: int = 4) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "errors.json")
        mp.start_processes(
            _accuracy_rank, args=(2, os.path.join(tmp, "store"), out, steps), nprocs=2, start_method="fork"
        )
        return json.loads(Path(out).read_text())


def reseed(number: int = 20_000) -> None:
    """The per-micro-batch reseed against numpy's SeedSequence, which derive_seed called before (target <= 5 us)."""
    import timeit

    import numpy as np

    from lightning_determinism.invariance.invariant import micro_batch_seed, reseed_for_micro_batch
    from lightning_determinism.seeding.seeds import StepSeeds, _key_words

    def numpy_seed(*keys) -> int:
        words = [w for key in keys for w in _key_words(key)]
        return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint32)[0])

    def per_call(fn) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    step = iter(range(10**9))
    seeds = StepSeeds(42, "micro-batch")  # what the invariant mode calls: a step's hash state kept between calls

    def new_step_derive() -> None:  # micro-batch 0 of a new step: the step's prefix is not cached yet
        reseed_for_micro_batch(micro_batch_seed(42, next(step), 0))

    def new_step_reseed() -> None:
        reseed_for_micro_batch(seeds(next(step), 0))

    prepared_steps = iter(range(10**9))

    def prepared_step_reseed() -> None:  # what the invariant mode does: the step was hashed during the last one
        n = next(prepared_steps)
        seeds.prepare(n)
        start = time.perf_counter()
        reseed_for_micro_batch(seeds(n, 0))
        prepared_times.append(time.perf_counter() - start)

    prepared_times: list[float] = []

    rows = [
        ("numpy SeedSequence (derive_seed before)", lambda: numpy_seed(42, "micro-batch", 7, 3)),
        ("derive_seed, cached step prefix", lambda: micro_batch_seed(42, 7, 3)),
        ("derive_seed + reseed, first micro-batch of a step", new_step_derive),
        ("StepSeeds, later micro-batch of a step", lambda: seeds(7, 3)),
        ("reseed, later micro-batch of a step", lambda: reseed_for_micro_batch(seeds(7, 3))),
        ("reseed, first micro-batch of a new step, not prepared", new_step_reseed),
    ]
    print("\n3. per-micro-batch reseed (seed + CPU generator), per call; target <= 5 us")
    for name, fn in rows:
        print(f"   {name:52s}{per_call(fn):>8.2f} us")
    timeit.repeat(prepared_step_reseed, number=number, repeat=5)
    prepared_us = statistics.median(prepared_times) * 1e6  # timed around the reseed alone (prepare() is not in it)
    print(f"   {'reseed, first micro-batch of a prepared step':52s}{prepared_us:>8.2f} us   (the invariant mode's)")
    prepare_us = per_call(lambda: seeds.prepare(next(step)))
    print(f"   {'  prepare(step) itself, during the last step':52s}{prepare_us:>8.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3, help="alternating DDP/invariant fits per model")
    parser.add_argument("--reseed-only", action="store_true", help="only section 3 (no multi-process runs)")
    args = parser.parse_args()
    if args.reseed_only:
        reseed()
        return
    instrument()
    print("1. median optimizer-step time on 2 gloo processes (same micro-batches)")
    print(f"   {'':34s}{'DDP':>12s}{'invariant':>12s}{'ratio':>10s}   invariant mode's own time per step")
    for name in ("tiny LM", "~10M-parameter MLP"):
        # Alternating rounds, so that the machine's drift hits both modes alike; the median round of each.
        rounds = {mode: [time_steps(name, mode, args.steps) for _ in range(1)] for mode in ("ddp", "invariant")}
        for _ in range(args.rounds - 1):
            for mode in ("ddp", "invariant"):
                rounds[mode].append(time_steps(name, mode, args.steps))
        ddp, inv = (sorted(rounds[mode], key=lambda r: r["step"])[len(rounds[mode]) // 2] for mode in rounds)
        parts = ", ".join(f"{k} {inv[k] / (inv['steps'] + 3) * 1e3:.1f} ms" for k in TIMES)
        ratio = inv["step"] / ddp["step"]
        print(f"   {name:34s}{ddp['step'] * 1e3:>10.1f}ms{inv['step'] * 1e3:>10.1f}ms{ratio:>9.2f}x   {parts}")
    reseed()
    errors = accuracy()
    print("\n2. averaged gradient vs a float64 sum of the same micro-batch gradients (worst of 4 steps; MLP,")
    print("   16 micro-batches per step on 2 processes)")
    print(f"   {'':34s}" + "".join(f"{metric:>22s}" for metric in METRICS))
    for name in ("float32 DDP", "invariant tree"):
        print(f"   {name:34s}" + "".join(f"{errors[f'{name}: {metric}']:>22.2e}" for metric in METRICS))


if __name__ == "__main__":
    main()
