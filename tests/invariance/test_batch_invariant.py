"""batch_invariant(): matrix products in fixed row tiles, attention in fixed key blocks, and what turning it off gives
back; invariant_attention against float64 attention; a GRU LM and a causal transformer per sample, in one process."""

import math
import pickle
import re

import pytest
import torch
import torch.nn.functional as F

from lightning_determinism import (
    DeterminismWarning,
    DeterministicSingleDeviceStrategy,
    batch_invariant,
    batch_invariant_enabled,
    invariant_attention,
)
from tests.helpers import requires_cuda
from tests.helpers.eval_models import TinyTransformer, tiny_lm_class

DTYPES = [torch.float32, torch.bfloat16]


def _rows_alone_and_together(op, x, dtype):
    """Each row of ``x`` computed in batches of 1..len(x) rows, against the whole batch: rows that differ."""
    full = op(x)
    differing = set()
    for size in range(1, len(x)):
        for start in range(0, len(x), size):
            part = op(x[start : start + size])
            differing |= {start + i for i in range(len(part)) if not torch.equal(part[i], full[start + i])}
    return differing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("features", "rows"), [(256, None), (64, None), (256, 7)])  # 64: a bias fused by the BLAS
@pytest.mark.filterwarnings("ignore:batch_invariant\\(rows=7\\)")  # said where 7 rows split (tested below)
def test_a_linear_layers_rows_do_not_depend_on_the_batch(dtype, features, rows):
    torch.manual_seed(0)
    layer = torch.nn.Linear(features, 384).to(dtype)
    x = torch.randn(19, features, dtype=dtype)
    with torch.no_grad(), batch_invariant(rows=rows):
        assert _rows_alone_and_together(layer, x, dtype) == set()
        # the bias fused into the product (addmm) and added after it (mm, then add_): the two forms of linear
        assert torch.equal(torch.addmm(layer.bias, x, layer.weight.t()), torch.mm(x, layer.weight.t()) + layer.bias)


def test_a_tile_whose_rows_depend_on_their_position_is_replaced_and_said(recwarn):
    # A kernel that splits a tile (MKL takes 7 float32 rows as 4 + 3 on the CPUs measured) gives a row other bits at
    # another position in it: the probe finds it and takes the next tile that does not, and says so.
    torch.manual_seed(0)
    weight, x = torch.randn(256, 384), torch.randn(30, 256)
    with torch.no_grad(), batch_invariant(rows=7):
        assert _rows_alone_and_together(lambda rows: rows @ weight, x, torch.float32) == set()
    said = [str(w.message) for w in recwarn if issubclass(w.category, DeterminismWarning)]
    assert all(re.fullmatch(r"batch_invariant\(rows=7\): .* tiles of \d+ row\(s\) are the reference instead.*", m)
               for m in said), said  # fmt: skip


def test_stock_float32_products_depend_on_the_row_count():
    # The failing reference: MKL's float32 GEMM takes other paths for 1-3, 5-7 and 9-11 rows on the CPUs measured.
    torch.manual_seed(0)
    weight, x = torch.randn(512, 512), torch.randn(16, 512)
    with torch.no_grad():
        differing = _rows_alone_and_together(lambda rows: rows @ weight, x, torch.float32)
    if not differing:
        pytest.skip("this machine's float32 GEMM gives a row the same bits at any row count: no failing reference")
    with torch.no_grad(), batch_invariant():  # the same rows, the same products, with the mode
        assert _rows_alone_and_together(lambda rows: rows @ weight, x, torch.float32) == set()


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_products_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(0)
    a, b = torch.randn(6, 21, 32, dtype=dtype), torch.randn(6, 32, 40, dtype=dtype)
    bias = torch.randn(40, dtype=dtype)
    with batch_invariant(rows=8):
        full, with_bias = torch.bmm(a, b), torch.baddbmm(bias, a, b)
        for entries in (slice(0, 1), slice(2, 5)):
            for rows in (slice(0, 1), slice(3, 20)):
                assert torch.equal(torch.bmm(a[entries, rows], b[entries]), full[entries, rows])
                assert torch.equal(torch.baddbmm(bias, a[entries, rows], b[entries]), with_bias[entries, rows])
        assert torch.equal(with_bias, full + bias)


@pytest.mark.filterwarnings("ignore::lightning_determinism.DeterminismWarning")  # float64 may take smaller tiles
def test_where_the_entry_count_matters_entries_go_two_at_a_time(monkeypatch):
    # A BLAS whose batched path depends on the number of entries (none here: forced) gets pairs of entries only.
    from lightning_determinism.invariance import tiles as module

    monkeypatch.setattr(module, "_entries_free", lambda *args: False)
    calls = []
    real = module._BMM_OUT
    monkeypatch.setattr(module, "_BMM_OUT", lambda a, b, out: calls.append(a.shape[0]) or real(a, b, out=out))
    torch.manual_seed(0)
    a, b = torch.randn(7, 16, 8), torch.randn(7, 8, 5)
    with batch_invariant():
        together = torch.bmm(a, b)
        assert set(calls) == {2}
        assert torch.equal(torch.bmm(a[5:], b[5:]), together[5:])
    assert torch.allclose(together, a @ b, atol=1e-5)


def test_the_products_stay_right():
    torch.manual_seed(0)
    a, b, c = torch.randn(37, 50, dtype=torch.float64), torch.randn(50, 9, dtype=torch.float64), torch.randn(9)
    with batch_invariant(rows=16):
        product, fused = a @ b, torch.addmm(c.double(), a, b, beta=0.5, alpha=2.0)
        integers = torch.arange(12).view(3, 4) @ torch.arange(8).view(4, 2)
    assert torch.allclose(product, (a.unsqueeze(-1) * b).sum(1), rtol=0, atol=1e-12)
    assert torch.allclose(fused, 0.5 * c.double() + 2.0 * (a @ b), rtol=0, atol=1e-12)
    assert torch.equal(integers, torch.arange(12).view(3, 4) @ torch.arange(8).view(4, 2))


def test_turning_it_off_gives_the_stock_kernels_back():
    torch.manual_seed(0)
    weight, x = torch.randn(512, 512), torch.randn(16, 512)
    stock_alone = x[:3] @ weight
    fastpath = torch.backends.mha.get_fastpath_enabled()
    with batch_invariant():
        with batch_invariant(rows=4):  # nested: the inner tile size while it lasts, the outer one's after
            assert batch_invariant_enabled()
        inside = x[:3] @ weight
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.equal(inside, (x @ weight)[:3])
    assert not batch_invariant_enabled()
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    assert torch.equal(x[:3] @ weight, stock_alone)
    with pytest.raises(RuntimeError, match="inside"), batch_invariant():
        raise RuntimeError("inside")
    assert not batch_invariant_enabled()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rows": 0}, ValueError, r"`rows` must be at least 1, got 0"),
        ({"rows": 2.0}, TypeError, r"`rows` must be an int, got float 2.0"),
        ({"key_block": True}, TypeError, r"`key_block` must be an int, got bool True"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match), batch_invariant(**kwargs):
        pass
    assert not batch_invariant_enabled()


def _reference_attention(q, k, v, mask):
    """Attention in float64 from its definition: softmax(q k^T / sqrt(E) + mask) v."""
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v.double()


@pytest.mark.parametrize("length", [5, 64, 150])
def test_invariant_attention_computes_attention(length):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, length, 16) for _ in range(3))
    causal = torch.ones(length, length).tril().bool()
    reference = _reference_attention(q, k, v, causal)
    assert torch.allclose(invariant_attention(q, k, v, is_causal=True, key_block=32).double(), reference, atol=1e-5)
    keep = torch.rand(2, 1, length, length) > 0.3
    keep[..., 0] = True  # every query sees a key
    masked = invariant_attention(q, k, v, attn_mask=keep)
    assert torch.allclose(masked.double(), _reference_attention(q, k, v, keep), atol=1e-5)
    additive = torch.zeros(length, length).masked_fill(~causal, float("-inf"))
    assert torch.allclose(invariant_attention(q, k, v, attn_mask=additive).double(), reference, atol=1e-5)


def test_invariant_attention_grouped_queries_and_half_precision():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert torch.allclose(invariant_attention(q, k, v, enable_gqa=True), expected, atol=1e-6)
    half = invariant_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), enable_gqa=True)
    assert half.dtype == torch.bfloat16
    assert torch.allclose(half.float(), expected, atol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_trailing_padding_never_moves_a_querys_bits(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 200, 16, dtype=dtype) for _ in range(3))
    with batch_invariant(key_block=16):
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for length in (1, 9, 16, 17, 100):
            short = F.scaled_dot_product_attention(
                q[:1, :, :length], k[:1, :, :length], v[:1, :, :length], is_causal=True
            )
            assert torch.equal(short, full[:1, :, :length]), length


def test_attention_in_chunks_of_entries_gives_the_same_bits(monkeypatch):
    # A long context or a large eval batch is attended a chunk of (batch x head) entries at a time, so its float32
    # working set stays bounded: the chunks change no bit.
    from lightning_determinism.invariance import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 70, 16, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(3, 1, 70, 70) > 0.2
    mask[..., 0] = True
    additive = torch.zeros(3, 1, 70, 70).masked_fill_(~mask, torch.finfo(torch.float32).min)  # as Hugging Face makes
    masks = [{"is_causal": True}, {"attn_mask": mask}, {"attn_mask": additive}]
    with batch_invariant():
        whole = [invariant_attention(q, k, v, **given) for given in masks]
        monkeypatch.setattr(attention, "_CHUNK_FLOATS", 1)  # one entry per chunk
        chunked = [invariant_attention(q, k, v, **given) for given in masks]
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))
    reference = _reference_attention(q.float(), k.float(), v.float(), mask)
    assert torch.allclose(whole[2].double(), reference, atol=3e-2)  # the additive mask hides what the bool one does


def test_invariant_attention_refuses_dropout_and_two_masks():
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match=r"`dropout_p` must be 0, got 0.1"):
        invariant_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="cannot both be given"):
        invariant_attention(q, q, q, attn_mask=torch.ones(2, 2, dtype=torch.bool), is_causal=True)


@pytest.mark.parametrize("net", ["gru", "transformer"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_samples_logits_do_not_depend_on_its_batch_or_its_padding(net, dtype):
    torch.manual_seed(0)
    model = (tiny_lm_class()(29, dim=32, hidden=64) if net == "gru" else TinyTransformer()).eval()
    ids, lengths = torch.randint(29, (12, 40)), torch.randint(3, 40, (12,))

    def logits(rows):
        width = int(lengths[rows].max())  # the batch padded to its longest sample
        with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            return model(ids[rows, :width]).float()

    with batch_invariant():
        together = logits(list(range(12)))
        for size in (1, 5):
            for start in range(0, 12, size):
                rows = list(range(start, min(start + size, 12)))
                part = logits(rows)
                for i, row in enumerate(rows):
                    n = int(lengths[row])
                    assert torch.equal(part[i, :n], together[row, :n]), (size, row)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_on_cuda_a_samples_logits_do_not_depend_on_its_batch(dtype):
    # cuBLAS picks its kernel (and split-K) by shape: the 128-row tiles give each row one kernel.
    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 4096).cuda()
    model = TinyTransformer().cuda().eval()
    x, ids = torch.randn(300, 1024, device="cuda"), torch.randint(29, (12, 40), device="cuda")
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16, enabled=dtype == torch.bfloat16):
        with batch_invariant():
            assert _rows_alone_and_together(layer, x[:40], dtype) == set()
            together = model(ids).float()
            for size in (1, 5):
                for start in range(0, 12, size):
                    part = model(ids[start : start + size]).float()
                    assert torch.equal(part, together[start : start + size]), (size, start)


def test_the_strategy_argument_is_a_bool_and_survives_pickling():
    with pytest.raises(TypeError, match=r"`batch_invariant` must be a bool, got 'yes'"):
        DeterministicSingleDeviceStrategy(device="cpu", batch_invariant="yes")
    strategy = pickle.loads(pickle.dumps(DeterministicSingleDeviceStrategy(device="cpu", batch_invariant=True)))
    assert strategy.batch_invariant is True  # spawn launchers pickle the strategy
    assert strategy._ldet_isolation._around is batch_invariant
    assert DeterministicSingleDeviceStrategy(device="cpu")._ldet_isolation._around is None
