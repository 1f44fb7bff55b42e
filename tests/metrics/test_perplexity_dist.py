"""DistributedPerplexity across 2 gloo ranks: plain torch.distributed and under Lightning's DDP."""

import json
import math
from datetime import timedelta
from functools import partial

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_determinism import DeterministicDDPStrategy, DistributedPerplexity
from tests.helpers import require_compiled_kernel, run_distributed
from tests.helpers.lightning_models import PerplexityModule
from tests.metrics.test_perplexity import make, reference

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


def _forward_with_dist_sync_on_step(rank, world_size, out_dir):
    metric = DistributedPerplexity(ignore_index=-100, dist_sync_on_step=True)
    part = SPLITS[rank]
    batch_value = metric(PREDS[part], TARGET[part])  # synced over both ranks' batches at once
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"batch": batch_value.item(), "local": int(metric.count)}))


def test_dist_sync_on_step_gives_the_global_batch_value(tmp_path):
    run_distributed(_forward_with_dist_sync_on_step, tmp_path, tmp_path)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    single = DistributedPerplexity(ignore_index=-100)
    single.update(PREDS, TARGET)
    assert records[0]["batch"] == records[1]["batch"] == single.compute().item()
    assert records[0]["local"] != records[1]["local"]  # the accumulated state stays local


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
    from tests.helpers.lightning_models import PerplexityModule, quiet_trainer

    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = quiet_trainer(strategy, devices)
    # compile=True: the compiled path (the C kernel for these float32 logits) under a real Trainer, in forked ranks.
    trainer.validate(PerplexityModule(str(out_dir), partial(DistributedPerplexity, ignore_index=-100, compile=True)))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(devices)]


def test_two_ranks_on_seven_samples_equal_one_rank(tmp_path):
    single = _validate("auto", tmp_path / "single", 1)[0]
    ours = _validate(DeterministicDDPStrategy(seed=0, start_method="fork"), tmp_path / "ours", 2)
    lightning_default = _validate(DDPStrategy(start_method="fork"), tmp_path / "plain", 2)

    assert sum(single["seen"]) == 7
    assert [sum(r["seen"]) for r in ours] == [4, 3]  # every sample once, uneven ranks
    assert [sum(r["seen"]) for r in lightning_default] == [4, 4]  # sample 0 repeated as padding
    for record in ours:
        assert record["ppl"] == single["ppl"]  # bitwise: exact sums, batch-invariant NLL
        assert record["dtypes"] == ["torch.float64", "torch.int64"]
    # The difference Lightning's default makes: a repeated sample changes the distributed perplexity.
    assert not math.isclose(lightning_default[0]["ppl"], single["ppl"], rel_tol=1e-6)
    # Lightning warns that validation on several devices repeats samples: true for its sampler, false for ours,
    # and our strategies keep that one false line from the user.
    replicates = "replicates some samples"
    assert any(replicates in w for w in lightning_default[0]["warnings"])
    assert not any(replicates in w for record in ours for w in record["warnings"])
    assert not any("kernel failed" in w for record in [single, *ours] for w in record["warnings"])  # no fallback


def _evaluate_shard(rank, world_size, out_dir, batch_size, compile):
    from tests.metrics.test_perplexity_invariance import N_SAMPLES, evaluate

    # What UnpaddedDistributedSampler gives rank r: r, r + W, r + 2W, ... (every sample once).
    ppl, mean = evaluate(list(range(rank, N_SAMPLES, world_size)), batch_size, compile)
    values = (float(ppl.compute()).hex(), float(mean.compute()).hex())  # compute() syncs over the group
    (out_dir / f"rank{rank}.json").write_text(json.dumps(values))


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_997_samples_give_the_same_bits_on_1_2_3_4_processes(tmp_path, compile):
    from tests.metrics.test_perplexity_invariance import N_SAMPLES, evaluate

    ppl, mean = evaluate(list(range(N_SAMPLES)), 32, compile)  # compiled here, before forking, for every rank
    if compile:
        require_compiled_kernel()
    single = (float(ppl.compute()).hex(), float(mean.compute()).hex())
    for world_size, batch_size in ((2, 7), (3, 1), (4, 32)):
        out = tmp_path / f"w{world_size}"
        out.mkdir()
        run_distributed(_evaluate_shard, tmp_path, out, batch_size, compile, world_size=world_size)
        for rank in range(world_size):
            assert tuple(json.loads((out / f"rank{rank}.json").read_text())) == single, (world_size, rank)


class _StepSyncModule(PerplexityModule):
    """Logs a per-step synced value in validation: a collective on every step."""

    def __init__(self, out_dir, how):
        super().__init__(out_dir, partial(DistributedPerplexity, dist_sync_on_step=how == "metric"), n=9)
        self.how = how

    def validation_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        if self.how == "log":
            self.log("val/step_ppl", self.val_ppl(logits, batch["labels"]), on_step=True, sync_dist=True)
        else:
            self.val_ppl(logits, batch["labels"])


@pytest.mark.parametrize("how", ["log", "metric"])
def test_per_step_collectives_with_uneven_batches_are_refused_not_hung(tmp_path, how):
    from tests.helpers.lightning_models import quiet_trainer

    # 9 samples, batch size 2 (PerplexityModule's loader), 2 ranks: 5 and 4 samples, 3 and 2 batches.
    # A 30 s collective timeout: should the guard fail, the test fails instead of hanging.
    strategy = DeterministicDDPStrategy(seed=0, start_method="fork", timeout=timedelta(seconds=30))
    trainer = quiet_trainer(strategy, 2)
    with pytest.raises(Exception, match=r"syncs across ranks on every evaluation step.*rank 0: 3, rank 1: 2"):
        trainer.validate(_StepSyncModule(str(tmp_path), how))
