"""Time to the first batch of a resumed stream epoch, at 90 % of the epoch vs at its start, per path.

    python benchmarks/streaming.py [--samples 20000] [--batch-size 32] [--workers 2] [--repeats 3]
                                   [--litdata-samples 2000]

Paths: a user's IterableDataset with the state protocol (restored in O(1)), the same without it (replayed in the
workers from the epoch's seeds), Hugging Face streaming (unshuffled: its state; shuffled: replay) and litdata (its
own state), where installed; a user's stream resumed with twice the workers (elastic: each new worker plays every
old stream); beside them, what skipping by reading the batches costs (re-iterating the loader up to
the position, as accelerate's and the HF Trainer's `skip_first_batches` do). No model: only the data side is timed.
The issue's goal: at most 1.1x with a state protocol; replay is O(position), without model compute.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_determinism.data.positions import PLAN_ATTR  # noqa: E402
from lightning_determinism.data.resumable import make_resumable  # noqa: E402


class Samples(IterableDataset):
    """``n`` samples split over the workers; each sample costs a little work (a 256-value draw and a sum)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.start = 0

    def _mine(self) -> range:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return range(worker, self.n, workers)

    def __iter__(self):
        ids = self._mine()
        for i in ids[self.start :]:
            noise = torch.randn(256)
            yield {"id": i, "x": noise[:64] + noise.sum()}


class StatefulSamples(Samples):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.done = 0

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = int(state["done"])

    def __iter__(self):
        self.done = self.start
        for sample in super().__iter__():
            self.done += 1
            yield sample
        self.start = 0


def loader(dataset: Any, args: argparse.Namespace, workers: int | None = None) -> Any:
    workers = args.workers if workers is None else workers
    return make_resumable(DataLoader(dataset, batch_size=args.batch_size, num_workers=workers), None)


def first_batch_seconds(make_dataset: Any, args: argparse.Namespace, fraction: float, elastic: bool = False) -> float:
    """Seconds from a new converted loader, resuming at ``fraction`` of the epoch, to its first batch.

    ``elastic``: the resumed loader has twice the workers (another grid: every new worker plays the old streams).
    """
    batches = int(args.samples / args.batch_size * fraction)
    position = None
    if batches:
        straight = loader(make_dataset(), args)
        iterator = iter(straight)
        for _ in range(batches):
            next(iterator)
        position = straight._ldet_position.at(batches)
        del iterator
    resumed = loader(make_dataset(), args, 2 * args.workers if elastic else None)
    if position is not None:
        setattr(resumed, PLAN_ATTR, {"epoch": 0, "stream": position, "grid": [position]})
    start = time.perf_counter()
    iterator = iter(resumed)
    next(iterator)
    seconds = time.perf_counter() - start
    del iterator  # its workers stop outside the timed region
    return seconds


def reading_seconds(make_dataset: Any, args: argparse.Namespace, fraction: float) -> float:
    """Skipping by reading: a plain loader iterated up to the position, then the first batch."""
    batches = int(args.samples / args.batch_size * fraction)
    plain = DataLoader(make_dataset(), batch_size=args.batch_size, num_workers=args.workers)
    start = time.perf_counter()
    iterator = iter(plain)
    for _ in range(batches + 1):
        next(iterator)
    seconds = time.perf_counter() - start
    del iterator
    return seconds


def litdata_seconds(directory: str, args: argparse.Namespace, fraction: float) -> float:
    from litdata import StreamingDataLoader, StreamingDataset

    def new() -> Any:
        dataset = StreamingDataset(directory, shuffle=True, seed=1, drop_last=True)
        return StreamingDataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)

    batches = int(args.samples / args.batch_size * fraction)
    state = None
    if batches:
        straight = new()
        iterator = iter(straight)
        for _ in range(batches):
            next(iterator)
        state = straight.state_dict()
        del iterator
    resumed = new()
    if state is not None:
        resumed.load_state_dict(state)
    start = time.perf_counter()
    iterator = iter(resumed)
    next(iterator)
    seconds = time.perf_counter() - start
    del iterator
    return seconds


def _litdata_sample(i: int) -> dict[str, Any]:
    return {"id": i, "x": torch.randn(64, generator=torch.Generator().manual_seed(i)).numpy()}


def hf(n: int, shuffled: bool) -> Any:
    from datasets import Dataset

    features = torch.randn(n, 64, generator=torch.Generator().manual_seed(0)).tolist()  # the same data every time
    stream = Dataset.from_dict({"id": list(range(n)), "x": features}).to_iterable_dataset(8)
    return (stream.shuffle(seed=1, buffer_size=1000) if shuffled else stream).with_format("torch")


def median(fn: Any, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--litdata-samples", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[tuple[str, Any]] = [
        (
            "your stream, state_dict() (restored)",
            lambda f: first_batch_seconds(lambda: StatefulSamples(args.samples), args, f),
        ),
        ("your stream, no protocol (replayed)", lambda f: first_batch_seconds(lambda: Samples(args.samples), args, f)),
        ("skipping by reading the batches", lambda f: reading_seconds(lambda: Samples(args.samples), args, f)),
        (
            f"your stream, {args.workers} -> {2 * args.workers} workers (elastic)",
            lambda f: first_batch_seconds(lambda: Samples(args.samples), args, f, elastic=True),
        ),
    ]
    if importlib.util.find_spec("datasets") is not None:
        rows.append(
            (
                "Hugging Face, unshuffled (its state)",
                lambda f: first_batch_seconds(lambda: hf(args.samples, False), args, f),
            )
        )
        rows.append(
            (
                "Hugging Face, shuffle buffer (replayed)",
                lambda f: first_batch_seconds(lambda: hf(args.samples, True), args, f),
            )
        )
    tmp = tempfile.TemporaryDirectory()
    if importlib.util.find_spec("litdata") is not None:
        from litdata import optimize

        # litdata.optimize writes ~70 samples/s here: a smaller epoch, timed the same way.
        small = argparse.Namespace(**{**vars(args), "samples": args.litdata_samples})
        directory = str(Path(tmp.name) / "optimized")
        inputs = list(range(small.samples))
        method = multiprocessing.get_start_method(allow_none=True)
        optimize(
            fn=_litdata_sample, inputs=inputs, output_dir=directory, chunk_size=100, num_workers=1, mode="overwrite"
        )
        multiprocessing.set_start_method(method, force=True)  # optimize leaves "spawn" set for the whole process
        rows.append((f"litdata (its state), {small.samples} samples", lambda f: litdata_seconds(directory, small, f)))
    print(
        f"time to the first batch, {args.samples} samples per epoch, batches of {args.batch_size},"
        f" {args.workers} workers (median of {args.repeats})"
    )
    print("| path | at 0 % | at 90 % | 90 % / 0 % |\n|---|---|---|---|")
    for name, fn in rows:
        at0, at90 = (median(lambda f=fraction: fn(f), args.repeats) for fraction in (0.0, 0.9))  # noqa: B023
        print(f"| {name} | {at0 * 1e3:,.0f} ms | {at90 * 1e3:,.0f} ms | {at90 / at0:.2f}x |", flush=True)
    tmp.cleanup()


if __name__ == "__main__":
    main()
