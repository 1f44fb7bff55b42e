"""The reduction cost model: independent arithmetic for a few points, and its refusals."""

import pytest

from lightning_determinism.invariance.cost import reduction_cost

GB = 1e9


def test_the_model_at_1024_processes_for_a_7b_model():
    n = 28 * GB  # 7e9 float32 gradients
    # DDP: a ring all-reduce moves 2 * 1023/1024 N; 0.1.0's tree climbed 10 levels of whole gradients
    assert reduction_cost("ddp", "stock", 1024, 1024, n).bytes_sent == pytest.approx(55.945 * GB, rel=1e-4)
    assert reduction_cost("ddp", "invariant", 1024, 1024, n).bytes_sent == pytest.approx(55.945 * GB, rel=1e-4)
    assert reduction_cost("ddp", "0.1.0", 1024, 1024, n).bytes_sent == pytest.approx(280 * GB)
    assert [reduction_cost("ddp", r, 1024, 1024, n).rounds for r in ("stock", "invariant", "0.1.0")] == [1, 2, 10]
    # FSDP2 at W = 64, K = 16: the shard is 0.4375 GB; 5 subtree sums of it beside it, against 0.1.0's 5 whole ones
    assert reduction_cost("fsdp2", "stock", 64, 1024, n).gradient_bytes == pytest.approx(0.4375 * GB)
    assert reduction_cost("fsdp2", "invariant", 64, 1024, n).gradient_bytes == pytest.approx(6 * 0.4375 * GB)
    assert reduction_cost("fsdp2", "0.1.0", 64, 1024, n).gradient_bytes == pytest.approx((0.4375 + 140) * GB)
    # one reduce-scatter (or all-to-all) of 63/64 N per micro-batch, 16 per step
    assert reduction_cost("fsdp2", "invariant", 64, 1024, n).bytes_sent == pytest.approx(16 * 63 / 64 * n)


def test_one_process_sends_nothing():
    for strategy in ("ddp", "fsdp2"):
        cost = reduction_cost(strategy, "invariant", 1, 8, 1000.0)
        assert (cost.bytes_sent, cost.rounds) == (0, 0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("zero", "stock", 4, 16, 1.0), r"`strategy` must be one of \('ddp', 'fsdp2'\), got 'zero'"),
        (("ddp", "ring", 4, 16, 1.0), r"`reduction` must be one of .*, got 'ring'"),
        (("ddp", "stock", 0, 16, 1.0), r"`world_size` must be a positive integer, got 0"),
        (
            ("ddp", "stock", 3, 12, 1.0),
            r"`world_size` must be a power of two that divides `micro_batches` \(12\), got 3",
        ),
        (("ddp", "stock", 4, 2, 1.0), r"divides `micro_batches` \(2\), got 4"),
        (("ddp", "stock", 4, 16, 0.0), r"`gradient_bytes` must be positive, got 0.0"),
    ],
)
def test_bad_arguments_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        reduction_cost(*args)
