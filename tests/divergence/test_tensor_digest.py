"""lightning_determinism.divergence.tensor_digest on one process: exact against a python reference, every bit."""

import pytest
import torch

from lightning_determinism.divergence import tensor_digest
from lightning_determinism.divergence.tensor_digest import (
    Positions,
    combine,
    digest_of,
    digests,
    hex_digest,
    partial_sums,
    reference_digest,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                   torch.uint8, torch.bool, torch.complex64])  # fmt: skip
def test_the_vectorised_digest_is_the_python_reference(dtype):
    values = torch.randn(5, 7, generator=torch.Generator().manual_seed(1)) * 100
    tensor = values.to(dtype) if dtype is not torch.complex64 else torch.complex(values, -values)
    assert digest_of(tensor) == reference_digest(tensor)


def test_one_flipped_bit_anywhere_changes_the_digest():
    tensor = torch.randn(64, generator=torch.Generator().manual_seed(2))
    seen = {digest_of(tensor)}
    for element in range(0, 64, 7):
        for bit in (0, 22, 31):
            flipped = tensor.clone()
            flipped.view(torch.int32)[element] ^= 1 << bit
            seen.add(digest_of(flipped))
    assert len(seen) == 1 + len(range(0, 64, 7)) * 3


def test_a_permutation_changes_it_and_pieces_add_up(monkeypatch):
    tensor = torch.randn(10, generator=torch.Generator().manual_seed(3))
    assert digest_of(tensor) != digest_of(tensor.flip(0))
    index = torch.arange(10)
    pieces = [partial_sums(tensor[index[i::3]], Positions([index[i::3]], (10,))) for i in range(3)]  # any split
    assert hex_digest(combine(pieces[::-1])) == digest_of(tensor)
    monkeypatch.setattr(tensor_digest, "CHUNK", 3)  # chunk boundaries inside the tensor
    assert digest_of(tensor) == reference_digest(tensor)


def test_many_tensors_in_one_call_are_each_their_own_digest(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    tensors = [torch.randn(n, generator=gen) for n in (0, 1, 7, 40)] + [torch.arange(5), torch.ones(3).bool()]
    monkeypatch.setattr(tensor_digest, "CHUNK", 16)  # the 40-element one goes the chunked way, the others together
    assert digests(tensors) == [reference_digest(t) for t in tensors]


def test_the_c_kernel_gives_the_torch_paths_lanes_bit_for_bit(monkeypatch):
    # Every width it widens (uint8/bool zero-extended, int16/int32 sign-extended, 64-bit words, complex128's two),
    # whole tensors of every size class and views with an offset: the kernel's lanes against the torch passes'.
    from lightning_determinism.divergence import _digest_native, tensor_digest

    if not _digest_native.KERNEL.available():
        pytest.skip(f"no C kernel here: {_digest_native.KERNEL.failed}")
    generator = torch.Generator().manual_seed(9)
    tensors = [
        torch.randn(n, generator=generator).to(dtype)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex128)
        for n in (1, 5, 1000, 2 * tensor_digest.CHUNK + 3)
    ]
    tensors += [torch.randint(-128, 127, (777,), generator=generator, dtype=torch.int8),
                torch.randint(0, 255, (777,), generator=generator, dtype=torch.uint8),
                torch.randn(300, generator=generator) > 0,
                torch.randn(40, 50, generator=generator)[3:, 7:]]  # fmt: skip

    def runs(t):  # a 1-D tensor in two runs of its elements (an FSDP2 chunk's layout): each at its global start
        flat, cut = t.reshape(-1), t.numel() // 3
        pieces = [(flat[:cut], torch.arange(cut)), (flat[cut:], torch.arange(cut, flat.numel()))]
        return [tensor_digest.partial_sums(p, Positions([at], [flat.numel()])) for p, at in pieces if p.numel()]

    def lanes():
        return ([tensor_digest.partial_sums(t) for t in tensors], tensor_digest._small_whole_lanes(tensors[:5]),
                [runs(t) for t in tensors])  # fmt: skip

    with_kernel = lanes()
    assert Positions([torch.arange(3, 9)], [9]).start == 3 and Positions([torch.tensor([0, 2])], [3]).start is None
    monkeypatch.setattr(tensor_digest, "whole_lanes", lambda words, start=0: None)  # the torch path
    without = lanes()
    assert with_kernel == without
    assert with_kernel[0][0] != with_kernel[0][1]  # not a constant
    assert [tensor_digest.combine(r) for r in with_kernel[2]] == with_kernel[0]  # the runs add up to the whole


class _Wrapper(torch.Tensor):
    """A wrapper subclass with no storage of its own (as AsyncCollectiveTensor is): its values live in ``elem``."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # results wrapped again, views too
        unwrap = lambda t: t.elem if isinstance(t, _Wrapper) else t  # noqa: E731
        wrap = lambda t: _Wrapper(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        tree_map = torch.utils._pytree.tree_map
        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


def _kinds():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 10, generator=gen)
    return {
        "contiguous": x,
        "transposed": x.T,
        "strided": x[:, ::3],
        "expanded": torch.randn(1, 10, generator=gen).expand(4, 10),
        "offset view": x.view(-1)[7:29],
        "bf16": x.bfloat16(),
        "fp16 view": x.half()[1:, 2:],
        "int64": torch.arange(-5, 12),
        "int8": torch.arange(-100, 100, 7, dtype=torch.int8),
        "bool": x > 0,
        "empty": torch.empty(0, 3),
        "0-dim": torch.tensor(2.5),
        "requires_grad": x.clone().requires_grad_(),
        "complex128": torch.randn(5, dtype=torch.complex128, generator=gen),
        "sparse": x.relu().to_sparse(),
        "wrapper subclass": _Wrapper(x.clone()),
    }


@pytest.mark.parametrize("name", list(_kinds()))
def test_every_kind_of_tensor_digests_as_its_plain_copy_never_a_crash(name):
    tensor = _kinds()[name]
    values = tensor.elem if isinstance(tensor, _Wrapper) else tensor  # what the wrapper holds
    copy = (values.to_dense() if values.layout != torch.strided else values).detach().clone().contiguous()
    assert type(copy) is torch.Tensor
    assert digest_of(tensor) == reference_digest(copy)


def test_the_c_kernel_is_never_handed_what_it_cannot_read():
    from lightning_determinism.divergence._digest_native import KERNEL, whole_lanes

    if not KERNEL.available():
        pytest.skip("no C compiler: the torch path only")
    words = torch.arange(12, dtype=torch.int32)
    assert whole_lanes(words) is not None
    refused = {
        "a wrapper subclass (no storage)": _Wrapper(words),
        "floating point": words.float(),
        "not contiguous": words[::2],
        "meta": torch.empty(12, dtype=torch.int32, device="meta"),
        "sparse": words.to_sparse(),
    }
    for name, tensor in refused.items():
        assert whole_lanes(tensor) is None, name


def test_a_meta_tensor_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="a meta tensor has no values to digest"):
        digest_of(torch.empty(3, device="meta"))
