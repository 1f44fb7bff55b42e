"""The exact total norm of clipping against an independent reference (math.fsum of the float64 squares), bitwise;
torch's clipping semantics (coefficient, clamping, non-finite norms); the precision plugin's exact clipping in a
single-device invariant fit, and its removal at teardown. Multi-process: test_clipping_dist.py."""

import math

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_determinism import DeterministicSingleDeviceStrategy
from lightning_determinism.invariance import clipping
from lightning_determinism.invariance.clipping import clip_grad_norm_exact_, clip_grad_value_exact_, exact_grad_norm
from lightning_determinism.strategies.invariant_clipping import (
    ExactNormClippingMixin,
    clip_exactly,
    clip_fabric_gradients_norm,
)


def _reference(tensors) -> float:
    return math.sqrt(math.fsum(float(x) ** 2 for t in tensors for x in t.double().flatten().tolist()))


def _spread(seed: int, *sizes: int) -> list[torch.Tensor]:
    """Gradients whose magnitudes span many binades: a float sum of their squares depends on the order."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * torch.exp(4 * torch.randn(n, generator=gen)) for n in sizes]


@pytest.mark.parametrize("seed", range(4))
def test_the_exact_norm_is_the_correctly_rounded_norm_of_fsum_whatever_the_order_and_split(seed):
    tensors = [*_spread(seed, 3000, 517, 1), torch.randn(700).bfloat16(), torch.randn(33).half()]
    expected = _reference(tensors)
    norm = exact_grad_norm(tensors)
    assert norm.dtype == torch.float64 and float(norm) == expected
    whole = torch.cat([t.float().flatten() for t in tensors])
    shuffled = whole[torch.randperm(whole.numel(), generator=torch.Generator().manual_seed(seed))]
    assert float(exact_grad_norm(list(shuffled.split(97)))) == expected  # other order, other split


def test_workspace_chunks_give_the_same_bits(monkeypatch):
    tensors = _spread(7, 9000, 5000)
    expected = float(exact_grad_norm(tensors))
    monkeypatch.setattr(clipping, "_CHUNK", 4096)  # several chunks: two passes over the gradients
    assert float(exact_grad_norm(tensors)) == expected == _reference(tensors)


def test_zeros_nothing_and_non_finite_values():
    assert float(exact_grad_norm([torch.zeros(5)])) == 0.0 and float(exact_grad_norm([])) == 0.0
    assert math.isnan(float(exact_grad_norm([torch.tensor([1.0, math.nan])])))
    assert float(exact_grad_norm([torch.tensor([1.0, -math.inf])])) == math.inf
    assert math.isnan(float(exact_grad_norm([torch.tensor([math.inf]), torch.tensor([math.nan])])))
    tiny, huge = torch.tensor([1e-30, 3e-38]), torch.tensor([1e30, 3e38])  # far from 1: the scale follows the data
    assert float(exact_grad_norm([tiny])) == _reference([tiny]) and float(exact_grad_norm([huge])) == _reference([huge])


def _params(*grads: torch.Tensor) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return params


def test_clipping_scales_by_torchs_coefficient_and_leaves_small_gradients_alone():
    grads = _spread(1, 40, 9)
    params = _params(*grads)
    norm = float(clip_grad_norm_exact_(params, 0.5))
    assert norm == _reference(grads)
    coefficient = 0.5 / (norm + 1e-6)
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g * coefficient)
    untouched = _params(*grads)
    clip_grad_norm_exact_(untouched, norm * 2)  # coefficient clamped to 1
    assert all(torch.equal(p.grad, g) for p, g in zip(untouched, grads, strict=True))


def test_non_finite_norms_scale_as_torch_does_or_raise():
    params = _params(torch.tensor([1.0, math.inf]))
    clip_grad_norm_exact_(params, 1.0)  # coefficient 0: inf * 0 is NaN, 1 * 0 is 0, as torch gives
    reference = _params(torch.tensor([1.0, math.inf]))
    torch.nn.utils.clip_grad_norm_(reference, 1.0)
    assert torch.equal(params[0].grad.isnan(), reference[0].grad.isnan()) and float(params[0].grad[0]) == 0.0
    with pytest.raises(RuntimeError, match=r"non-finite \(nan\)"):
        clip_grad_norm_exact_(_params(torch.tensor([math.nan])), 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize(("max_norm", "error", "match"), [
    ("1", TypeError, "`max_norm` must be a real number, got '1'"),
    (True, TypeError, "`max_norm` must be a real number, got True"),
    (-0.5, ValueError, "`max_norm` must be a non-negative number, got -0.5"),
    (math.nan, ValueError, "`max_norm` must be a non-negative number, got nan"),
])  # fmt: skip
def test_a_bad_max_norm_is_refused(max_norm, error, match):
    with pytest.raises(error, match=match):
        clip_grad_norm_exact_(_params(torch.ones(2)), max_norm)


def test_clipping_by_value_is_torchs_elementwise_clamp():
    grads = _spread(2, 50)
    params, reference = _params(*grads), _params(*grads)
    clip_grad_value_exact_(params, 0.3)
    torch.nn.utils.clip_grad_value_(reference, 0.3)
    assert torch.equal(params[0].grad, reference[0].grad) and float(params[0].grad.abs().max()) == pytest.approx(0.3)


def test_the_precision_plugin_clips_exactly_until_restored_and_fsdp1_keeps_its_own():
    plugin = MixedPrecision("bf16-mixed", "cpu")
    restore = clip_exactly(plugin)
    assert isinstance(plugin, (ExactNormClippingMixin, MixedPrecision)) and type(plugin).__name__ == "MixedPrecision"
    assert clip_exactly(plugin)() is None  # a second call changes nothing
    params = _params(*_spread(3, 20))
    optimizer = torch.optim.SGD(params, lr=0.1)
    expected = [p.grad * (0.1 / (_reference([p.grad]) + 1e-6)) for p in params]
    plugin.clip_gradients(optimizer, 0.1)
    assert torch.equal(params[0].grad, expected[0])
    restore()
    assert type(plugin) is MixedPrecision
    fsdp = FSDPPrecision("32-true")
    clip_exactly(fsdp)
    assert type(fsdp) is FSDPPrecision  # FSDP1's refusal of norm clipping stays


def test_fabric_clipping_takes_the_two_norm_exactly_and_the_inf_norm_from_torch():
    grads = _spread(4, 30)
    optimizer = torch.optim.SGD(_params(*grads), lr=0.1)
    assert float(clip_fabric_gradients_norm(FabricPrecision(), optimizer, 10.0, 2.0, True)) == _reference(grads)
    optimizer = torch.optim.SGD(_params(*grads), lr=0.1)
    norm = clip_fabric_gradients_norm(FabricPrecision(), optimizer, 1e9, math.inf, True)
    assert float(norm) == float(grads[0].abs().max())
    with pytest.raises(ValueError, match=r"`norm_type` must be 2.0 or inf, got 1.0"):
        clip_fabric_gradients_norm(FabricPrecision(), optimizer, 1.0, 1.0, True)


class _Recording(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.classes = nn.Linear(4, 1), []

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_before_optimizer_step(self, optimizer) -> None:
        self.classes.append(type(self.trainer.precision_plugin))

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 4, generator=gen), 10 * torch.randn(8, 1, generator=gen)),
                          batch_size=2)  # fmt: skip

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_single_device_invariant_fit_clips_through_the_exact_plugin_and_teardown_restores_it(tmp_path):
    strategy = DeterministicSingleDeviceStrategy(seed=1, device="cpu", global_batch_size=4, micro_batch_size=2)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, gradient_clip_val=1e-3,
                        default_root_dir=str(tmp_path))  # fmt: skip
    module = _Recording()
    trainer.fit(module)
    assert len(module.classes) == 2 and all(issubclass(cls, ExactNormClippingMixin) for cls in module.classes)
    assert type(trainer.precision_plugin) is Precision  # put back at teardown
