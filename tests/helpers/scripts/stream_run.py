"""Phases of the streaming resume tests, each in its own process.

python stream_run.py configs OUT JSON      # for each config of the JSON list: straight, chain and elastic runs
                                           # (elastic: [devices, step, workers?] resume straight/ on another grid;
                                           # elastic_again: [run, devices, step, workers?] resume that run again;
                                           # elastic_drop_last_true: as elastic, litdata's drop_last=True given)
python stream_run.py straight OUT          # the whole run, a checkpoint after every step: OUT/step=K.ckpt
                                           # (configs: only after the steps a run is resumed from)
python stream_run.py elastic OUT K         # resume OUT/../straight/step=K.ckpt on DEVICES ranks (another world size)
python stream_run.py chain OUT K1 K2 ...   # resume OUT/step=K1.ckpt into OUT/r1 (checkpointing every step), then
                                           # OUT/r1/step=K2.ckpt into OUT/r2, ...: resumes in a row

Environment: SOURCE (plain: a generator with a shuffle buffer and noise drawn in the worker, replayed; plain-state:
the same with state_dict/load_state_dict; hf: Hugging Face datasets, shuffled, split by node; litdata: a
StreamingDataset over a directory written by litdata.optimize in the test), DEVICES (1 or 2 gloo ranks, fork),
WORKERS, PERSIST (persistent workers), EPOCHS, DROP_LAST (litdata: "default" leaves StreamingDataset's own, else True),
COLLATE ("mlm": tests.helpers.datasets.mask_collate, masking in the worker as DataCollatorForLanguageModeling does).
Rank 0 records, per step, the sample ids every rank consumed, the synced loss, and a fingerprint of the final
parameters and optimizer state.
"""

import json
import multiprocessing
import os
import sys
import zlib
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, get_worker_info  # noqa: E402

from lightning_determinism import DeterministicDDPStrategy, DeterministicSingleDeviceStrategy, fingerprint  # noqa: E402
from tests.helpers.datasets import mask_collate  # noqa: E402

SOURCE = os.environ.get("SOURCE", "plain")
DEVICES = int(os.environ.get("DEVICES", "2"))
WORKERS = int(os.environ.get("WORKERS", "2"))
EPOCHS = int(os.environ.get("EPOCHS", "2"))
PERSIST = bool(os.environ.get("PERSIST"))
DROP_LAST = os.environ.get("DROP_LAST", "true")  # litdata's drop_last: "default" (None: True on 2+ ranks, else False)
COLLATE = os.environ.get("COLLATE", "")
OWN_SAMPLERS = False  # Trainer(use_distributed_sampler=False): what users of self-sharding streams set
N = 64
FEATURES = torch.randn(N, 8, generator=torch.Generator().manual_seed(0))


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Shuffled(IterableDataset):
    """A user's stream: shards itself by rank and worker, shuffles through a buffer, adds noise (in the worker)."""

    def __init__(self, buffer: int = 5) -> None:
        self.buffer = buffer

    def _ids(self):
        rank, world = _rank_world()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return list(range(N))[rank * workers + worker :: world * workers]

    def _items(self, ids, buffer):
        for i in ids:
            buffer.append(i)
            if len(buffer) >= self.buffer:
                yield buffer.pop(int(torch.randint(len(buffer), ()).item()))
        while buffer:
            yield buffer.pop(int(torch.randint(len(buffer), ()).item()))

    def __iter__(self):
        for i in self._items(self._ids(), []):
            yield {"id": i, "x": FEATURES[i] + 0.1 * torch.randn(8)}


class StatefulShuffled(Shuffled):
    """The same stream with the state protocol: the shard position and the buffer's content."""

    def __init__(self) -> None:
        super().__init__()
        self._next, self._buffer, self._load = 0, [], None

    def state_dict(self):
        return {"next": self._next, "buffer": list(self._buffer)}

    def load_state_dict(self, state):
        self._load = state

    def __iter__(self):
        state, self._load = self._load or {"next": 0, "buffer": []}, None
        ids = self._ids()
        self._next, self._buffer = int(state["next"]), list(state["buffer"])

        def rest():
            while self._next < len(ids):
                self._next += 1
                yield ids[self._next - 1]

        for i in self._items(rest(), self._buffer):
            yield {"id": i, "x": FEATURES[i] + 0.1 * torch.randn(8)}


def hf_noise(example: dict) -> dict:
    """Noise drawn in the pipeline: datasets runs it in the threads that read its shards (see hf_dataset)."""
    return {"id": example["id"], "x": (torch.tensor(example["x"]) + 0.1 * torch.randn(8)).tolist()}


def hf_dataset(buffer: bool = True):
    """Shuffled through a buffer (replayed: its state drops the buffer), or only by shards (restored by its state).

    The shuffled one draws noise in a ``map`` before the buffer: datasets reads its 8 shards in a thread pool, so the
    draws came in the threads' order (other bits on every run) until the strategies read them in turn.
    """
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    rank, world = _rank_world()
    data = Dataset.from_dict({"id": list(range(N)), "x": FEATURES.tolist()})
    stream = data.to_iterable_dataset(num_shards=8)
    stream = stream.map(hf_noise).shuffle(seed=3, buffer_size=6) if buffer else stream
    return split_dataset_by_node(stream, rank=rank, world_size=world).with_format("torch")


def hf_unshuffled():
    return hf_dataset(buffer=False)


def litdata_loader():
    from litdata import StreamingDataLoader, StreamingDataset

    drop_last = None if DROP_LAST == "default" else True
    dataset = StreamingDataset(os.environ["LITDATA_DIR"], shuffle=True, seed=5, drop_last=drop_last)
    return StreamingDataLoader(dataset, batch_size=4, num_workers=WORKERS)


class Net(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.net = None
        self.steps: dict[int, dict] = {}

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x = batch["x"].float()
        loss = self.net(x).square().mean()
        ids = batch["id"].reshape(-1).long()
        crcs = torch.tensor([zlib.crc32(row.numpy().tobytes()) for row in batch["x"].detach()], dtype=torch.int64)
        both = torch.stack([ids, crcs])  # every rank's sample ids and the bits of each sample's content
        gathered = self.all_gather(both) if self.trainer.world_size > 1 else both[None]
        synced = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        step = int(self.trainer.global_step) + 1
        record = {"ids": gathered[:, 0].tolist(), "crc": gathered[:, 1].tolist(), "loss": float(synced).hex()}
        self.steps[step] = record
        return loss

    def train_dataloader(self):
        if SOURCE == "litdata":
            return litdata_loader()
        sources = {"plain": Shuffled, "plain-state": StatefulShuffled, "hf": hf_dataset, "hf-state": hf_unshuffled}
        dataset = sources[SOURCE]()
        persist = PERSIST and WORKERS > 0
        collate = mask_collate if COLLATE == "mlm" else None
        return DataLoader(dataset, batch_size=4, num_workers=WORKERS, persistent_workers=persist, collate_fn=collate)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            state = {
                "params": fingerprint(self.net),
                "optimizer": fingerprint(self.trainer.optimizers[0]),
                "global_step": int(self.trainer.global_step),
                "steps": self.steps,
            }
            (Path(self.out) / "result.json").write_text(json.dumps(state))


class AtSteps(ModelCheckpoint):
    """A ModelCheckpoint of every step (``every_n_train_steps=1``) that writes only the steps in ``steps``.

    ``None``: every step. The tests resume from a few steps of each run; each save costs collectives and a file.
    """

    def __init__(self, steps: set[int] | None, **kwargs) -> None:
        super().__init__(every_n_train_steps=1, save_top_k=-1, filename="{step}", **kwargs)
        self.steps = steps

    def _should_skip_saving_checkpoint(self, trainer: L.Trainer) -> bool:
        wanted = self.steps is None or trainer.global_step in self.steps
        return not wanted or super()._should_skip_saving_checkpoint(trainer)


def fit(out: Path, ckpt: Path | None = None, saves: set[int] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if DEVICES > 1:
        strategy = DeterministicDDPStrategy(seed=17, start_method="fork")
    else:
        strategy = DeterministicSingleDeviceStrategy(seed=17, device="cpu")
    every_step = AtSteps(saves, dirpath=out)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=DEVICES,
        max_epochs=EPOCHS,
        use_distributed_sampler=not OWN_SAMPLERS,
        callbacks=[every_step],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
    )
    trainer.fit(Net(str(out)), ckpt_path=str(ckpt) if ckpt else None)


def _sample(i: int) -> dict:
    return {"id": i, "x": FEATURES[i].numpy()}


def write_litdata(directory: Path) -> None:
    """N samples in litdata's format, 8 chunks (so that every rank and worker has chunks of its own)."""
    from litdata import optimize

    method = multiprocessing.get_start_method(allow_none=True)
    optimize(  # its worker forked: a spawned one would import torch and Lightning again (~5 s of CPU)
        fn=_sample, inputs=list(range(N)), output_dir=str(directory), chunk_size=N // 8, num_workers=1,
        mode="overwrite", start_method="fork",
    )  # fmt: skip
    multiprocessing.set_start_method(method, force=True)  # optimize leaves its start method set for the whole process


def configure(config: dict) -> None:
    """Set this process's configuration (the module's globals, as the environment would)."""
    global SOURCE, DEVICES, WORKERS, PERSIST, OWN_SAMPLERS, DROP_LAST, COLLATE
    SOURCE, DEVICES = config.get("source", "plain"), int(config.get("devices", 2))
    DROP_LAST = str(config.get("drop_last", "true"))
    WORKERS, PERSIST = int(config.get("workers", 2)), bool(config.get("persist", False))
    OWN_SAMPLERS = bool(config.get("own_samplers", False))
    COLLATE = str(config.get("collate", ""))
    if SOURCE == "litdata" and not Path(os.environ["LITDATA_DIR"]).exists():
        write_litdata(Path(os.environ["LITDATA_DIR"]))


def saves(config: dict) -> dict[str, set[int]]:
    """The steps each run of ``config`` is resumed from (the runs named as run_configs writes them)."""
    chain = config.get("chain", [])
    out = {"straight": {*chain[:1], 3}}  # step 3: the checkpoint tests read the straight run's streams there
    out["straight"] |= {k for _, k, *_ in config.get("elastic", []) + config.get("elastic_drop_last_true", [])}
    for n, k in enumerate(chain[1:], start=1):
        out[f"chain/r{n}"] = {k}
    for name, _, k, *_ in config.get("elastic_again", []):
        out.setdefault(name, set()).add(k)
    return out


def run_configs(out: Path, configs: list[dict]) -> None:
    """Each config: the straight run, then its chain of resumes, then its elastic resumes (one process for all)."""
    for config in configs:
        configure(config)
        root, at = out / config["name"], saves(config)
        fit(root / "straight", saves=at["straight"])
        source = root / "straight"
        for n, k in enumerate(config.get("chain", []), start=1):
            fit(root / "chain" / f"r{n}", source / f"step={k}.ckpt", saves=at.get(f"chain/r{n}", set()))
            source = root / "chain" / f"r{n}"
        for devices, k, *workers in config.get("elastic", []):  # another world size (and num_workers)
            configure({**config, "devices": devices, "workers": workers[0] if workers else config.get("workers", 2)})
            name = elastic_name(devices, workers)
            fit(root / name, root / "straight" / f"step={k}.ckpt", saves=at.get(name, set()))
        for devices, k, *workers in config.get("elastic_drop_last_true", []):  # litdata: drop_last=True given
            workers = workers or [config.get("workers", 2)]
            configure({**config, "devices": devices, "workers": workers[0], "drop_last": "true"})
            fit(root / f"{elastic_name(devices, [])}-drop-last-true", root / "straight" / f"step={k}.ckpt", saves=set())
        for name, devices, k, *workers in config.get("elastic_again", []):  # a run resumed elastically, again
            configure({**config, "devices": devices, "workers": workers[0] if workers else config.get("workers", 2)})
            fit(root / f"{name}-{devices}at{k}", root / name / f"step={k}.ckpt", saves=set())


def elastic_name(devices: int, workers: list[int]) -> str:
    return f"elastic{devices}" + (f"w{workers[0]}" if workers else "")


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "configs":  # python stream_run.py configs OUT '[{"name": ..., "source": ..., "chain": [3, 5]}]'
        run_configs(out, json.loads(sys.argv[3]))
        raise SystemExit(0)
    configure(
        {"source": SOURCE, "devices": DEVICES, "workers": WORKERS, "persist": PERSIST, "drop_last": DROP_LAST,
         "collate": COLLATE}
    )  # fmt: skip
    if mode == "straight":
        fit(out)
    elif mode == "elastic":  # resume OUT/../straight/step=K.ckpt on DEVICES ranks (another world size)
        fit(out, out.parent / "straight" / f"step={sys.argv[3]}.ckpt")
    elif mode == "chain":
        source = out.parent / "straight"
        for n, k in enumerate(sys.argv[3:], start=1):
            fit(out / f"r{n}", source / f"step={k}.ckpt")
            source = out / f"r{n}"
    else:
        raise SystemExit(f"unknown mode {mode}")
