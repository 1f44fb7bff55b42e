"""World-size-invariant FSDP2 (DeterministicModelParallelStrategy with global_batch_size / micro_batch_size,
tensor_parallel_size=1) on 1, 2 and 4 forked gloo ranks: one fingerprint of parameters and optimizer state after
every step, and a 2-rank mid-epoch distributed checkpoint resumed on 1 and on 4 ranks to the same bits."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_determinism import DeterministicModelParallelStrategy, fingerprint
from lightning_determinism._compat.features import INVARIANT_FSDP2
from tests.helpers import requires_feature

pytestmark = [pytest.mark.distributed, requires_feature(INVARIANT_FSDP2)]

B, M_SIZE = 8, 2  # 4 micro-batches per step: K = 4, 2, 1 on 1, 2, 4 ranks


class Net(L.LightningModule):
    def __init__(self, out: str, shard_one: bool = True) -> None:
        super().__init__()
        self.out, self.net, self.steps, self.shard_one = out, None, {}, shard_one

    def configure_model(self) -> None:
        if self.net is not None:
            return
        from torch.distributed.fsdp import fully_shard

        self.net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 1))
        mesh = self.device_mesh["data_parallel"]
        if mesh.size() == 1 and not self.shard_one:
            return  # the usual `if dp > 1: fully_shard(...)`: plain parameters on one process
        for layer in (self.net[0], self.net[4]):
            fully_shard(layer, mesh=mesh)  # also on one rank: the same code on every world size
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if not self.trainer.fit_loop._should_accumulate():  # a step completed: every rank digests its shards
            state = {"params": fingerprint(self.net), "optimizer": fingerprint(self.trainer.optimizers[0])}
            self.steps[int(self.trainer.global_step)] = state

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            Path(self.out, "steps.json").write_text(json.dumps(self.steps))

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 6, generator=gen), torch.randn(32, 1, generator=gen))
        return DataLoader(data, batch_size=M_SIZE, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _fit(out: Path, ranks: int, ckpt: Path | None = None, checkpoints: bool = False, shard_one: bool = True) -> dict:
    out.mkdir(parents=True)
    strategy = DeterministicModelParallelStrategy(
        seed=4, data_parallel_size=ranks, tensor_parallel_size=1, global_batch_size=B, micro_batch_size=M_SIZE,
        start_method="fork",
    )  # fmt: skip
    callbacks = [ModelCheckpoint(dirpath=out, every_n_train_steps=3, save_top_k=-1, filename="{step}")]
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=ranks, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=checkpoints,
        callbacks=callbacks if checkpoints else [], default_root_dir=str(out),
    )  # fmt: skip
    trainer.fit(Net(str(out), shard_one), ckpt_path=str(ckpt) if ckpt else None)
    return {int(k): v for k, v in json.loads((out / "steps.json").read_text()).items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariant-fsdp")
    two = _fit(root / "two", 2, checkpoints=True)
    one, four = _fit(root / "one", 1), _fit(root / "four", 4)
    plain = _fit(root / "one-plain", 1, shard_one=False)
    checkpoint = root / "two" / "step=3.ckpt"  # in the middle of epoch 0 (4 steps per epoch)
    resumed = {ranks: _fit(root / f"resumed-on-{ranks}", ranks, ckpt=checkpoint) for ranks in (1, 4)}
    return {"one": one, "plain": plain, "two": two, "four": four, "resumed": resumed, "checkpoint": checkpoint}


def test_one_two_and_four_ranks_give_the_same_bits_every_step(runs):
    assert len(runs["two"]) == 8  # 2 epochs of 32 samples, 8 per step
    assert runs["one"] == runs["two"] == runs["four"]
    assert runs["plain"] == runs["two"]  # one process without fully_shard: plain parameters, the same bits
    assert len({step["params"] for step in runs["two"].values()}) == 8  # the parameters do change


def test_the_bits_are_release_0_1_0s(runs):
    # What release 0.1.0 (b58633f) gave on torch 2.13 after the last step: the reduction changed since (each rank adds
    # its chunk of adjacent micro-batches), its sums did not.
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if version != "2.13":
        pytest.skip(f"release 0.1.0's fingerprint is pinned for torch 2.13, not {torch.__version__}")
    assert runs["four"][8] == {
        "params": "ae6ca5a4b32cb376de30c9cefeda39b85dc7c93b347e312bcd6fb2ba06b91047",
        "optimizer": "f163fe987a18bcf91a9217ca480be7b86a248a3a286cb9f038115b26dbe26877",
    }


@pytest.mark.parametrize("ranks", [1, 4])
def test_a_two_rank_mid_epoch_checkpoint_resumes_bitwise_on_another_number_of_ranks(runs, ranks):
    assert runs["checkpoint"].is_dir()  # a distributed checkpoint: DCP reshards the parameters and Adam's state
    assert runs["resumed"][ranks] == {step: state for step, state in runs["two"].items() if step > 3}


def test_a_two_rank_checkpoint_resumes_bitwise_into_a_model_left_unsharded_on_one_device(runs, tmp_path):
    # configure_model shards only when the data-parallel mesh has more than one rank: plain parameters on one device
    # take the shards' tensors whole (Lightning's loader: "Could not find a distributed model")
    resumed = _fit(tmp_path / "resumed-plain", 1, ckpt=runs["checkpoint"], shard_one=False)
    assert resumed == {step: state for step, state in runs["two"].items() if step > 3}
    assert resumed[8] == runs["plain"][8]  # the one-process run's final bits too


def test_tensor_parallelism_is_refused_in_the_invariant_mode(tmp_path):
    with pytest.raises(Exception, match=r"needs `tensor_parallel_size=1`, got 2"):
        strategy = DeterministicModelParallelStrategy(
            seed=4, tensor_parallel_size=2, global_batch_size=B, micro_batch_size=M_SIZE, start_method="fork"
        )
        L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                  enable_progress_bar=False).fit(Net(str(tmp_path)))  # fmt: skip


def test_a_torch_without_the_custom_reduce_scatter_is_refused_once_in_the_main_process(tmp_path, monkeypatch):
    # torch 2.8 (FSDPModule.set_custom_reduce_scatter came in 2.9), as the feature check sees it: before, every rank
    # raised in its setup and the launcher reported a rank's traceback; now the main process refuses before the launch
    from lightning_determinism._compat import checks
    from lightning_determinism._compat.features import INVARIANT_FSDP2
    from lightning_determinism.errors import IncompatibleVersionError

    class _Gone:
        name, feature = "FSDPModule.set_custom_reduce_scatter", INVARIANT_FSDP2

        def present(self):
            return False

    real = checks.missing
    monkeypatch.setattr(
        checks, "missing", lambda feature=None: [_Gone()] if feature == INVARIANT_FSDP2 else real(feature)
    )
    monkeypatch.setattr(checks, "_REQUIRED", set())
    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 1, "global_batch_size": B, "micro_batch_size": M_SIZE}
    strategy = DeterministicModelParallelStrategy(seed=4, start_method="fork", **sizes)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                        enable_progress_bar=False)  # fmt: skip
    with pytest.raises(IncompatibleVersionError, match=r"invariant FSDP2 .*set_custom_reduce_scatter is missing"):
        trainer.fit(Net(str(tmp_path)))
