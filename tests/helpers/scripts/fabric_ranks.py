"""Two Fabric ranks (popen DDP over gloo, no seed anywhere): what each rank built and drew, written as JSON, and
the seed variables each process holds after ``fabric.launch(run)`` returned.

python fabric_ranks.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch import nn  # noqa: E402

import lightning_determinism  # noqa: E402, F401  (registers the strategies in Fabric's registry)


def run(fabric: L.Fabric) -> None:
    before = nn.Linear(8, 8)  # built after launch(), before fabric.setup(): under the agreed base seed
    with fabric.init_module():
        inside = nn.Linear(8, 8)
    fabric.setup(before)
    record = {
        "rank": fabric.global_rank,
        "strategy": type(fabric.strategy).__name__,
        "base": fabric.strategy.base_seed,
        "local": fabric.strategy.local_seed,
        "before": before.weight.tolist(),
        "inside": inside.weight.tolist(),
        "draw": torch.rand(4).tolist(),  # a training-time draw: base + rank
    }
    Path(sys.argv[1], f"rank{fabric.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp_deterministic")
    fabric.launch(run)  # the run ends when run() returns: the strategy puts back what it set in this process
    left = {key: os.environ.get(key) for key in ("PL_GLOBAL_SEED", "LDET_BASE_SEED", "LDET_LOCAL_SEED")}
    Path(sys.argv[1], f"after{fabric.global_rank}.json").write_text(json.dumps(left))


if __name__ == "__main__":
    main()
