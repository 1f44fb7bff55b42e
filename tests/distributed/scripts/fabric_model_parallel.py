"""A Fabric loop under DeterministicFabricModelParallelStrategy, tensor_parallel_size=2 (Fabric's popen launcher
runs this script again as rank 1). Every rank writes OUT/rank<r>.json: per step the draws of the default stream and
of the tracker's fork, the replicated tensors' digests, and the digest of the gathered model at the start.

python fabric_model_parallel.py OUT
"""

import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning as L  # noqa: E402

from lightning_determinism import DeterministicFabricModelParallelStrategy, get_rng_tracker  # noqa: E402
from lightning_determinism.callbacks.replica_guard import replicated_digests  # noqa: E402
from tests.distributed.scripts.model_parallel_run import SEED, TPNet, digest, gathered  # noqa: E402


def parallelize(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


if __name__ == "__main__":
    out = Path(sys.argv[1])
    strategy = DeterministicFabricModelParallelStrategy(parallelize, seed=SEED, tensor_parallel_size=2)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = TPNet()  # under the base seed on every rank
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    record = {"start": digest(gathered(model)), "steps": {}}
    data = torch.randn(8, 2, 8, generator=torch.Generator().manual_seed(0))
    for step, x in enumerate(data, start=1):
        draws = {"default": torch.rand(3).tolist()}
        with get_rng_tracker().fork():
            draws["fork"] = torch.rand(3).tolist()
        loss = model(x).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        record["steps"][step] = {"draws": draws, "replicated": replicated_digests(model)}
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
