"""Nothing silent at resume, in one process: a stock Lightning checkpoint, other data, batch size, workers,
accumulation, invariant step, seed or hyper-parameters each resume exactly, are refused, or get one warning that says
what will be repeated, skipped or ignored."""

import json
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_determinism import DeterminismWarning, DeterministicSingleDeviceStrategy
from lightning_determinism.callbacks.rng_checkpoint import CHECKPOINT_KEY
from tests.helpers.lightning_models import quiet_trainer


class Ids(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return i, torch.full((4,), float(i))


class IdsModule(L.LightningModule):
    """Records, per optimizer step, the sample ids it trained on (to `out/ids.json` at the end of training)."""

    def __init__(
        self, out: Path, n: int = 24, batch_size: int = 4, shuffle: bool = False, workers: int = 0, lr: float = 0.01
    ) -> None:
        super().__init__()
        self.out, self.n, self.batch_size, self.shuffle, self.workers = out, n, batch_size, shuffle, workers
        self.lr = lr
        self.net = nn.Linear(4, 1)
        self.ids: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        ids, x = batch
        self.ids.append(ids.tolist())
        return self.net(x).square().mean()

    def train_dataloader(self):
        return DataLoader(Ids(self.n), batch_size=self.batch_size, shuffle=self.shuffle, num_workers=self.workers)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def on_train_end(self) -> None:
        (self.out / "ids.json").write_text(json.dumps(self.ids))


def _fit(out: Path, module_kwargs=None, ckpt=None, every_step=False, seed=3, invariant=None, **trainer_kwargs):
    out.mkdir(parents=True, exist_ok=True)
    callbacks = [ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=-1, filename="{step}")]
    strategy = DeterministicSingleDeviceStrategy(seed=seed, device="cpu", **(invariant or {}))
    trainer = quiet_trainer(
        strategy, 1, max_epochs=2, callbacks=callbacks, enable_checkpointing=True, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(IdsModule(out, **(module_kwargs or {})), ckpt_path=ckpt)
    return json.loads((out / "ids.json").read_text())


def _stock(path: Path, out: Path) -> Path:
    """The checkpoint as stock Lightning writes it: no RNG state, no data position."""
    checkpoint = torch.load(path, weights_only=True)
    checkpoint.pop(CHECKPOINT_KEY)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out / "stock.ckpt")
    return out / "stock.ckpt"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("changes")
    return root, _fit(root / "straight"), _fit(root / "shuffled", {"shuffle": True})


def test_a_stock_mid_epoch_checkpoint_resumes_at_the_next_sample_where_the_order_depends_on_the_epoch(straight):
    root, ids, _ = straight
    stock = _stock(root / "straight" / "step=3.ckpt", root / "stock")  # 3 of 6 batches into epoch 0
    with pytest.warns(DeterminismWarning, match="holds no RNG state"):
        resumed = _fit(root / "from-stock", ckpt=stock)
    assert resumed == ids[3:]  # Lightning alone restarted the epoch: ids 0-11 twice, 12-23 never


def test_a_stock_mid_epoch_checkpoint_of_a_shuffled_loader_says_what_is_repeated_and_skipped(straight):
    root, _, shuffled = straight
    stock = _stock(root / "shuffled" / "step=3.ckpt", root / "stock-shuffled")
    with pytest.warns(DeterminismWarning, match="some samples are trained twice in this epoch and others not at all"):
        resumed = _fit(root / "from-stock-shuffled", {"shuffle": True}, ckpt=stock)
    assert len(resumed) == len(shuffled) - 3  # what the warning says: the epoch trains only the batches it had left
    assert sorted(i for batch in resumed[:3] for i in batch) != sorted(i for batch in shuffled[3:6] for i in batch)


@pytest.mark.parametrize(
    ("module_kwargs", "match"),
    [({"n": 20}, "length 24 -> 20"), ({"batch_size": 8}, "batch_size 4 -> 8")],
    ids=["dataset-length", "batch-size"],
)
def test_other_data_or_batch_size_mid_epoch_is_refused(straight, tmp_path, module_kwargs, match):
    root, _, _ = straight
    with pytest.raises(RuntimeError, match=rf"3 batches into epoch 0 of a training loader whose {match} since"):
        _fit(tmp_path, module_kwargs, ckpt=root / "straight" / "step=3.ckpt")


def test_other_data_at_an_epoch_boundary_is_accepted(straight, tmp_path):
    root, _, _ = straight
    resumed = _fit(tmp_path, {"batch_size": 8}, ckpt=root / "straight" / "step=6.ckpt")  # the end of epoch 0
    assert [i for batch in resumed for i in batch] == list(range(24))


def test_other_num_workers_without_per_sample_seeds_warns_that_worker_randomness_differs(straight, tmp_path):
    root, ids, _ = straight
    with pytest.warns(DeterminismWarning, match="num_workers 0 -> 2: the interrupted epoch continues at its next"):
        resumed = _fit(tmp_path, {"workers": 2}, ckpt=root / "straight" / "step=3.ckpt")
    assert resumed == ids[3:]  # the same samples; only randomness drawn in the workers would differ


def test_other_accumulation_warns(straight, tmp_path):
    root, _, _ = straight
    with pytest.warns(DeterminismWarning, match="accumulate_grad_batches: 1 -> 2 .every later optimizer step sums"):
        _fit(tmp_path, ckpt=root / "straight" / "step=6.ckpt", accumulate_grad_batches=2)


# The run's identity (issue 40, items 2 and 5): a resume under another configuration is refused or said in one line.

STEP8 = {"global_batch_size": 8, "micro_batch_size": 4}  # K = 2 micro-batches of 4 per step on one process


@pytest.fixture(scope="module")
def invariant(straight):
    root, _, _ = straight
    # 3 steps an epoch: step=1 mid-epoch, step=3 its end; shuffled: the order follows derive_seed(base, epoch)
    return (
        root,
        _fit(root / "invariant", invariant=STEP8),
        _fit(root / "inv-shuffled", {"shuffle": True}, invariant=STEP8),
    )


def _said(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, DeterminismWarning)]


def test_the_checkpoint_records_the_runs_identity(straight, invariant):
    identity = torch.load(straight[0] / "straight" / "step=3.ckpt", weights_only=True)[CHECKPOINT_KEY]["identity"]
    assert json.loads(json.dumps(identity)) == identity  # flat and JSON-able
    assert {k: identity[k] for k in ("base_seed", "world_size", "global_batch_size", "optimizer", "optimizer.lr")} == {
        "base_seed": 3, "world_size": 1, "global_batch_size": None, "optimizer": "SGD", "optimizer.lr": 0.01,
    }  # fmt: skip
    assert (identity["train_samples"], identity["train_batches"], identity["max_epochs"]) == (24, 6, 2)
    saved = torch.load(invariant[0] / "invariant" / "step=1.ckpt", weights_only=True)[CHECKPOINT_KEY]["identity"]
    assert [saved[k] for k in ("global_batch_size", "micro_batch_size", "micro_batches_per_rank")] == [8, 4, 2]
    assert saved["accumulate_grad_batches"] == 2


@pytest.mark.parametrize(
    ("resumed_with", "match"),
    [
        (
            {"global_batch_size": 16, "micro_batch_size": 4},
            "and is resumed with global_batch_size=16, micro_batch_size=4",
        ),
        (None, "and is resumed without the world-size-invariant mode"),
    ],
    ids=["another-global-batch", "invariant-to-plain"],
)
def test_another_invariant_step_mid_epoch_is_refused(invariant, tmp_path, resumed_with, match):
    root, _, _ = invariant
    with pytest.raises(
        RuntimeError, match=r"2 batches into epoch 0 with global_batch_size=8, micro_batch_size=4 " + match
    ):
        _fit(tmp_path, ckpt=root / "invariant" / "step=1.ckpt", invariant=resumed_with)


def test_plain_to_invariant_mid_epoch_is_refused_the_same_way(straight, tmp_path):
    root, _, _ = straight
    with pytest.raises(RuntimeError, match="without the world-size-invariant mode and is resumed with global_batch_si"):
        _fit(tmp_path, ckpt=root / "straight" / "step=3.ckpt", invariant=STEP8)


@pytest.mark.parametrize(
    ("resumed_with", "changes"),
    [
        ({"global_batch_size": 4, "micro_batch_size": 4}, "global_batch_size: 8 -> 4; micro_batches_per_rank: 2 -> 1;"),
        (None, "global_batch_size: 8 -> None; micro_batch_size: 4 -> None; micro_batches_per_rank: 2 -> None;"),
    ],
    ids=["another-global-batch", "invariant-to-plain"],
)
def test_another_invariant_step_at_an_epoch_boundary_is_said_in_one_line(invariant, tmp_path, resumed_with, changes):
    root, _, _ = invariant
    with pytest.warns(DeterminismWarning) as record:
        resumed = _fit(tmp_path, ckpt=root / "invariant" / "step=3.ckpt", invariant=resumed_with)
    assert _said(record) == [
        f"Resuming a checkpoint written under another configuration: {changes} accumulate_grad_batches: 2 -> 1."
    ]  # an unchanged field (m) is not listed; the invariant mode sets the accumulation itself
    assert sorted(i for batch in resumed for i in batch) == list(range(24))  # epoch 1, each sample once


def test_another_seed_mid_epoch_is_refused_with_how_to_continue(straight, tmp_path):
    root, _, _ = straight
    with pytest.raises(RuntimeError, match=r"3 batches into epoch 0 by a run with base seed 3, and this run's base seed"
                                           r" is 4: .* Resume with seed=3"):  # fmt: skip
        _fit(tmp_path, {"shuffle": True}, ckpt=root / "shuffled" / "step=3.ckpt", seed=4)


def test_another_seed_at_an_epoch_boundary_is_said_in_one_line(straight, tmp_path):
    root, _, _ = straight
    with pytest.warns(DeterminismWarning) as record:
        _fit(tmp_path, {"shuffle": True}, ckpt=root / "shuffled" / "step=6.ckpt", seed=4)
    notes = _said(record)
    head = "Resuming a checkpoint written under another configuration: base_seed: 3 -> 4 (the saved RNG states are"
    assert len(notes) == 1 and notes[0].startswith(head), notes


def test_another_runs_finished_checkpoint_with_another_lr_says_the_lr_is_ignored_and_nothing_trains(straight, tmp_path):
    # The case: run B (another lr) resumed run A's final checkpoint, trained nothing and exited 0 silently.
    root, _, _ = straight
    with pytest.warns(DeterminismWarning) as record:
        resumed = _fit(tmp_path, {"lr": 0.1}, ckpt=root / "straight" / "step=12.ckpt")
    assert resumed == []
    assert _said(record) == [
        "Resuming a checkpoint written under another configuration: optimizer.lr: 0.01 -> 0.1 (Lightning restores the"
        " checkpoint's optimizer state, hyper-parameters included: this run trains with 0.01, the new value is"
        " ignored); the checkpoint already reaches max_epochs=2 (2 epochs done): nothing is trained."
    ]


def test_the_same_configuration_says_nothing_and_an_older_checkpoint_loads_as_before(straight, tmp_path, recwarn):
    root, ids, _ = straight
    assert _fit(tmp_path / "same", ckpt=root / "straight" / "step=3.ckpt") == ids[3:]
    checkpoint = torch.load(root / "straight" / "step=3.ckpt", weights_only=True)
    del checkpoint[CHECKPOINT_KEY]["identity"]  # written before the identity was recorded
    torch.save(checkpoint, tmp_path / "older.ckpt")
    assert _fit(tmp_path / "older", {"lr": 0.1}, ckpt=tmp_path / "older.ckpt") == ids[3:]
    assert _said(recwarn) == []


def test_a_drawn_seed_takes_the_checkpoints_so_a_requeued_job_without_a_seed_continues_its_run(
    invariant, tmp_path, monkeypatch
):
    # The preemption recipe passes no seed: each requeued job draws its own, whose order of the epoch (here the
    # invariant mode's, derived from the base seed) is not the checkpoint's. The drawn seed gives way to it.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    root, _, shuffled = invariant
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)  # nothing to say: the run continues the saved one
        resumed = _fit(
            tmp_path, {"shuffle": True}, ckpt=root / "inv-shuffled" / "step=1.ckpt", seed=None, invariant=STEP8
        )
    assert resumed == shuffled[2:]  # after step 1's 2 micro-batches, every batch of the uninterrupted run, epoch 1 too


def test_an_optimizer_hyper_parameter_from_a_hydra_config_is_part_of_the_identity():
    # hydra.utils.instantiate hands the optimizer its sequences as ListConfig (its default `_convert_="none"`); Rprop
    # keeps `etas` as given (Adam makes `betas` a tuple)
    from lightning_determinism.callbacks.run_identity import optimizer_identity

    etas = pytest.importorskip("omegaconf").OmegaConf.create([0.5, 1.2])
    identity = optimizer_identity([torch.optim.Rprop(nn.Linear(2, 1).parameters(), etas=etas)])
    assert identity["optimizer.etas"] == [0.5, 1.2]  # a resume with other etas is then said
    assert json.loads(json.dumps(identity)) == identity  # JSON-able: it goes into checkpoints and log records
