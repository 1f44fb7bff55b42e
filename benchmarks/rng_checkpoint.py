"""What RNGStateCheckpoint adds to a checkpoint, per rank: bytes and save/load time, beside the model's own.

Single process, the tiny LM of examples/tiny_lm.py (~70k parameters, Adam) and a larger MLP (~4M parameters).

    python benchmarks/rng_checkpoint.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tiny_lm import TinyLM  # noqa: E402

from lightning_determinism import set_seed  # noqa: E402
from lightning_determinism.seeding.rng import capture_rng_state, restore_rng_state  # noqa: E402


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def serialised(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def measure(name: str, model: nn.Module, repeats: int) -> None:
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward() if isinstance(model, TinyLM) else None
    if not isinstance(model, TinyLM):
        model(torch.zeros(1, 1024)).sum().backward()
    optimizer.step()
    model_state = {"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}
    model_bytes = serialised(model_state)
    rng_bytes = serialised(capture_rng_state())
    save_model = timed(lambda: serialised(model_state), repeats)
    save_rng = timed(lambda: serialised(capture_rng_state()), repeats)
    load_model = timed(lambda: torch.load(io.BytesIO(model_bytes), weights_only=True), repeats)
    load_rng = timed(lambda: restore_rng_state(torch.load(io.BytesIO(rng_bytes), weights_only=True)), repeats)
    print(f"\n{name}")
    print(f"   {'':34s}{'model + optimizer':>20s}{'RNG state (per rank)':>22s}{'ratio':>8s}")
    print(f"   {'serialised size, KiB':34s}{len(model_bytes) / 1024:20.1f}{len(rng_bytes) / 1024:22.1f}"
          f"{len(rng_bytes) / len(model_bytes):8.3f}")  # fmt: skip
    print(f"   {'save (capture + torch.save), ms':34s}{save_model * 1e3:20.2f}{save_rng * 1e3:22.2f}"
          f"{save_rng / save_model:8.3f}")  # fmt: skip
    print(f"   {'load (torch.load + restore), ms':34s}{load_model * 1e3:20.2f}{load_rng * 1e3:22.2f}"
          f"{load_rng / load_model:8.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    set_seed(0)
    measure("tiny LM (examples/tiny_lm.py)", TinyLM(40), args.repeats)
    measure("MLP 1024-2048-1024 (~4M parameters)", nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024)), 5)
    print("\nEach rank adds its RNG entry to the saving rank's file; gathering uses one all_gather_object.")


if __name__ == "__main__":
    main()
