"""A Fabric loop under DeterministicFabricModelParallelStrategy, tensor_parallel_size=2 (Fabric's popen launcher
runs this script again as rank 1). Every rank writes OUT/rank<r>.json: per step the draws of the default stream and
of the tracker's fork, the replicated tensors' digests, and the digest of the gathered model at the start. At step 4
the loop saves a distributed checkpoint (model, optimizer, FabricRNGState); after step 8 a new model and optimizer,
with every RNG stream perturbed, load it and run steps 5-8 again ("resumed"), to compare with the straight ones.

python fabric_model_parallel.py OUT
"""

import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning as L  # noqa: E402

from lightning_determinism import (  # noqa: E402
    DeterministicFabricModelParallelStrategy,
    FabricRNGState,
    fingerprint,
    get_rng_tracker,
)
from lightning_determinism.callbacks.replica_guard import replicated_digests  # noqa: E402
from tests.helpers.scripts.model_parallel_run import SEED, TPNet, digest, gathered  # noqa: E402


def parallelize(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


if __name__ == "__main__":
    out = Path(sys.argv[1])
    strategy = DeterministicFabricModelParallelStrategy(parallelize, seed=SEED, tensor_parallel_size=2)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()

    def steps(model, optimizer, first, record):
        for step, x in enumerate(data[first - 1 :], start=first):
            draws = {"default": torch.rand(3).tolist()}
            with get_rng_tracker().fork():
                draws["fork"] = torch.rand(3).tolist()
            loss = model(x).square().mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            record["steps"][step] = {"draws": draws, "replicated": replicated_digests(model)}
            if step == 4 and "resumed" not in record:
                fabric.save(out / "step4", {"model": model, "optimizer": optimizer, "rng": FabricRNGState()})

    model = TPNet()  # under the base seed on every rank
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    record = {"start": digest(gathered(model)), "steps": {}}
    data = torch.randn(8, 2, 8, generator=torch.Generator().manual_seed(0))
    steps(model, optimizer, 1, record)
    record["final"] = fingerprint(model)
    torch.manual_seed(99)  # the resumed loop's streams must come from the checkpoint
    with get_rng_tracker().fork():
        torch.manual_seed(98)
    again = fabric.setup(TPNet())
    again_optimizer = fabric.setup_optimizers(torch.optim.Adam(again.parameters(), lr=1e-2))
    fabric.load(out / "step4", {"model": again, "optimizer": again_optimizer, "rng": FabricRNGState()})
    resumed = {"resumed": True, "steps": {}}
    steps(again, again_optimizer, 5, resumed)
    record["resumed"] = {"steps": resumed["steps"], "final": fingerprint(again)}
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
