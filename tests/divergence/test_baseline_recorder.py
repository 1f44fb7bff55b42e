"""BaselineRecorder's loss: the mean of every micro-batch loss of the step, exact, NaN when one was not finite."""

import json
import math
from fractions import Fraction

import torch
from torch import nn

from lightning_determinism import BaselineRecorder


def _loop(recorder, micro_losses):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    for losses in micro_losses:
        model(torch.ones(1, 2)).sum().backward()
        recorder.before_optimizer_step(model)
        for loss in losses[:-1]:
            recorder.add_loss(torch.tensor(loss, dtype=torch.float32))
        recorder.after_optimizer_step(model, losses[-1])
    recorder.finish()


def test_the_step_loss_is_the_exact_mean_of_its_micro_batch_losses(tmp_path):
    micro = [[0.1, 1e7, 0.3], [2.0**-30, 5.0, -1e7, 1e7]]  # a float running sum would lose the small terms
    path = tmp_path / "b.json"
    _loop(BaselineRecorder(path, steps=2), micro)
    recorded = [step["loss"] for step in json.loads(path.read_text())["steps"]]
    expected = []
    for losses in micro:
        terms = [float(torch.tensor(x, dtype=torch.float32)) for x in losses[:-1]] + [losses[-1]]
        expected.append(float(sum(map(Fraction, terms)) / len(terms)))  # independent: rational arithmetic
    assert recorded == expected


def test_a_non_finite_micro_batch_loss_makes_the_step_loss_nan(tmp_path):
    path = tmp_path / "b.json"
    _loop(BaselineRecorder(path, steps=2), [[1.0, float("inf"), 2.0], [1.0, 2.0]])
    recorded = [step["loss"] for step in json.loads(path.read_text().replace("NaN", '"nan"'))["steps"]]
    assert recorded[0] == "nan" and recorded[1] == 1.5
    assert not math.isnan(recorded[1])


def test_norms_keep_the_bits_of_a_float64_copys_norm():
    # Format 1 recorded float(t.double().norm()); the recorder reads without the copy: the same bits, or files
    # recorded before would no longer compare bitwise with today's runs.
    from lightning_determinism.divergence.baseline_ranks import StepRow

    generator = torch.Generator().manual_seed(5)
    tensors = [
        (torch.randn(n, generator=generator) * 7).to(dtype)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        for n in (1, 31, 4097, 300_001)
    ]
    tensors += [torch.randn(64, 33, generator=generator).T, None]  # not contiguous; a parameter without a gradient
    expected = {str(i): float(t.double().norm()) for i, t in enumerate(tensors) if t is not None}
    assert StepRow().norms("grad_norms", [(str(i), t) for i, t in enumerate(tensors)]) == expected
