"""Clipping in the invariant mode across processes: the exact norm of DTensor gradients (FSDP2's Shard, tensor
parallel's Replicate and _StridedShard) on 2 and 4 forked gloo ranks against one process's fsum; Trainer fits under
FSDP2 clipped on every step on 1, 2 and 4 ranks (by norm) and 1 and 2 (by value); Fabric's clip_gradients on 1 and 2
ranks. Every run is shared by the tests of this module."""

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_determinism import DeterministicFabricDDPStrategy, DeterministicModelParallelStrategy, fingerprint
from lightning_determinism._compat.features import INVARIANT_FSDP2
from lightning_determinism.invariance.clipping import exact_grad_norm
from tests.helpers import requires_feature, run_distributed

pytestmark = [pytest.mark.distributed, requires_feature(INVARIANT_FSDP2)]  # the fits are invariant FSDP2 ones

B, M_SIZE = 8, 2  # 4 micro-batches per step: K = 4, 2, 1 on 1, 2, 4 ranks
CLIP = 0.02  # below every step's norm here (checked): clipping is active on every step


def _full_tensors() -> list[torch.Tensor]:
    """Whole gradients with spread magnitudes: float sums of their squares depend on the order."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 6), (6, 10), (12, 4), (5,), (8, 8)]
    return [torch.randn(*s, generator=gen) * torch.exp(2 * torch.randn(*s, generator=gen)) for s in shapes]


def _reference(tensors) -> float:
    return math.sqrt(math.fsum(float(x) ** 2 for t in tensors for x in t.double().flatten()))


def _dtensor_norms(rank, world_size, out):
    """Each rank's exact and stock norms of the same whole tensors, distributed in several layouts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    full = _full_tensors()
    result = {}
    if world_size == 2:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
        sharded = [distribute_tensor(t, mesh, [Shard(0)]) for t in full]  # FSDP2's layout (uneven: 5 rows)
        result["fsdp"] = float(exact_grad_norm(sharded))
        result["stock"] = float(torch.nn.utils.get_total_norm(sharded).full_tensor())
        result["replicated"] = float(exact_grad_norm([distribute_tensor(t, mesh, [Replicate()]) for t in full]))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        layouts = [[Shard(0), Replicate()], [Replicate(), Shard(1)], [_StridedShard(0, split_factor=2), Shard(0)],
                   [Replicate(), Replicate()], [Shard(0), Shard(0)]]  # fmt: skip
        mixed = [distribute_tensor(t, mesh, p) for t, p in zip(full, layouts, strict=True)]
        result["tensor_parallel"] = float(exact_grad_norm(mixed))
        dp = mesh["data_parallel"]  # a sub-mesh: summed over its own ranks, not the world's
        result["sub_mesh"] = float(exact_grad_norm([distribute_tensor(t, dp, [Shard(0)]) for t in full]))
    Path(out, f"norms-{world_size}-{rank}.json").write_text(json.dumps(result))


class Net(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out, self.net, self.steps, self.norms = out, None, {}, []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        from torch.distributed.fsdp import fully_shard

        self.net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 1))
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer) -> None:  # before Lightning clips
        self.norms.append(float(exact_grad_norm([p.grad for p in self.parameters() if p.grad is not None])))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if not self.trainer.fit_loop._should_accumulate():
            self.steps[int(self.trainer.global_step)] = fingerprint(self.net)

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            Path(self.out, "run.json").write_text(json.dumps({"steps": self.steps, "norms": self.norms}))

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16, 6, generator=gen), torch.randn(16, 1, generator=gen))
        return DataLoader(data, batch_size=M_SIZE, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(out: Path, ranks: int, **clipping) -> dict:
    out.mkdir(parents=True)
    strategy = DeterministicModelParallelStrategy(
        seed=4, data_parallel_size=ranks, tensor_parallel_size=1, global_batch_size=B, micro_batch_size=M_SIZE,
        start_method="fork",
    )  # fmt: skip
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=ranks, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False, **clipping,
    )  # fmt: skip
    trainer.fit(Net(str(out)))
    return json.loads((out / "run.json").read_text())


def _fabric_loop(fabric):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 6, generator=gen), torch.randn(16, 1, generator=gen))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=M_SIZE, shuffle=True))
    K = fabric.strategy.micro_batches_per_rank
    norms, prints = [], []
    for _ in range(2):
        for i, (x, y) in enumerate(loader):
            is_accumulating = (i + 1) % K != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                fabric.backward(nn.functional.mse_loss(model(x), y) / K)
            if not is_accumulating:
                norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
                optimizer.step()
                optimizer.zero_grad()
                prints.append(fingerprint(model))
    return {"norms": norms, "prints": prints}


def _fabric(ranks: int) -> dict:
    strategy = DeterministicFabricDDPStrategy(seed=5, start_method="fork", global_batch_size=B, micro_batch_size=M_SIZE)
    return Fabric(strategy=strategy, accelerator="cpu", devices=ranks).launch(_fabric_loop)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("clipping")
    for world_size in (2, 4):
        run_distributed(_dtensor_norms, root, str(root), world_size=world_size)
    norms = {(w, r): json.loads((root / f"norms-{w}-{r}.json").read_text()) for w in (2, 4) for r in range(w)}
    fits = {ranks: _fit(root / f"norm-{ranks}", ranks, gradient_clip_val=CLIP) for ranks in (1, 2, 4)}
    value = {ranks: _fit(root / f"value-{ranks}", ranks, gradient_clip_val=0.01, gradient_clip_algorithm="value")
             for ranks in (1, 2)}  # fmt: skip
    plain = _fit(root / "unclipped-2", 2)
    with pytest.MonkeyPatch.context() as patch:  # the fix disabled: torch's clip_grad_norm_ on the shards
        patch.setattr("lightning_determinism.strategies.trainer.clip_exactly", lambda plugin: lambda: None)
        stock = _fit(root / "stock-2", 2, gradient_clip_val=CLIP)
    fabric = {ranks: _fabric(ranks) for ranks in (1, 2)}
    return {"norms": norms, "fits": fits, "value": value, "plain": plain, "stock": stock, "fabric": fabric}


def test_the_exact_norm_of_dtensor_gradients_is_one_process_fsum_on_every_rank_and_layout(runs):
    reference = _reference(_full_tensors())
    for (world_size, _), result in runs["norms"].items():
        keys = ("fsdp", "replicated") if world_size == 2 else ("tensor_parallel", "sub_mesh")
        for key in keys:
            assert result[key] == reference, (world_size, key)


def test_stock_clip_grad_norm_of_sharded_gradients_differs_from_one_process(runs):
    # The bug: torch's total norm sums per-shard sums of squares, in an order the sharding decides.
    one = float(torch.nn.utils.get_total_norm(_full_tensors()))
    assert runs["norms"][(2, 0)]["stock"] != one
    assert runs["norms"][(2, 0)]["stock"] == runs["norms"][(2, 1)]["stock"]  # the ranks agree, with each other only


def test_fsdp2_fits_clipped_on_every_step_give_the_same_bits_on_one_two_and_four_ranks(runs):
    fits = runs["fits"]
    assert len(fits[1]["steps"]) == 4 and len(fits[1]["norms"]) == 4
    assert all(norm > CLIP for norm in fits[1]["norms"])  # clipping active on every step
    assert fits[1] == fits[2] == fits[4]  # the fingerprints after every step, and the norms before clipping
    assert fits[2]["steps"] != runs["plain"]["steps"]  # clipping changed the run


def test_without_the_exact_norm_two_fsdp2_ranks_clip_to_other_bits(runs):
    assert runs["stock"]["norms"] == runs["fits"][1]["norms"]  # the same gradients before the first clipping
    assert runs["stock"]["steps"] != runs["fits"][1]["steps"]  # torch's norm of the shards: other clipped bits


def test_fsdp2_fits_clipped_by_value_give_the_same_bits_on_one_and_two_ranks(runs):
    value = runs["value"]
    assert value[1] == value[2]
    assert value[2]["steps"] != runs["plain"]["steps"] and value[2]["steps"] != runs["fits"][2]["steps"]


def test_fabric_clip_gradients_gives_the_same_bits_on_one_and_two_ranks(runs):
    one, two = runs["fabric"][1], runs["fabric"][2]
    assert len(one["norms"]) == 4 and all(norm > CLIP for norm in one["norms"])
    assert one == two
