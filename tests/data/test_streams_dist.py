"""Streamed training data resumes at the exact sample: a user's generator (replayed, or restored by its state
protocol), Hugging Face streaming datasets and litdata, under the Trainer (2 gloo ranks, 2 workers; 1 rank in
process) and under a Fabric loop; resumes in a row; litdata on another world size.

Every phase runs in one child process per group (stream_run.py, fabric_stream.py): the uninterrupted run writes a
checkpoint after each step a run resumes from (Fabric's: after every step) and each resumed run must consume exactly
the sample ids the uninterrupted run consumed after that step, log the same losses bit for bit and end with the same
parameters and optimizer state."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_determinism.callbacks.rng_checkpoint import CHECKPOINT_KEY
from tests.helpers import CHILD_TIMEOUT_S, child_env, warm

# The multi-process acceptance runs (~35 s) run where the streaming extra is installed: CI's streaming step
# (.ci/run), `pip install -e ".[streaming]"` and `pip install --no-deps litdata` locally. The in-process stream tests
# (tests/data/test_streams.py) run everywhere.
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("litdata") is None or importlib.util.find_spec("datasets") is None,
        reason="the stream acceptance runs need the streaming extra (docs/streaming.md)",
    ),
]

SCRIPTS = Path(__file__).parents[1] / "helpers" / "scripts"
N = 64  # samples per epoch (stream_run.N), batches of 4

# Checkpoints after steps 3 and 5 sit in the middle of an epoch, at a worker other than the first (3 batches: the
# round-robin stands at worker 1) and at the first; 8 ends an epoch on 2 ranks, 16 on 1 rank (Lightning does not reset
# its batch counter for the next epoch of a stream: 21 is resumed from the run resumed at 16).
BASE = [
    {
        "name": "plain-workers",
        "own_samplers": True,  # use_distributed_sampler=False: the loader must resume all the same
        "source": "plain",
        "workers": 2,
        "chain": [3, 5, 11],
        # other grids: [ranks, step, num_workers]; then a resumed one resumed again: [run, ranks, step, num_workers]
        "elastic": [[1, 3, 0], [4, 5], [2, 3, 1]],
        "elastic_again": [["elastic1w0", 1, 6, 0], ["elastic4", 1, 6]],
    },
    {
        "name": "state-persistent",
        "source": "plain-state",
        "workers": 2,
        "persist": True,
        "chain": [3, 8],
        "elastic": [[1, 5]],
    },
    {"name": "plain-1-rank-in-process", "source": "plain", "devices": 1, "workers": 0, "chain": [16, 21]},
]
OPTIONAL = {
    "datasets": [
        {
            "name": "hf-workers",
            "own_samplers": True,
            "source": "hf",
            "workers": 2,
            "chain": [3, 5],
            "elastic": [[1, 3], [4, 5]],
        },  # replay
        {"name": "hf-state", "source": "hf-state", "workers": 2, "chain": [5], "elastic": [[1, 5]], "unshuffled": True},
    ],
    "litdata": [
        {
            "name": "litdata-workers",
            "own_samplers": True,
            "source": "litdata",
            "drop_last": "default",  # StreamingDataset's own: True on 2 or more ranks, False on one
            "workers": 2,
            "chain": [3, 11],
            "elastic": [[1, 3], [4, 3], [4, 5, 1]],
            "elastic_drop_last_true": [[1, 3]],  # drop_last=True given: the same on every world size
            "elastic_again": [["elastic1", 1, 6], ["elastic1", 2, 6], ["elastic4", 4, 4], ["elastic4", 1, 5]],
        },
        # 1 rank (drop_last False by default) resumed on 2 (True), where litdata's planner would drop samples
        {
            "name": "litdata-1-rank",
            "source": "litdata",
            "drop_last": "default",
            "devices": 1,
            "workers": 0,
            "chain": [],
            "elastic": [[2, 2, 2]],
        },
    ],
}
CONFIGS = BASE + [config for configs in OPTIONAL.values() for config in configs]


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def start(script: str, *args: str, env: dict[str, str]) -> warm.Process:
    return warm.start([sys.executable, str(SCRIPTS / script), *args], env=child_env(**env))


def finish(process: warm.Process) -> str:
    out, err = process.communicate(timeout=CHILD_TIMEOUT_S)
    assert process.returncode == 0, out[-3000:] + err[-5000:]
    return out + err


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory):
    """The Trainer's configurations and the Fabric loops, side by side (two child processes, one wait)."""
    root = tmp_path_factory.mktemp("streams")
    configs = BASE + [config for module, extra in OPTIONAL.items() if installed(module) for config in extra]
    trainer = start("stream_run.py", "configs", str(root), json.dumps(configs), env={"LITDATA_DIR": str(root / "ld")})
    sources = ["plain"] + (["litdata"] if installed("litdata") else [])
    # Fabric: no workers (the Trainer's runs have them); its own litdata directory, written by its rank 0.
    env = {"WORKERS": "0", "LITDATA_DIR": str(root / "fabric-ld")}
    fabric = start("fabric_stream.py", str(root / "fabric"), "3", ",".join(sources), env=env)
    # 4 ranks: DDP's own ring sums would depend on its bucket layout, which the resumed loop's new module rebuilds.
    fabric4 = start("fabric_stream.py", str(root / "fabric4"), "3", "plain", env={"WORKERS": "0", "DEVICES": "4"})
    return root, finish(trainer), finish(fabric) + finish(fabric4)


@pytest.fixture(scope="module")
def runs(all_runs):
    return all_runs[0], all_runs[1]


@pytest.fixture(scope="module")
def fabric_runs(all_runs):
    return all_runs[0] / "fabric"


def result(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())


def steps_per_epoch(config: dict) -> int:
    return N // (4 * int(config.get("devices", 2)))


def skip_unless_installed(config: dict) -> None:
    for module, configs in OPTIONAL.items():
        if config in configs and not installed(module):
            pytest.skip(f"needs {module} (pip install -e '.[streaming]')")


def assert_continues(straight: dict, resumed: dict, k: int) -> None:
    assert resumed["global_step"] == straight["global_step"]
    later = {step: record for step, record in straight["steps"].items() if int(step) > k}
    assert resumed["steps"] == later  # the same sample ids on every rank, the same synced loss, step by step
    assert resumed["params"] == straight["params"] and resumed["optimizer"] == straight["optimizer"]


@pytest.mark.parametrize("config", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_resumed_streams_consume_the_remaining_samples_and_end_bitwise_equal(runs, config):
    skip_unless_installed(config)
    root = runs[0] / config["name"]
    straight = result(root / "straight")
    assert straight["global_step"] == 2 * steps_per_epoch(config)
    for n, k in enumerate(config["chain"], start=1):  # each resumes the previous resumed run: resumes in a row
        assert_continues(straight, result(root / "chain" / f"r{n}"), k)


@pytest.mark.parametrize("config", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_every_epoch_reads_each_sample_once_and_epochs_differ(runs, config):
    skip_unless_installed(config)
    straight = result(runs[0] / config["name"] / "straight")
    per_epoch = steps_per_epoch(config)
    orders = []
    for epoch in range(2):
        ids = [
            i
            for step in range(1, per_epoch + 1)
            for rank in straight["steps"][str(epoch * per_epoch + step)]["ids"]
            for i in rank
        ]
        assert sorted(ids) == list(range(N))
        orders.append(ids)
    assert orders[0] != orders[1] or config.get("unshuffled")


def test_the_state_protocol_travels_in_the_checkpoint_and_replay_needs_none(runs):
    def streams(name: str) -> list[dict]:
        saved = torch.load(runs[0] / name / "straight" / "step=3.ckpt", weights_only=True)  # plain values only
        return [rank["data"][0]["stream"] for rank in saved[CHECKPOINT_KEY]["ranks"]]

    for stream in streams("state-persistent"):
        assert stream["workers"] == 2 and sum(stream["items"]) == 3 * 4 and stream["last_worker"] == 0
        assert all(state is not None and set(state) == {"dataset", "rng"} for state in stream["states"])
    for stream in streams("plain-workers"):
        assert sum(stream["items"]) == 12 and stream["states"] == [None, None]
    if installed("datasets"):  # Hugging Face's own state, taken in the worker after each batch
        assert all(state["dataset"]["epoch"] == 0 for stream in streams("hf-state") for state in stream["states"])
        assert all(state is None for stream in streams("hf-workers") for state in stream["states"])


def test_a_fabric_loop_on_four_ranks_resumes_bitwise(all_runs):
    straight = result(all_runs[0] / "fabric4" / "plain" / "straight")
    assert straight["global_step"] == 2 * N // (4 * 4)
    assert_continues(straight, result(all_runs[0] / "fabric4" / "plain" / "chain" / "r1"), 3)


@pytest.mark.parametrize("source", ["plain", "litdata"])
def test_a_fabric_loop_saved_mid_epoch_resumes_at_the_next_sample(fabric_runs, source):
    if source == "litdata" and not installed("litdata"):
        pytest.skip("needs litdata (pip install -e '.[streaming]')")
    straight = result(fabric_runs / source / "straight")
    assert straight["global_step"] == 16
    assert_continues(straight, result(fabric_runs / source / "chain" / "r1"), 3)


# A stream resumed on another grid: (config, run, [(run it continues, up to step), ...]) -- the runs whose steps
# come before it in the interrupted epoch.
ELASTIC = [
    ("plain-workers", "elastic1w0", [("straight", 3)]),  # 2 ranks x 2 workers -> 1 rank, no workers
    ("plain-workers", "elastic4", [("straight", 5)]),  # -> 4 ranks x 2 workers
    ("plain-workers", "elastic2w1", [("straight", 3)]),  # the same ranks, 1 worker each
    ("plain-workers", "elastic4-1at6", [("straight", 5), ("elastic4", 6)]),  # resumed on a third grid
    ("state-persistent", "elastic1", [("straight", 5)]),  # the state protocol's positions, played elsewhere
    # litdata restripes its own state; at the exact sample (before: rounded down to whole global batches, repeated)
    # Hugging Face: each old rank's stream played from a copy split for that rank (split_dataset_by_node)
    ("hf-workers", "elastic1", [("straight", 3)]),
    ("hf-workers", "elastic4", [("straight", 5)]),
    ("hf-state", "elastic1", [("straight", 5)]),  # its state, loaded into the copy of the old rank
    ("litdata-workers", "elastic1", [("straight", 3)]),
    ("litdata-workers", "elastic4", [("straight", 3)]),
    ("litdata-workers", "elastic4w1", [("straight", 5)]),  # past the new grid's per-rank length (litdata refused)
    ("litdata-workers", "elastic4-1at5", [("straight", 3), ("elastic4", 5)]),
    # litdata's default drop_last (True on 2+ ranks, False on 1; it refused the change), and True given on 1 rank
    ("litdata-workers", "elastic1-drop-last-true", [("straight", 3)]),
    ("litdata-workers", "elastic1-2at6", [("straight", 3), ("elastic1", 6)]),  # 2 -> 1 -> 2 ranks
    ("litdata-1-rank", "elastic2w2", [("straight", 2)]),  # 1 -> 2 ranks: all 56 samples left, not 48
]


def _samples(run: dict, steps: list[int]) -> list[tuple[int, int]]:
    """(id, content digest) of every sample the run trained on at ``steps``, rank by rank."""
    records = [run["steps"][str(step)] for step in steps]
    ranks = [zip(ids, crcs, strict=True) for r in records for ids, crcs in zip(r["ids"], r["crc"], strict=True)]
    return [pair for rank in ranks for pair in rank]


@pytest.mark.parametrize(("name", "run", "lineage"), ELASTIC, ids=[f"{c}-{r}" for c, r, _ in ELASTIC])
def test_a_stream_resumed_on_another_grid_trains_each_remaining_sample_once_with_its_own_bits(runs, name, run, lineage):
    for prefix, module in (("litdata", "litdata"), ("hf", "datasets")):
        if name.startswith(prefix) and not installed(module):
            pytest.skip(f"needs {module} (pip install -e '.[streaming]')")
    root = runs[0] / name
    straight = result(root / "straight")
    per_epoch = steps_per_epoch(next(config for config in CONFIGS if config["name"] == name))
    first_epoch = dict(_samples(straight, list(range(1, per_epoch + 1))))  # id -> the bits of its content
    before: list[tuple[int, int]] = []
    start = 0
    for source, upto in lineage:
        before += _samples(result(root / source), list(range(start + 1, upto + 1)))
        start = upto
    resumed = result(root / run)
    steps = sorted(int(step) for step in resumed["steps"])
    assert steps[0] == start + 1 and steps[-1] == resumed["global_step"]
    rest, step = [], start
    while len(before) + len(rest) < N:  # the interrupted epoch, on the new grid
        step += 1
        rest += _samples(resumed, [step])
    assert sorted(i for i, _ in before + rest) == list(range(N))  # none repeated, none skipped
    assert all(first_epoch[i] == crc for i, crc in rest)  # each sample bit for bit (its worker-drawn noise too)
    following = _samples(resumed, [s for s in steps if s > step])
    assert sorted(i for i, _ in following) == list(range(N))  # the next epoch, on the new grid: whole
    said = "litdata restripes the rest of the epoch" if name.startswith("litdata") else "resumes on another grid"
    assert said in " ".join(runs[1].split())


@pytest.mark.parametrize("name", ["plain-workers", "litdata-workers"])
def test_an_epoch_resumed_on_another_grid_resumes_bitwise_on_that_grid(runs, name):
    if name.startswith("litdata") and not installed("litdata"):
        pytest.skip("needs litdata (pip install -e '.[streaming]')")
    root = runs[0] / name
    first = "elastic1w0" if name.startswith("plain") else "elastic1"
    assert_continues(result(root / first), result(root / f"{first}-1at6"), 6)
    if name.startswith("litdata"):  # and on 4 ranks, from the first batch of a worker other than the first
        assert_continues(result(root / "elastic4"), result(root / "elastic4-4at4"), 4)
