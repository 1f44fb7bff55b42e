"""DeterministicModelParallelStrategy on 2 and 4 forked gloo ranks: tensor parallel (tp=2) and FSDP2 x tensor
parallel (2 x 2). A model with dropout on a sharded activation (under `get_rng_tracker().fork()`) and on a
replicated one, Adam, 2 epochs, a distributed checkpoint every 5 steps (scripts/model_parallel_run.py)."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from lightning_determinism.divergence.run_record import CHECKPOINT_KEY
from lightning_determinism.parallel.mesh import equalize_threads, mesh_topology
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parents[1] / "helpers" / "scripts" / "model_parallel_run.py"
FABRIC = Path(__file__).parents[1] / "helpers" / "scripts" / "fabric_model_parallel.py"
CONFIGS = [
    {"name": "tp2", "dp": 1, "tp": 2, "resume": [5], "twice": True, "preempt": [3], "checkpointed": True},
    # FSDP2 over data_parallel, tensor parallel inside; resumed on data_parallel_size 1 (x tp 2) and 4 (x tp 1)
    {"name": "dp2tp2", "dp": 2, "tp": 2, "resume": [5], "elastic": [[5, 1, 2], [5, 4, 1]], "checkpointed": True},
]


@pytest.fixture
def runs(model_parallel_runs):
    """conftest.py's runs of CONFIGS (test_multinode.py compares its torchrun nodes with dp2tp2's straight run)."""
    return model_parallel_runs


def ranks(root, name, run="straight", count=None):
    count = count or {"tp2": 2, "dp2tp2": 4}[name]
    return [json.loads((root / name / run / f"rank{r}.json").read_text()) for r in range(count)]


def at(records, step):
    return [record["steps"][str(step)] for record in records]


@pytest.mark.parametrize("name", ["tp2", "dp2tp2"])
def test_tensor_parallel_peers_share_default_masks_and_their_replicated_tensors_stay_bitwise_equal(runs, name):
    records = ranks(runs[0], name)
    for step in (1, len(records[0]["steps"]) // 2, len(records[0]["steps"])):
        steps = at(records, step)
        for peers in ([0, 1], [2, 3])[: len(steps) // 2]:  # the tensor-parallel groups: ranks (0, 1) and (2, 3)
            a, b = (steps[r] for r in peers)
            assert a["draws"]["default"] == b["draws"]["default"]
            assert a["replicated"] == b["replicated"] and a["replicated"]  # the head, the norm, the row bias
            assert a["draws"]["fork"] != b["draws"]["fork"]  # each shard its own stream


@pytest.mark.parametrize("name", ["tp2", "dp2tp2"])
def test_activation_checkpointing_with_the_trackers_dropout_trains_the_same_bits(runs, name):
    # the forward under torch.utils.checkpoint (tensor parallel -> AC -> FSDP2): the recomputed forward draws the
    # fork's masks again, so every loss and the trained weights are those of the run without checkpointing
    straight, checkpointed = ranks(runs[0], name), ranks(runs[0], name, "checkpointed")
    for a, b in zip(straight, checkpointed, strict=True):
        assert {s: v["loss"] for s, v in a["steps"].items()} == {s: v["loss"] for s, v in b["steps"].items()}
        assert a["final"] == b["final"]


def test_the_probe_under_tensor_parallel_records_the_one_process_start(runs):
    # DivergenceProbe on the tp=2 run (its RowwiseParallel outputs are AsyncCollectiveTensors): it finishes, the
    # trained weights are those of the run without it, and the parameters before the first recorded step are the
    # one-process model's, digest for digest (whole tensors, not rank 0's shards)
    root = runs[0] / "tp2"
    probe = json.loads((root / "again" / "probe.json").read_text())
    assert [step["step"] for step in probe["steps"]] == [0, 1, 2] and probe["world_size"] == 2
    before = {name.removeprefix("model."): rec["digest"] for name, rec in probe["steps"][0]["before"]["params"].items()}
    assert before == json.loads((root / "one_process.json").read_text())["params"]
    assert ranks(runs[0], "tp2", "again")[0]["final"] == ranks(runs[0], "tp2")[0]["final"]


def test_data_parallel_ranks_draw_their_own_masks(runs):
    steps = at(ranks(runs[0], "dp2tp2"), 3)
    replicas = [steps[0], steps[2]]  # data_parallel coordinates 0 and 1, tensor_parallel 0
    assert replicas[0]["draws"]["default"] != replicas[1]["draws"]["default"]
    assert replicas[0]["draws"]["fork"] != replicas[1]["draws"]["fork"]
    assert replicas[0]["x"] != replicas[1]["x"]  # other samples: the sampler follows the data-parallel mesh


@pytest.mark.parametrize("name", ["tp2", "dp2tp2"])
def test_the_gathered_start_is_the_one_process_model(runs, name):
    one = json.loads((runs[0] / name / "one_process.json").read_text())["start"]
    assert {record["start"] for record in ranks(runs[0], name)} == {one}
    assert all(record["dtensor_routed"] for record in ranks(runs[0], name))  # DTensor random ops drawn whole


def test_the_same_run_twice_gives_the_same_bits(runs):
    straight, again = ranks(runs[0], "tp2"), ranks(runs[0], "tp2", "again")
    assert [r["final"] for r in straight] == [r["final"] for r in again]
    assert straight[0]["steps"] == again[0]["steps"]


@pytest.mark.parametrize(("name", "k"), [("tp2", 5), ("dp2tp2", 5)])
def test_a_mid_epoch_resume_from_a_distributed_checkpoint_is_bitwise(runs, name, k):
    straight, resumed = ranks(runs[0], name), ranks(runs[0], name, f"resumed{k}")
    for a, b in zip(straight, resumed, strict=True):
        assert b["final"] == a["final"]
        assert b["steps"] == {step: record for step, record in a["steps"].items() if int(step) > k}
    checkpoint = runs[0] / name / "straight" / f"step={k}.ckpt"
    assert checkpoint.is_dir()  # Lightning's distributed checkpoint: the RNG states are in its meta.pt
    meta = torch.load(checkpoint / "meta.pt", weights_only=True)
    assert len(meta["lightning_determinism_rng"]["ranks"]) == len(straight)


def _epoch_order(records, steps, dp, tp):
    """The samples the data-parallel ranks trained at ``steps``, in the order a DistributedSampler deals them."""
    replicas = records[::tp]  # tensor-parallel peers train the same samples
    assert len(replicas) == dp
    per_step = [[r["steps"][str(step)]["samples"] for r in replicas] for step in steps]
    return [sample for batches in per_step for column in zip(*batches, strict=True) for sample in column]


@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (4, 1)])
def test_a_resume_on_another_data_parallel_size_trains_the_rest_of_the_epoch_once(runs, dp, tp):
    straight, resumed = ranks(runs[0], "dp2tp2"), ranks(runs[0], "dp2tp2", f"elastic5-{dp}x{tp}", count=dp * tp)
    # Epoch 1 is steps 5-8 on 2 x 2 samples per step; step 5 was trained before the checkpoint.
    before, after = _epoch_order(straight, [5], 2, 2), _epoch_order(straight, [6, 7, 8], 2, 2)
    steps = sorted(int(step) for step in resumed[0]["steps"])
    assert steps[0] == 6 and len(steps) == -(-12 // dp // 2)  # 12 samples left, dealt dp ways, batches of 2
    dealt = _epoch_order(resumed, steps, dp, tp)
    assert dealt == after  # the uninterrupted run's order: every sample once
    assert sorted(before + dealt) == list(range(16))
    for peers in range(0, dp * tp, tp):  # replicas still equal; every rank fine
        assert len({r["steps"][str(steps[-1])]["replicated"].__repr__() for r in resumed[peers : peers + tp]}) == 1


def test_a_preemption_checkpoint_is_a_distributed_one_and_resumes_bitwise(runs):
    checkpoint = runs[0] / "tp2" / "preempted3" / "preempted.ckpt"
    assert checkpoint.is_dir() and (checkpoint / "meta.pt").is_file()
    straight, resumed = ranks(runs[0], "tp2"), ranks(runs[0], "tp2", "preempted3-resumed")
    for a, b in zip(straight, resumed, strict=True):
        assert b["final"] == a["final"]
        assert b["steps"] == {step: record for step, record in a["steps"].items() if int(step) > 3}


def test_the_replica_guard_catches_the_mixins_old_rule(runs):
    output, returncode = runs[1]
    assert returncode != 0
    assert "step 1: `model.down.bias`, replicated along tensor_parallel, differs between ranks 0 and 1" in output


def _threads(rank, world_size):
    torch.set_num_threads(1 + rank)  # as Lightning's popen launcher leaves rank 0 with more than its children
    assert equalize_threads() == 1 and torch.get_num_threads() == 1


@pytest.mark.parametrize(("name", "dp", "tp"), [("tp2", 1, 2), ("dp2tp2", 2, 2)])
def test_the_logged_fingerprints_are_the_whole_models(runs, name, dp, tp):
    root, _ = runs
    straight = root / name / "straight"
    logged = yaml.safe_load((straight / "logs" / "version_0" / "hparams.yaml").read_text())
    assert logged["determinism/fingerprint/final"] == ranks(root, name)[0]["final_fingerprint"]  # one process's
    meta = torch.load(straight / "step=5.ckpt" / "meta.pt", weights_only=True)  # the distributed checkpoint's
    assert logged["determinism/fingerprint/step_5"] == meta[CHECKPOINT_KEY]["fingerprint"]
    assert (logged["determinism/mesh/data_parallel"], logged["determinism/mesh/tensor_parallel"]) == (dp, tp)


def test_every_rank_gets_the_smallest_thread_count(tmp_path):
    run_distributed(_threads, tmp_path)


def test_a_mesh_of_other_dimensions_or_layout_is_refused():
    class Mesh:
        mesh_dim_names = ("data_parallel", "tensor_parallel")
        shape = (2, 2)

        def get_coordinate(self):
            return [0, 1]  # rank 2 would be (1, 0) on Lightning's layout

    with pytest.raises(ValueError, match=r"places this rank at data_parallel=0, tensor_parallel=1, the topology"):
        mesh_topology(Mesh(), rank=2, world_size=4)
    Mesh.mesh_dim_names = ("dp", "tp")
    with pytest.raises(ValueError, match=r"has dimensions \('dp', 'tp'\)"):
        mesh_topology(Mesh(), rank=1, world_size=4)


def test_a_fabric_loop_follows_the_same_rule(runs):
    records = [json.loads((runs[0] / "fabric" / f"rank{r}.json").read_text()) for r in range(2)]
    one = json.loads((runs[0] / "tp2" / "one_process.json").read_text())["start"]
    assert records[0]["start"] == records[1]["start"] == one
    for step in ("1", "8"):
        a, b = (record["steps"][step] for record in records)
        assert a["draws"]["default"] == b["draws"]["default"] and a["draws"]["fork"] != b["draws"]["fork"]
        assert a["replicated"] == b["replicated"]


def test_a_fabric_loop_resumes_bitwise_from_its_distributed_checkpoint(runs):
    for rank in range(2):
        record = json.loads((runs[0] / "fabric" / f"rank{rank}.json").read_text())
        straight = {step: value for step, value in record["steps"].items() if int(step) > 4}
        assert record["resumed"]["steps"] == straight and len(straight) == 4
        assert record["resumed"]["final"] == record["final"]
    assert (runs[0] / "fabric" / "step4").is_dir()  # Fabric's distributed checkpoint directory
