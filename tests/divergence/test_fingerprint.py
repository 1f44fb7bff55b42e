import pytest
import torch
from torch import nn

from lightning_determinism import fingerprint
from lightning_determinism.divergence.fingerprint import tensor_fingerprints
from tests.helpers import requires_cuda


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_equal_contents_give_equal_fingerprints():
    a, b = _model(), _model()
    assert a is not b
    assert fingerprint(a) == fingerprint(b) == fingerprint(a.state_dict())
    assert fingerprint({"x": torch.ones(3), "y": [1, "z"]}) == fingerprint({"y": [1, "z"], "x": torch.ones(3)})


def test_one_flipped_bit_anywhere_changes_it():
    reference = fingerprint(_model())
    for name in _model().state_dict():
        model = _model()
        tensor = model.state_dict()[name]
        flat = tensor.view(-1)
        raw = flat[:1].view(torch.uint8) if tensor.is_floating_point() else flat[:1].view(torch.uint8)
        raw[0] ^= 1  # the lowest bit of the first byte
        assert fingerprint(model) != reference, name


def test_dtype_shape_and_name_are_part_of_it():
    x = torch.zeros(4)
    assert fingerprint({"a": x}) != fingerprint({"a": x.double()})
    assert fingerprint({"a": x}) != fingerprint({"a": x.view(2, 2)})
    assert fingerprint({"a": x}) != fingerprint({"b": x})
    assert fingerprint({"a": torch.zeros(())}) != fingerprint({"a": torch.zeros((0,))})


def test_optimizer_state_is_fingerprinted():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    before = fingerprint(optimizer)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    assert fingerprint(optimizer) != before


def test_per_tensor_fingerprints_point_at_the_difference():
    a, b = _model(), _model()
    with torch.no_grad():
        b[2].bias[0] += 1
    fa, fb = tensor_fingerprints(a), tensor_fingerprints(b)
    assert [name for name in fa if fa[name] != fb[name]] == ["2.bias"]


def test_unhashable_values_are_refused():
    with pytest.raises(TypeError, match=r"cannot hash a object at 'a'"):
        fingerprint({"a": object()})


@requires_cuda
def test_cuda_tensors_hash_like_their_cpu_copy():
    x = torch.randn(5)
    assert fingerprint(x) == fingerprint(x.cuda())
