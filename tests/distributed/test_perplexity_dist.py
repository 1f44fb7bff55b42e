"""DistributedPerplexity across 2 gloo ranks: plain torch.distributed and under Lightning's DDP."""

import json
import math
from functools import partial

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_determinism import DeterministicDDPStrategy, DistributedPerplexity
from tests.helpers import run_distributed
from tests.test_perplexity import make, reference

pytestmark = pytest.mark.distributed

# Uneven on purpose: rank 0 holds 3 sequences, rank 1 holds 5 with some padding.
PREDS, TARGET = make((8, 13), vocab=97, seed=5)
TARGET[6, 9:] = -100
SPLITS = {0: slice(0, 3), 1: slice(3, 8)}


def _sync_under_plain_dist(rank, world_size, out_dir):
    metric = DistributedPerplexity(ignore_index=-100)
    part = SPLITS[rank]
    metric.update(PREDS[part], TARGET[part])
    local_count = metric.count.item()
    value = metric.compute()  # syncs over the default process group, then restores the local states
    with metric.sync_context():
        synced_count = metric.count.item()
    out = {"ppl": value.item(), "count": synced_count, "local_count": local_count}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))


def test_compute_syncs_over_the_default_group(tmp_path):
    run_distributed(_sync_under_plain_dist, tmp_path, tmp_path)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    single = DistributedPerplexity(ignore_index=-100)
    single.update(PREDS, TARGET)
    total = int((TARGET != -100).sum())
    assert records[0]["local_count"] != records[1]["local_count"]
    for record in records:
        assert record["count"] == total
        assert math.isclose(record["ppl"], single.compute().item(), rel_tol=1e-12)
        assert math.isclose(record["ppl"], reference(PREDS, TARGET, -100), rel_tol=1e-6)


def _validate(strategy, out_dir, devices):
    from tests.lightning_models import PerplexityModule, quiet_trainer

    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = quiet_trainer(strategy, devices)
    trainer.validate(PerplexityModule(str(out_dir), partial(DistributedPerplexity, ignore_index=-100)))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(devices)]


def test_two_ranks_on_seven_samples_equal_one_rank(tmp_path):
    single = _validate("auto", tmp_path / "single", 1)[0]
    ours = _validate(DeterministicDDPStrategy(seed=0, start_method="fork"), tmp_path / "ours", 2)
    lightning_default = _validate(DDPStrategy(start_method="fork"), tmp_path / "plain", 2)

    assert sum(single["seen"]) == 7
    assert [sum(r["seen"]) for r in ours] == [4, 3]  # every sample once, uneven ranks
    assert [sum(r["seen"]) for r in lightning_default] == [4, 4]  # sample 0 repeated as padding
    for record in ours:
        assert math.isclose(record["ppl"], single["ppl"], rel_tol=1e-12)
        assert record["dtypes"] == ["torch.float64", "torch.int64"]
    # The difference Lightning's default makes: a repeated sample changes the distributed perplexity.
    assert not math.isclose(lightning_default[0]["ppl"], single["ppl"], rel_tol=1e-6)
