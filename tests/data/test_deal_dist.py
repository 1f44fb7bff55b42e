"""A 2-rank mid-epoch checkpoint resumed on one process, whose loader samples with RandomSampler: the rest dealt.

The most common elastic resume (a cluster's checkpoint debugged on a workstation): Lightning injects no
DistributedSampler on one process, so the rest of the interrupted epoch is dealt to the one process's loader, each
remaining sample once, and the epochs after follow its own sampler.
"""

import hashlib
import json
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_determinism import DeterminismWarning, DeterministicDDPStrategy, DeterministicSingleDeviceStrategy
from tests.callbacks.test_resume_changes import IdsModule
from tests.helpers.lightning_models import quiet_trainer

pytestmark = pytest.mark.distributed

N, BATCH = 24, 4  # 3 batches per rank and epoch on 2 ranks, 6 on one process


class RankIds(IdsModule):
    """Per rank: the sample ids of each step and the final weights' digest; counts the hooks that ran."""

    def __init__(self, out: Path, n: int = N) -> None:
        super().__init__(out, n=n, batch_size=BATCH, shuffle=True)
        self.started = False

    def on_train_start(self) -> None:
        self.started = True

    def on_train_end(self) -> None:
        weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in self.parameters())).hexdigest()
        record = {"ids": self.ids, "weights": weights}
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(record))


def _fit(out: Path, strategy, devices: int, ckpt=None, n: int = N) -> RankIds:
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = quiet_trainer(strategy, devices, max_epochs=2, callbacks=[checkpoints], enable_checkpointing=True)
    module = RankIds(out, n=n)
    trainer.fit(module, ckpt_path=ckpt)
    return module


def _record(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def _one(seed: int = 3) -> DeterministicSingleDeviceStrategy:
    return DeterministicSingleDeviceStrategy(seed=seed, device="cpu")


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    """A 2-rank run (step checkpoints), its step-1 checkpoint resumed on one process (warnings kept)."""
    root = tmp_path_factory.mktemp("deal")
    _fit(root / "two", DeterministicDDPStrategy(seed=3, start_method="fork"), 2)
    with pytest.warns(DeterminismWarning) as warned:
        _fit(root / "one", _one(), 1, ckpt=root / "two" / "step=1.ckpt")
    return root, [str(w.message) for w in warned if issubclass(w.category, DeterminismWarning)]


def test_two_ranks_resumed_on_one_process_train_the_rest_of_the_epoch_once_then_the_own_sampler(elastic):
    root, warned = elastic
    shares = [[i for batch in _record(root / "two", rank)["ids"][:3] for i in batch] for rank in range(2)]
    consumed = {i for share in shares for i in share[:BATCH]}  # step 1: one batch on each rank
    rest = [share[i] for i in range(BATCH, 3 * BATCH) for share in shares]  # the uninterrupted order, interleaved
    ids = _record(root / "one")["ids"]
    assert [i for batch in ids[:4] for i in batch] == rest  # 16 samples left, in 4 batches of 4
    assert sorted(consumed | set(rest)) == list(range(N)) and len(rest) == 16
    epoch_1 = [i for batch in ids[4:] for i in batch]
    assert len(ids) == 4 + 6 and sorted(epoch_1) == list(range(N))  # one process's RandomSampler: every sample once
    said = [message for message in warned if "dealt to this process" in message]
    assert len(said) == 1 and "\n" not in said[0]
    assert "epoch 0 under a DistributedSampler over 2 ranks" in said[0] and "RandomSampler's own order" in said[0]


def test_a_checkpoint_written_in_the_dealt_rest_resumes_it_bitwise_on_one_process(elastic, tmp_path):
    root, _ = elastic
    with pytest.warns(DeterminismWarning, match="dealt to this process"):
        _fit(tmp_path, _one(), 1, ckpt=root / "one" / "step=3.ckpt")  # 2 of the 4 dealt batches trained
    resumed, straight = _record(tmp_path), _record(root / "one")
    assert resumed["ids"] == straight["ids"][2:]
    assert resumed["weights"] == straight["weights"]


def test_another_dataset_length_is_refused_before_training(elastic, tmp_path):
    root, _ = elastic
    out = tmp_path / "shorter"
    out.mkdir()
    trainer = quiet_trainer(_one(), 1, max_epochs=2)
    module = RankIds(out, n=20)
    with pytest.raises(RuntimeError, match=r"^The checkpoint was written mid-epoch by a training loader whose length"):
        trainer.fit(module, ckpt_path=root / "two" / "step=1.ckpt")
    assert not module.started and not module.ids  # refused before training, not inside its first batch
