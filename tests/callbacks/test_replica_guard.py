"""ReplicaGuard's schedule on 2 gloo ranks (one tensor-parallel group): a replica nudged on one rank is caught after
the first step, before a checkpoint is written and at the end of fit, even in a run far shorter than its period."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_determinism import ReplicaGuard
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed


def _run(rank, world_size, out_dir, nudge_at, stop_at):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    module = nn.Linear(4, 4)  # a plain module: every parameter replicated along tensor_parallel
    trainer = SimpleNamespace(strategy=SimpleNamespace(_device_mesh=mesh), global_step=0,
                              fit_loop=SimpleNamespace(_should_accumulate=lambda: False))  # fmt: skip
    guard = ReplicaGuard()  # the default: every 100 steps
    where = None
    try:
        for step in range(1, 25):  # a 24-step run
            if step == nudge_at and rank == 1:
                with torch.no_grad():
                    module.weight[0, 0] += 1e-3
            trainer.global_step = step
            guard.on_train_batch_end(trainer, module, None, None, step - 1)
            if step == stop_at:
                where = "save"
                guard.on_save_checkpoint(trainer, module, {})
            where = None
        where = "end"
        guard.on_train_end(trainer, module)
        where = None
    except RuntimeError as err:
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"step": trainer.global_step, "where": where,
                                                              "error": str(err)}))  # fmt: skip
        return
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"checks": guard.checks}))


@pytest.mark.parametrize(
    ("nudge_at", "save_at", "caught"),
    [(1, None, (1, None)), (3, 5, (5, "save")), (3, None, (24, "end")), (None, 5, None)],
    ids=["first-step", "at-a-save", "at-the-end", "no-drift"],
)
def test_a_drift_in_a_short_run_is_caught(tmp_path, nudge_at, save_at, caught):
    run_distributed(_run, tmp_path, tmp_path, nudge_at, save_at)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        if caught is None:
            assert record == {"checks": 3}  # step 1, the save at step 5, the end
            continue
        assert (record["step"], record["where"]) == caught
        assert "`weight`, replicated along tensor_parallel, differs between ranks 0 and 1" in record["error"]
