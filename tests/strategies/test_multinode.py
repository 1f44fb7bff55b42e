"""Two torchrun 'nodes' on localhost.

Two processes per node, one launch (scripts/model_parallel_torchrun.py). The agents (``python -m
torch.distributed.run``, what the ``torchrun`` command runs) and the workers they start are forked from the warm
interpreter (tests/helpers/warm.py, ``nested=True``), each worker in a session of its own as torchrun starts them.
First DDP, where global ranks 0 .. 3 get base + 0 .. base + 3; then the 2 x 2 model-parallel layout, tensor parallel
inside a node, data parallel across the nodes, bitwise the same config's straight run forked in one process
(conftest.py's model_parallel_runs, which test_model_parallel_strategy.py checks).
"""

import json
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from tests.helpers import CHILD_TIMEOUT_S, child_env, free_port, warm
from tests.helpers.lightning_models import read_records, reference_draws
from tests.strategies import test_model_parallel_strategy as model_parallel

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).parents[1] / "helpers" / "scripts"
TERM_GRACE_S = 60  # a torchrun agent gives its workers 30 s to end


def _nodes(script: Path, args: list[str], nproc_per_node: int, env: dict[str, str]) -> list[warm.Process]:
    """Two torchrun agents, node ranks 0 and 1, rendezvous on 127.0.0.1."""
    port = free_port()
    return [
        warm.start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--nproc-per-node={nproc_per_node}",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(script),
                *args,
            ],
            env=env,
            merge_stderr=True,
            nested=True,
        )  # fmt: skip
        for node in (0, 1)
    ]


def _finish(procs: list[warm.Process]) -> list[str]:
    """Every process's output once all have exited; the first to fail ends the others, which would wait on it.

    Ended with SIGTERM, on which a torchrun agent ends its workers (they run in sessions of their own, out of reach of a
    signal to the agent's group), then killed if they outlast ``TERM_GRACE_S``.
    """
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    with ThreadPoolExecutor(len(procs)) as pool:
        futures = {pool.submit(proc.communicate): proc for proc in procs}
        pending = set(futures)
        while pending:
            left = max(deadline - time.monotonic(), 0)
            done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
            if not done or any(futures[future].returncode != 0 for future in done):
                break
        for proc in procs:
            proc.terminate()  # a no-op on those that exited
        if wait(pending, timeout=TERM_GRACE_S).not_done:
            for proc in procs:
                proc.kill()
    outputs = [future.result()[0] for future in futures]
    assert all(proc.returncode == 0 for proc in procs), "\n".join(out[-3000:] for out in outputs)
    return outputs


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory, model_parallel_runs):
    """One launch of two torchrun nodes x 2 processes: a DDP fit, then the 2 x 2 config; and the 2 x 2 config's
    straight run forked in one process (conftest.py)."""
    root, ddp = tmp_path_factory.mktemp("two-by-two"), tmp_path_factory.mktemp("ddp")
    config = next(config for config in model_parallel.CONFIGS if config["name"] == "dp2tp2")
    config = json.dumps({key: config[key] for key in ("name", "dp", "tp")})
    env = child_env(OMP_NUM_THREADS="1", PL_GLOBAL_SEED="31")
    _finish(_nodes(SCRIPTS / "model_parallel_torchrun.py", [str(root), config, str(ddp)], 2, env))
    nodes = [json.loads((root / "dp2tp2" / f"rank{r}.json").read_text()) for r in range(4)]
    forked = model_parallel.ranks(model_parallel_runs[0], "dp2tp2")
    return model_parallel_runs[0] / "dp2tp2", nodes, forked, ddp


def test_ddp_on_two_nodes_gives_every_rank_base_plus_its_global_rank(two_by_two):
    records = read_records(two_by_two[3], 4)
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert (record["base_seed"], record["local_seed"]) == (31, 31 + rank)
        assert record["draws"] == reference_draws(31 + rank)
    assert len({record["init_digest"] for record in records}) == 1


def test_each_node_holds_one_tensor_parallel_group(two_by_two):
    for rank, record in enumerate(two_by_two[1]):  # rank r: node r // 2, data_parallel r // 2, tensor_parallel r % 2
        assert record["where"] == {"node": rank // 2, "local_rank": rank % 2, "mesh": [rank // 2, rank % 2]}


def test_tensor_parallel_peers_share_default_draws_and_their_replicated_tensors_stay_equal(two_by_two):
    records = two_by_two[1]
    assert len(records[0]["steps"]) == 8  # 2 epochs of 16 samples, 2 per step on each of the 2 data-parallel ranks
    for step in records[0]["steps"]:
        for peers in ((0, 1), (2, 3)):  # the tensor-parallel groups: one node each
            a, b = (records[r]["steps"][step] for r in peers)
            assert a["draws"]["default"] == b["draws"]["default"]
            assert a["replicated"] == b["replicated"] and a["replicated"]
            assert a["draws"]["fork"] != b["draws"]["fork"]  # each shard its own stream
            assert a["samples"] == b["samples"]


def test_the_data_parallel_ranks_across_the_nodes_draw_their_own_masks_and_samples(two_by_two):
    records = two_by_two[1]
    for replicas in ((0, 2), (1, 3)):  # data_parallel 0 and 1: node 0 and node 1
        for epoch in (range(1, 5), range(5, 9)):  # steps 1-4, 5-8
            a, b = ([records[r]["steps"][str(step)] for step in epoch] for r in replicas)
            assert all(x["draws"]["default"] != y["draws"]["default"] for x, y in zip(a, b, strict=True))
            assert all(x["draws"]["fork"] != y["draws"]["fork"] for x, y in zip(a, b, strict=True))
            seen = [sorted(sample for step in steps for sample in step["samples"]) for steps in (a, b)]
            assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == list(range(16))  # each once


def test_the_gathered_start_is_the_one_process_model(two_by_two):
    reference, nodes, *_ = two_by_two
    one = json.loads((reference / "one_process.json").read_text())["start"]
    assert {record["start"] for record in nodes} == {one}
    assert all(record["dtensor_routed"] for record in nodes)


def test_the_nodes_train_the_bits_of_the_run_forked_in_one_process(two_by_two):
    _, nodes, forked, _ = two_by_two
    for rank, (node, fork) in enumerate(zip(nodes, forked, strict=True)):
        assert node["steps"].keys() == fork["steps"].keys()
        for step, record in fork["steps"].items():  # the first step that differs, if any, says where it went apart
            assert node["steps"][step] == record, f"rank {rank}, step {step}"
        assert node["final"] == fork["final"], f"rank {rank}"
