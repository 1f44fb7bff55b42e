"""DistributedPerplexity and perplexity() against an independent float64 reference (F.cross_entropy + math.fsum)."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from lightning_determinism import DeterminismWarning, DistributedPerplexity, perplexity

# float32 logits: exp() is correctly rounded to ~6e-8 per term, so each token's NLL is within ~1e-7 (relative) of
# the float64 value; 1e-6 leaves margin. float64 logits meet the reference to rounding (1e-12).
RTOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-6, torch.bfloat16: 1e-6}


def reference(preds: torch.Tensor, target: torch.Tensor, ignore_index=None) -> float:
    logits = preds.double().reshape(-1, preds.shape[-1])
    ids = target.reshape(-1)
    keep = ids != ignore_index if ignore_index is not None else torch.ones_like(ids, dtype=torch.bool)
    nll = F.cross_entropy(logits[keep], ids[keep], reduction="none")
    return math.exp(math.fsum(nll.tolist()) / int(keep.sum()))


def make(shape=(3, 7), vocab=50, dtype=torch.float32, seed=0, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    preds = (torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(vocab, shape, generator=gen)
    return preds, target


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 7), (21,)])
@pytest.mark.parametrize("ignore_index", [None, -100, 3])
def test_matches_float64_reference(dtype, shape, ignore_index):
    preds, target = make(shape, dtype=dtype)
    if ignore_index is not None:
        target.view(-1)[::4] = ignore_index
    expected = reference(preds, target, ignore_index)
    metric = DistributedPerplexity(ignore_index=ignore_index)
    metric.update(preds, target)
    got = metric.compute()
    assert got.dtype == torch.float64
    assert math.isclose(got.item(), expected, rel_tol=RTOL[dtype])
    assert math.isclose(perplexity(preds, target, ignore_index=ignore_index).item(), expected, rel_tol=RTOL[dtype])
    counted = target.numel() if ignore_index is None else int((target != ignore_index).sum())
    assert metric.count.item() == counted


def test_float64_logits_are_exact_to_rounding_on_many_tokens():
    preds, target = make((64, 33), vocab=300, dtype=torch.float64)
    assert math.isclose(perplexity(preds, target).item(), reference(preds, target), rel_tol=1e-12)


def test_peaked_lm_like_logits_keep_their_tiny_terms():
    # A trained LM's rows: a few large logits and tens of thousands of tiny exp() terms. Summed in float32 those
    # tiny terms are dropped one by one (a -1.2e-8 relative bias here, measured); accumulated in float64 they stay.
    gen = torch.Generator().manual_seed(5)
    preds = torch.randn(512, 32_000, generator=gen) * 6.0
    probs = torch.softmax(preds.double(), dim=-1)
    target = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # low NLL, as for a trained model
    nll = F.cross_entropy(preds.double(), target, reduction="none")
    expected = math.fsum(nll.tolist())
    stats = DistributedPerplexity()
    stats.update(preds, target)
    assert abs(stats.nll_sum.item() - expected) / expected <= 1e-9
    shifted = preds - preds.amax(dim=-1, keepdim=True)
    float32_sums = shifted.exp().sum(dim=-1).double().log() - shifted.gather(-1, target[:, None]).squeeze(-1).double()
    assert abs(math.fsum(float32_sums.tolist()) - expected) / expected > 3e-9  # the test can tell the difference


def test_large_logit_gap_stays_finite_where_softmax_log_gives_inf():
    preds = torch.zeros(4, 10)
    preds[:, 0] = 150.0  # the target (class 1) sits 150 nats below the max: softmax underflows to 0
    target = torch.ones(4, dtype=torch.long)
    expected = reference(preds, target)
    assert math.isfinite(math.log(expected))
    ours = perplexity(preds, target)
    assert math.isclose(math.log(ours.item()), math.log(expected), rel_tol=1e-12)
    # exp(150) overflows float64? no: it is 1.4e65, finite; torchmetrics' softmax().log() says inf
    torchmetrics_value = Perplexity()(preds[None], target[None])
    assert torch.isinf(torchmetrics_value)


def test_chunking_does_not_change_a_bit():
    preds, target = make((5, 9), vocab=64)
    values = [DistributedPerplexity(chunk_size=c) for c in (1, 3, 7, None)]
    for metric in values:
        metric.update(preds, target)
    sums = [m.nll_sum for m in values]
    assert all(torch.equal(sums[0], s) for s in sums[1:])


def test_several_updates_equal_one():
    preds, target = make((6, 8), vocab=40)
    whole, parts = DistributedPerplexity(), DistributedPerplexity()
    whole.update(preds, target)
    for i in range(6):
        parts.update(preds[i : i + 1], target[i : i + 1])
    assert parts.count.item() == whole.count.item() == 48
    assert math.isclose(parts.compute().item(), whole.compute().item(), rel_tol=1e-14)


def test_update_from_loss_matches_update():
    preds, target = make((2, 5), vocab=30, dtype=torch.float64)
    loss = F.cross_entropy(preds.reshape(-1, 30), target.reshape(-1), reduction="sum")
    metric = DistributedPerplexity()
    metric.update_from_loss(loss, torch.tensor(10))
    assert metric.count.item() == 10
    assert math.isclose(metric.compute().item(), reference(preds, target), rel_tol=1e-12)


def test_update_from_loss_invalidates_the_cached_result():
    metric = DistributedPerplexity()
    metric.update_from_loss(2.0, 2)
    first = metric.compute().item()
    metric.update_from_loss(4.0, 2)
    assert math.isclose(first, math.exp(1.0), rel_tol=1e-15)
    assert math.isclose(metric.compute().item(), math.exp(1.5), rel_tol=1e-15)


def test_count_is_exact_past_float32_precision():
    metric = DistributedPerplexity()
    for _ in range(3):
        metric.update_from_loss(0.5 * (2**24 + 1), 2**24 + 1)
    assert metric.count.dtype == torch.int64
    assert metric.count.item() == 3 * (2**24 + 1)
    assert math.isclose(metric.compute().item(), math.exp(0.5), rel_tol=1e-15)
    torchmetrics_count = torch.tensor(0.0)  # what a float32 count does with the same additions
    for _ in range(3):
        torchmetrics_count += 2**24 + 1
    assert torchmetrics_count.item() != 3 * (2**24 + 1)


def _accumulated():
    metric = DistributedPerplexity()
    metric.update_from_loss(1.0 + 2**-40, 3)  # not representable in float32, bf16 or float16
    return metric


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.float(),
        lambda m: m.double(),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.to(dtype=torch.float16),
        lambda m: m.type(torch.float16),
        lambda m: m.set_dtype(torch.float16),
        lambda m: m.set_dtype(torch.bfloat16),
        lambda m: m.to("cpu"),
    ],
    ids=[
        "half",
        "bfloat16",
        "float",
        "double",
        "to-bf16",
        "to-fp16",
        "type-fp16",
        "set_dtype-fp16",
        "set_dtype-bf16",
        "to-cpu",
    ],
)
def test_states_are_dtype_locked(convert):
    metric = _accumulated()
    before = metric.nll_sum.clone()
    converted = convert(metric) or metric
    assert converted.nll_sum.dtype == torch.float64 and converted.count.dtype == torch.int64
    assert torch.equal(converted.nll_sum, before)
    converted.reset()
    assert converted.nll_sum.dtype == torch.float64 and converted.count.dtype == torch.int64


def test_bf16_true_trainer_does_not_downgrade(tmp_path):
    import lightning as L

    from tests.helpers.lightning_models import PerplexityModule, TokenDataset

    module = PerplexityModule(str(tmp_path), DistributedPerplexity)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", logger=False, enable_progress_bar=False)
    trainer.validate(module)
    import json

    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["dtypes"] == ["torch.float64", "torch.int64"]
    data = TokenDataset(7)
    with torch.no_grad():
        logits = module.table.detach()[data.ids[:, :-1]]  # the bf16 weights the model used
    assert logits.dtype == torch.bfloat16
    assert math.isclose(record["ppl"], reference(logits, data.ids[:, 1:]), rel_tol=1e-6)


@pytest.mark.parametrize(
    ("preds", "target", "error", "match"),
    [
        (
            torch.randn(2, 3, 5),
            torch.zeros(2, 4, dtype=torch.long),
            ValueError,
            r"preds \(2, 3, 5\) and target \(2, 4\)",
        ),
        (torch.randn(5), torch.zeros(5, dtype=torch.long), ValueError, "`preds` must be"),
        (torch.randn(2, 3, 5), torch.zeros(2, 3), TypeError, "`target` must be an integer tensor.*float32"),
        (torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.bool), TypeError, "`target` must be an integer"),
        (
            torch.zeros(2, 3, 5, dtype=torch.long),
            torch.zeros(2, 3, dtype=torch.long),
            TypeError,
            "`preds` must be a float",
        ),
        (torch.randn(2, 5), torch.tensor([1, 5]), ValueError, r"`target` values must be in \[0, 5\).*got 5"),
        (torch.randn(2, 5), torch.tensor([-1, 0]), ValueError, r"`target` values must be in \[0, 5\).*got -1"),
    ],
)
def test_bad_input_names_the_argument(preds, target, error, match):
    with pytest.raises(error, match=match):
        DistributedPerplexity().update(preds, target)
    with pytest.raises(error, match=match):
        perplexity(preds, target)


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match="`ignore_index` must be an int or None, got 1.5"):
        DistributedPerplexity(ignore_index=1.5)
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int or None, got 0"):
        DistributedPerplexity(chunk_size=0)


def test_bad_update_from_loss_arguments():
    metric = DistributedPerplexity()
    with pytest.raises(TypeError, match="`num_tokens` must be a non-negative int"):
        metric.update_from_loss(1.0, 2.5)
    with pytest.raises(ValueError, match="`num_tokens` must be >= 0, got -1"):
        metric.update_from_loss(1.0, -1)
    with pytest.raises(ValueError, match="`loss_sum` must be a scalar"):
        metric.update_from_loss(torch.ones(3), 3)


def test_non_finite_logits_warn_once_with_the_count():
    preds, target = make((2, 4), vocab=10)
    preds[0, 1, 3] = float("nan")
    preds[1, 2, 0] = float("inf")
    metric = DistributedPerplexity()
    with pytest.warns(DeterminismWarning, match="the NLL of 2 of 8 counted tokens is inf or nan"):
        metric.update(preds, target)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)
        metric.update(preds, target)  # once per metric
    assert not math.isfinite(metric.compute().item())


def test_no_tokens_gives_nan_and_warns_once():
    metric = DistributedPerplexity(ignore_index=-100)
    metric.update(torch.randn(2, 5), torch.tensor([-100, -100]))
    with pytest.warns(DeterminismWarning, match="counted no token"):
        assert math.isnan(metric.compute().item())
    with pytest.warns(DeterminismWarning, match="counted no token"):
        assert math.isnan(perplexity(torch.randn(1, 5), torch.tensor([-100]), ignore_index=-100).item())


def test_overflow_gives_inf_without_error():
    metric = DistributedPerplexity()
    metric.update_from_loss(1e6, 1)
    assert math.isinf(metric.compute().item())


def test_metric_attributes_follow_torchmetrics():
    metric = DistributedPerplexity()
    assert metric.higher_is_better is False
    assert metric.full_state_update is False
    assert set(metric._reductions) == {"nll_limbs", "count", "nonfinite"}
    assert all(metric._reductions[name] is not None for name in metric._reductions)


def test_plot():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    preds, target = make()
    metric = DistributedPerplexity()
    metric.update(preds, target)
    fig, ax = metric.plot()
    assert fig is not None and len(ax.lines) + len(ax.collections) >= 1
    fig2, _ = metric.plot([metric.compute(), metric.compute() * 2])
    assert fig2 is not None


def test_a_small_vocabulary_is_accurate_to_1e_11_against_float64():
    # V=16, logits x 3: float32 exponentials biased the perplexity by ~1.5e-9 relative (the eager path before it
    # took them in float64 below 4096 classes). Reference: float64 cross-entropy summed with math.fsum.
    from lightning_determinism.metrics._nll import token_nll

    gen = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(2**16, 16, generator=gen) * 3, torch.randint(16, (2**16,), generator=gen)
    reference = math.fsum(F.cross_entropy(logits.double(), ids, reduction="none").tolist()) / len(ids)
    mean = math.fsum(token_nll(logits, ids).tolist()) / len(ids)
    assert abs(math.exp(mean) - math.exp(reference)) <= 1e-11 * math.exp(reference)
