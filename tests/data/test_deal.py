"""lightning_determinism.data.deal: the rest of an interrupted DistributedSampler epoch, dealt to another world."""

import pytest
from torch.utils.data import DistributedSampler

from lightning_determinism.data.deal import check_dealable, dealt_share, epoch_order, rest_of_epoch, share_of


def _deal(length=21, batch=2, drop_last=False, worlds=(2,), consumed=(3,)):
    return {"length": length, "seed": 4, "shuffle": True, "drop_last": drop_last, "batch": batch,
            "worlds": list(worlds), "consumed": list(consumed)}  # fmt: skip


def _samplers(deal, world, epoch):
    shares = []
    for rank in range(world):
        sampler = DistributedSampler(range(deal["length"]), world, rank, shuffle=True, seed=4,
                                     drop_last=deal["drop_last"])  # fmt: skip
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return shares


def test_the_epoch_order_is_what_each_replica_of_the_sampler_serves():
    deal = _deal()
    order = epoch_order(deal, epoch=3)
    for rank, share in enumerate(_samplers(deal, 2, epoch=3)):
        assert order[rank::2] == share  # independent reference: torch's sampler, replica by replica


@pytest.mark.parametrize("world", [1, 3, 4])
def test_the_rest_is_dealt_once_in_the_uninterrupted_order(world):
    deal = _deal()
    shares = _samplers(deal, 2, epoch=1)
    trained = [i for share in shares for i in share[: 3 * 2]]  # 3 batches of 2 on each of the 2 replicas
    left = [column[i] for i in range(3 * 2, len(shares[0])) for column in shares]  # interleaved as dealt
    assert rest_of_epoch(deal, 1) == left
    dealt = [dealt_share(deal, 1, rank, world) for rank in range(world)]
    assert len({len(share) for share in dealt}) == 1  # every replica the same number of samples (collectives)
    served = {i for share in dealt for i in share}
    assert served == set(left) and sorted(set(trained) | served) == list(range(21))
    padding = sum(map(len, dealt)) - len(left)
    assert 0 <= padding < world  # the sampler's kind of padding, no more


def test_a_rest_dealt_again_keeps_every_sample_once():
    first = _deal(worlds=(2,), consumed=(2,))
    left = rest_of_epoch(first, 0)  # 21 -> padded 22, 8 trained, 14 left
    on_three = [dealt_share(first, 0, rank, 3) for rank in range(3)]  # 14 -> 15 padded, 5 each
    second = {**first, "worlds": [2, 3], "consumed": [2, 1]}  # one batch of 2 on each of the 3, then interrupted
    trained_second = {i for share in on_three for i in share[:2]}
    rest = rest_of_epoch(second, 0)
    assert set(rest) | trained_second == set(left)
    assert [dealt_share(second, 0, 0, 1)] == [rest]


def test_drop_last_cuts_as_the_sampler_does():
    deal = _deal(drop_last=True)
    dealt = [dealt_share(deal, 0, rank, 4) for rank in range(4)]
    assert {len(share) for share in dealt} == {len(rest_of_epoch(deal, 0)) // 4}


def _loader(**kwargs):
    from torch.utils.data import DataLoader

    return DataLoader(range(21), **{"batch_size": 2, "shuffle": True, **kwargs})


def test_one_process_takes_the_whole_rest_and_is_told_that_later_epochs_are_its_own_sampler():
    deal = _deal()
    message = check_dealable(deal, _loader(), 1, one_process=True)
    assert "resumed on one process whose training loader samples with RandomSampler: the 10 samples" in message
    assert "\n" not in message
    assert share_of(deal, _loader(), 1) == rest_of_epoch(deal, 1)  # all of it, unpadded


@pytest.mark.parametrize(
    ("loader", "one_process", "match"),
    [
        (dict(), False, "sampled by RandomSampler on several ranks without a DistributedSampler: the rest of the"),
        (dict(batch_size=1, batch_sampler=[[0, 1]], shuffle=False), True, "with a batch sampler of its own"),
        (dict(batch_size=3), True, "whose batch 2 -> 3 since"),
    ],
    ids=["several-ranks", "batch-sampler", "batch-size"],
)
def test_what_cannot_be_dealt_is_refused_in_one_line(loader, one_process, match):
    with pytest.raises(RuntimeError, match=match) as raised:
        check_dealable(_deal(), _loader(**loader), 1, one_process=one_process)
    assert "\n" not in str(raised.value)
