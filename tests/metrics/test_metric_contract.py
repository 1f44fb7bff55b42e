"""The torchmetrics contract users rely on, for DistributedPerplexity and DistributedMean, written the way users
use the metrics: pickled, cloned, reset, forward() on logits that require grad, in a MetricCollection, in a fit."""

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torchmetrics import MetricCollection

from lightning_determinism import DeterminismWarning, DistributedMean, DistributedPerplexity, perplexity
from tests.metrics.test_perplexity import make, reference


def _ppl():
    metric = DistributedPerplexity(compile=False)
    preds, target = make((2, 5), vocab=13, seed=1)
    metric.update(preds, target)
    return metric


def test_pickle_round_trip_keeps_states_and_update_from_loss():
    metric = _ppl()
    metric.update_from_loss(3.5, 2)
    copy_ = pickle.loads(pickle.dumps(metric))
    assert torch.equal(copy_.nll_limbs, metric.nll_limbs) and int(copy_.count) == 12
    assert torch.equal(copy_.compute(), metric.compute())
    copy_.update_from_loss(1.0, 1)  # the unpickled copy has its own, working wrapper
    assert int(copy_.count) == 13 and int(metric.count) == 12


@pytest.mark.parametrize("duplicate", [lambda m: m.clone(), copy.deepcopy], ids=["clone", "deepcopy"])
def test_copies_are_independent(duplicate):
    metric = _ppl()
    before = (metric.nll_limbs.clone(), int(metric.count), metric.compute())
    twin = duplicate(metric)
    twin.update_from_loss(10.0, 4)  # must not reach the original (it did through a shared bound wrapper)
    twin.update(*make((1, 3), vocab=13, seed=2))
    assert torch.equal(metric.nll_limbs, before[0]) and int(metric.count) == before[1]
    assert torch.equal(metric.compute(), before[2])
    assert int(twin.count) == before[1] + 4 + 3
    mean = DistributedMean()
    mean.update(torch.tensor([1.0, 2.0]))
    other = duplicate(mean)
    other.update(torch.tensor(100.0))
    assert float(mean.compute()) == 1.5 and int(other.count) == 3


def test_reset_returns_to_the_empty_state():
    metric = _ppl()
    metric.reset()
    assert int(metric.count) == 0 and not metric.nll_limbs.any() and not metric.nonfinite.any()
    assert metric.nll_limbs.dtype == torch.int64
    preds, target = make((1, 4), vocab=13, seed=3)
    metric.update(preds, target)
    assert torch.equal(metric.compute(), perplexity(preds, target, compile=False))


def test_forward_returns_the_batch_value_and_accumulates():
    preds, target = make((4, 6), vocab=13, seed=4)
    by_forward, by_update = DistributedPerplexity(compile=False), DistributedPerplexity(compile=False)
    batch_values = [by_forward(preds[i : i + 2], target[i : i + 2]) for i in (0, 2)]
    for i in (0, 2):
        by_update.update(preds[i : i + 2], target[i : i + 2])
    assert torch.equal(batch_values[1], perplexity(preds[2:], target[2:], compile=False))
    assert torch.equal(by_forward.compute(), by_update.compute())
    assert torch.equal(by_forward.compute(), perplexity(preds, target, compile=False))  # exact: any split


def test_forward_and_functional_accept_logits_that_require_grad():
    preds, target = make((2, 5), vocab=13, seed=5)
    logits = preds.clone().requires_grad_(True)
    metric = DistributedPerplexity()
    value = metric(logits * 1.0, target)  # a non-leaf with grad_fn, as in training_step
    assert not value.requires_grad
    assert math.isclose(float(value), reference(preds, target), rel_tol=1e-6)
    assert torch.equal(perplexity(logits * 1.0, target), value)
    mean = DistributedMean()
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
    assert math.isclose(float(mean(loss)), float(loss.detach().double().mean()), rel_tol=1e-12)


def test_metric_collection_updates_and_computes_both():
    collection = MetricCollection({"ppl": DistributedPerplexity(compile=False), "mean": DistributedMean()})
    preds, target = make((2, 3), vocab=13, seed=6, dtype=torch.float64)
    nll = F.cross_entropy(preds.flatten(0, 1).double(), target.flatten(), reduction="none")
    collection["ppl"].update(preds, target)
    collection["mean"].update(nll)
    out = collection.compute()
    assert math.isclose(math.log(float(out["ppl"])), float(out["mean"]), rel_tol=1e-12)
    collection.reset()
    assert int(collection["ppl"].count) == 0 and int(collection["mean"].count) == 0


def test_compute_on_cpu_is_accepted_and_changes_nothing():
    preds, target = make((3, 4), vocab=13, seed=7)
    plain, on_cpu = DistributedPerplexity(compile=False), DistributedPerplexity(compile=False, compute_on_cpu=True)
    for metric in (plain, on_cpu):
        metric.update(preds, target)
    assert torch.equal(plain.compute(), on_cpu.compute())


def test_state_dict_round_trip_of_the_exact_states():
    metric = _ppl()
    fresh = DistributedPerplexity(compile=False)
    fresh.persistent(True)
    metric.persistent(True)
    fresh.load_state_dict(metric.state_dict())
    with pytest.warns(UserWarning, match="called before the ``update`` method"):  # torchmetrics' own note
        assert torch.equal(fresh.compute(), metric.compute())


def test_update_from_loss_checks_its_own_inputs():
    metric = DistributedPerplexity()
    with pytest.raises(ValueError, match="`loss_sum` is a summed negative log-likelihood and cannot be negative"):
        metric.update_from_loss(-1.0, 3)
    with pytest.raises(ValueError, match=r"`loss_sum`=2.0 covers `num_tokens`=0 tokens"):
        metric.update_from_loss(2.0, 0)
    with pytest.raises(TypeError, match="`loss_sum` must be a real number"):
        metric.update_from_loss("1.0", 3)
    assert int(metric.count) == 0  # nothing was added by the refused calls
    with pytest.warns(DeterminismWarning, match=r"update_from_loss got `loss_sum`=nan: the perplexity is nan"):
        metric.update_from_loss(float("nan"), 5)
    assert int(metric.count) == 5 and math.isnan(float(metric.compute()))
    other = DistributedPerplexity()
    with pytest.warns(DeterminismWarning, match="the perplexity is inf"):
        other.update_from_loss(float("inf"), 2)
    assert math.isinf(float(other.compute()))


def test_mean_weights_nonfinite_values_and_bad_input():
    metric = DistributedMean()
    metric.update(torch.tensor([2.0, 4.0]), weight=torch.tensor([3, 1]))
    metric.update(10.0, weight=0)  # weight 0 counts nothing
    assert float(metric.compute()) == (2.0 * 3 + 4.0) / 4 and int(metric.count) == 4
    with pytest.raises(TypeError, match="`weight` must be a non-negative int or integer tensor"):
        metric.update(torch.ones(2), weight=torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="`weight` must be >= 0, got -1"):
        metric.update(torch.ones(2), weight=torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="does not broadcast"):
        metric.update(torch.ones(2), weight=torch.tensor([1, 1, 1]))
    with pytest.raises(TypeError, match="`value` must be a tensor or a real number"):
        metric.update("3")
    assert int(metric.count) == 4
    metric.update(torch.tensor([float("inf")]))
    assert float(metric.compute()) == math.inf
    metric.update(torch.tensor([-float("inf")]))
    assert math.isnan(float(metric.compute()))
    with pytest.warns(UserWarning, match="called before the ``update`` method"):
        assert math.isnan(float(DistributedMean().compute()))


def test_mean_states_are_dtype_locked():
    metric = DistributedMean()
    metric.update(torch.tensor([1.0 + 2**-40], dtype=torch.float64))
    converted = metric.set_dtype(torch.float16).half()
    assert converted.sum_limbs.dtype == torch.int64 and converted.count.dtype == torch.int64
    assert float(converted.compute()) == 1.0 + 2**-40


def test_forward_in_training_step_of_a_real_fit(tmp_path):
    from tests.helpers.lightning_models import RecordingModule, quiet_trainer

    trainer = quiet_trainer("single_device_deterministic", devices=1, max_epochs=1)
    module = RecordingModule(str(tmp_path), n=12, metrics=True)
    trainer.fit(module)
    assert module.record["train_count"] == 12
    assert math.isfinite(module.record["train_ppl"]) and module.record["train_ppl"] >= 1.0
    logged = trainer.callback_metrics
    assert float(logged["train/ppl"]) == module.record["train_ppl"]  # the metric object, computed at epoch end
    assert float(logged["train/mean"]) == module.record["train_mean"]
    assert float(logged["train/ppl_batch"]) >= 1.0  # forward()'s value of the last batch
