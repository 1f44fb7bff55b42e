"""`diagnose` across world sizes: plain DDP on 1 and 2 processes differs in the reduction; world-size-invariant runs
on 1 and 2 processes line up micro-batch by micro-batch (the same, or a fault named where it is)."""

import json

import pytest
import torch

from lightning_determinism import DeterministicDDPStrategy, DivergenceProbe, bisect_checkpoints, diagnose
from lightning_determinism.checkpoints.distributed import load_distributed_checkpoint
from tests.divergence.test_diagnose import _distributed_checkpoint
from tests.helpers import run_distributed
from tests.helpers.fault_models import FaultNet
from tests.helpers.lightning_models import quiet_trainer

pytestmark = pytest.mark.distributed

INVARIANT = {"global_batch_size": 16, "micro_batch_size": 8}


def _fit(path, devices, invariant=False, accumulate=1, **model):
    strategy = DeterministicDDPStrategy(seed=3, start_method="fork", **(INVARIANT if invariant else {}))
    trainer = quiet_trainer(
        strategy, devices, max_steps=3, accumulate_grad_batches=accumulate, callbacks=[DivergenceProbe(path, 3)]
    )
    trainer.fit(FaultNet(width=32, batch_size=8, **model))
    return path


def test_plain_ddp_on_one_and_two_processes_differs_in_the_reduction(tmp_path):
    # The same 16 samples per step (Lightning's DistributedSampler: one permutation, rank r takes every W-th index),
    # no dropout: what differs is how the step is split and summed.
    one = _fit(tmp_path / "one.json", 1, accumulate=2, p=0.0)
    two = _fit(tmp_path / "two.json", 2, p=0.0)
    found = diagnose(one, two)
    assert found["alignment"] == "step"
    assert {k: found[k] for k in ("verdict", "step", "micro_batch", "phase", "cause")} == {
        "verdict": "diverged", "step": 0, "micro_batch": None, "phase": "reduction", "cause": "reduction"
    }  # fmt: skip
    assert found["evidence"]["parameter"].startswith("net.") and "split the step differently" in found["explanation"]


def test_invariant_runs_on_one_and_two_processes_line_up_by_micro_batch(tmp_path):
    one = _fit(tmp_path / "one.json", 1, invariant=True)
    two = _fit(tmp_path / "two.json", 2, invariant=True)
    same = diagnose(one, two)
    assert same["verdict"] == "same" and same["alignment"] == "micro-batch"
    assert same["compared"] > 150  # every module call of every micro-batch, not only the steps
    # A fault on 2 processes is found in the micro-batch (1, rank 1's) and module where it is.
    faulty = _fit(tmp_path / "faulty.json", 2, invariant=True, fault="extra_draw", fault_step=1)
    found = diagnose(one, faulty)
    assert {k: found[k] for k in ("step", "micro_batch", "module", "phase", "cause")} == {
        "step": 1, "micro_batch": 0, "module": None, "phase": "forward", "cause": "randomness"
    }  # fmt: skip
    dropout = _fit(tmp_path / "dropout.json", 2, invariant=True, p=0.3)
    found = diagnose(one, dropout)
    assert (found["step"], found["micro_batch"], found["module"], found["cause"]) == (0, 0, "net.3", "randomness")


WEIGHT = torch.arange(6.0).reshape(2, 3)


def _save_sharded(rank, world_size, path, meta):
    # As FSDP2 x tensor parallel leaves it: each rank writes its own chunks of the weights, rank 0 the meta.pt.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sharded = {"state_dict": {"net.weight": distribute_tensor(WEIGHT, mesh, [Shard(1)]),
                              "net.bias": distribute_tensor(torch.zeros(3), mesh, [Replicate()])},
               "optimizer_0": {"state": {"net.weight": {"step": torch.tensor(2.0),
                                                        "exp_avg": distribute_tensor(WEIGHT / 2, mesh, [Shard(0)])}},
                               "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999),
                                                 "params": ["net.weight", "net.bias"]}]}}  # fmt: skip
    dcp.save(sharded, checkpoint_id=path)
    if rank == 0:
        (path / "meta.pt").write_bytes(meta.read_bytes())  # the one-process run's: the same RNG states


def test_a_checkpoint_sharded_over_two_ranks_is_read_whole_and_equals_the_one_process_one(tmp_path):
    for run in ("one", "two"):
        (tmp_path / run).mkdir()
    _distributed_checkpoint(tmp_path / "one" / "step=2.ckpt", 2, WEIGHT)
    meta = tmp_path / "one" / "step=2.ckpt" / "meta.pt"
    run_distributed(_save_sharded, tmp_path, tmp_path / "two" / "step=2.ckpt", meta)
    assert len(list((tmp_path / "two" / "step=2.ckpt").glob("*.distcp"))) == 2
    whole = load_distributed_checkpoint(tmp_path / "two" / "step=2.ckpt")
    assert torch.equal(whole["state_dict"]["net.weight"], WEIGHT)
    assert torch.equal(whole["optimizer_states"][0]["state"]["net.weight"]["exp_avg"], WEIGHT / 2)
    found = bisect_checkpoints(tmp_path / "one", tmp_path / "two")
    assert (found.last_equal, found.first_different, found.differences) == (2, None, [])


class _ShardedFaultNet(FaultNet):
    def configure_model(self):
        from torch.distributed._composable.fsdp import fully_shard

        super().configure_model()
        if self.device_mesh["data_parallel"].size() > 1:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def test_ddp_against_fsdp2_is_a_reduction_not_another_initialisation(tmp_path):
    # FSDP2's parameters, gradients and Adam-free SGD state are DTensor shards: the probe records the whole tensors'
    # digests and norms (as one process holding them would), so the recorded steps start from the same parameters
    # and the first difference is the reduction, not "another initialisation".
    from lightning_determinism import DeterministicModelParallelStrategy

    _fit(tmp_path / "ddp.json", 2, p=0.0)
    strategy = DeterministicModelParallelStrategy(seed=3, data_parallel_size=2, tensor_parallel_size=1,
                                                  start_method="fork")  # fmt: skip
    trainer = quiet_trainer(strategy, 2, max_steps=3, callbacks=[DivergenceProbe(tmp_path / "fsdp.json", 3)])
    trainer.fit(_ShardedFaultNet(width=32, batch_size=8, p=0.0))

    first = [json.loads((tmp_path / f"{n}.json").read_text())["steps"][0]["before"]["params"] for n in ("ddp", "fsdp")]
    assert first[0].keys() == first[1].keys() and first[0]
    for name in first[0]:
        assert first[0][name]["digest"] == first[1][name]["digest"], name  # bitwise the same start
        assert first[0][name]["norm"] == first[1][name]["norm"], name
    found = diagnose(tmp_path / "ddp.json", tmp_path / "fsdp.json")
    assert found["phase"] != "optimizer" and found["cause"] != "initialisation", found
