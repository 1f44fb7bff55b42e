"""Two torchrun 'nodes' on localhost, one process each: global ranks 0 and 1 get base + 0 and base + 1."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import CHILD_TIMEOUT_S, free_port
from tests.lightning_models import read_records, reference_draws

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_fit.py"


def test_two_nodes_with_torchrun(tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    port = free_port()
    env = {**os.environ, "PL_GLOBAL_SEED": "31", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(SCRIPT),
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
            outputs.append(out)
    finally:
        for proc in procs:
            proc.kill()
    assert all(proc.returncode == 0 for proc in procs), "\n".join(o[-3000:] for o in outputs)
    records = read_records(tmp_path, 2)
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert (record["base_seed"], record["local_seed"]) == (31, 31 + rank)
        assert record["draws"] == reference_draws(31 + rank)
    assert records[0]["init_digest"] == records[1]["init_digest"]
