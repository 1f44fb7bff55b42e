"""CUDA determinism checks that no CPU test can make: run where a GPU is (scripts/gpu_check.sh runs it).

Each check prints one line, ``PASS``, ``FAIL`` or ``INFO`` (a figure reported, not a claim), and the script exits 1
when any check failed. It needs one CUDA device; without one it says so and exits 0 (nothing to check).

1. Backends: ``set_seed(debug_mode="error")`` turns on deterministic algorithms and cuDNN's deterministic mode and
   sets ``CUBLAS_WORKSPACE_CONFIG`` before CUDA starts.
2. Two training runs in two fresh processes (cuDNN convolutions, cuBLAS matmuls, dropout, ``index_add_`` whose
   stock CUDA kernel is atomic) end with the same parameters, bitwise.
3. The CUDA generator in checkpoints: a Lightning fit on one GPU drawing from the CUDA generator every step, resumed
   from a mid-epoch checkpoint in a new Trainer, ends bitwise equal to the uninterrupted fit.
4. Activation checkpointing on CUDA: dropout drawn from the tracker's CUDA stream inside a checkpointed block gives
   the gradients of the block without checkpointing, bitwise (reentrant and non-reentrant forms).
5. NCCL: a process group on the GPU all-reduces int64 and float64 exactly, and ``DistributedPerplexity`` synced
   over it gives the value it gives unsynced.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

FAILED: list[str] = []


def report(ok: bool | None, name: str, detail: str = "") -> None:
    word = "INFO" if ok is None else ("PASS" if ok else "FAIL")
    if ok is False:
        FAILED.append(name)
    print(f"{word}  {name}{': ' + detail if detail else ''}", flush=True)


def digest(model) -> str:
    from lightning_determinism import fingerprint

    return fingerprint(model)[:16]  # CUDA tensors hash as their CPU copies


def train_once(seed: int) -> str:
    """One short run on the GPU under debug_mode="error"; the sha256 of its parameters."""
    import torch
    from torch import nn

    from lightning_determinism import set_seed

    set_seed(seed, debug_mode="error")
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Conv2d(16, 8, 3),
        nn.Flatten(),
        nn.Linear(8 * 14 * 14, 64),
        nn.GELU(),
        nn.Linear(64, 10),
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(20):
        x = torch.randn(32, 3, 16, 16, device="cuda")
        y = torch.randint(0, 10, (32,), device="cuda")
        loss = nn.functional.cross_entropy(model(x), y)
        pooled = torch.zeros(10, device="cuda").index_add_(0, y, loss.expand(32))  # an atomic kernel in stock CUDA
        (loss + 1e-3 * pooled.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    return digest(model)


def check_backends() -> None:
    import torch

    from lightning_determinism import determinism_report, set_seed

    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    set_seed(0, debug_mode="error")
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        not torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8",
    )
    report(all(flags), "backends under debug_mode='error'", f"(algorithms, cudnn det, no benchmark, cublas) = {flags}")
    info = determinism_report()
    report(
        None,
        "determinism_report",
        ", ".join(
            f"{k}={info.get(k)}"
            for k in (
                "cuda_available",
                "cuda_device_count",
                "cudnn_version",
                "cublas_workspace_config",
                "cuda_matmul_allow_tf32",
            )
        ),
    )


def check_two_runs() -> None:
    runs = [
        subprocess.run([sys.executable, __file__, "--train", "7"], capture_output=True, text=True, timeout=300)
        for _ in range(2)
    ]
    for run in runs:
        if run.returncode:
            report(False, "two runs bitwise", run.stderr.strip().splitlines()[-1] if run.stderr else "no output")
            return
    first, second = (run.stdout.strip() for run in runs)
    report(first == second, "two runs bitwise (cuDNN, cuBLAS, dropout, index_add_)", f"{first} / {second}")


def check_resume(tmp: Path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_determinism import DeterministicSingleDeviceStrategy

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            noise = 0.1 * torch.randn_like(x)  # the CUDA generator, each step
            return nn.functional.mse_loss(self.net(x + noise), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = TensorDataset(torch.randn(48, 8, generator=torch.Generator().manual_seed(0)), torch.randn(48, 1))

    def fit(max_steps: int, ckpt_path: str | None = None, save: bool = False):
        torch.manual_seed(123)  # the same initial weights in every phase
        model = Model()
        callbacks = [ModelCheckpoint(dirpath=tmp, every_n_train_steps=5, save_top_k=-1)] if save else []
        trainer = L.Trainer(
            strategy=DeterministicSingleDeviceStrategy(device="cuda:0", seed=11),
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=save,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=ckpt_path)
        return digest(model)

    whole = fit(14, save=True)
    saved = sorted(tmp.glob("*step=5*.ckpt"))
    if not saved:
        report(False, "CUDA resume", f"no step-5 checkpoint in {sorted(p.name for p in tmp.iterdir())}")
        return
    checkpoint = torch.load(saved[0], map_location="cpu", weights_only=True)
    states = _cuda_states(checkpoint)
    report(states > 0, "the checkpoint holds CUDA generator states", f"{states} non-empty list(s)")
    resumed = fit(14, ckpt_path=str(saved[0]))
    report(whole == resumed, "fit on cuda resumed mid-epoch (step 5 of 14) = uninterrupted", f"{whole} / {resumed}")


def _cuda_states(tree) -> int:
    """How many non-empty ``"cuda"`` generator-state lists a checkpoint holds, at any depth."""
    if isinstance(tree, dict):
        own = 1 if isinstance(tree.get("cuda"), list) and tree["cuda"] else 0
        return own + sum(_cuda_states(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_cuda_states(value) for value in tree)
    return 0


def check_recompute() -> None:
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from lightning_determinism import get_rng_tracker

    tracker = get_rng_tracker()

    def block(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        with tracker.fork("gpu-check"):
            h = nn.functional.dropout(lin(x), 0.5)
        return nn.functional.dropout(h, 0.3)  # the default CUDA generator, torch's to restore

    def grads(form: str | None) -> torch.Tensor:
        tracker.reset()
        tracker.add("gpu-check", 77)
        torch.manual_seed(0)
        lin = nn.Linear(64, 64).cuda()
        x = torch.randn(32, 64, device="cuda", requires_grad=True)
        out = block(lin, x) if form is None else checkpoint(block, lin, x, use_reentrant=form == "reentrant")
        out.square().sum().backward()
        return torch.cat([lin.weight.grad.flatten(), x.grad.flatten()])

    plain = grads(None)
    for form in ("reentrant", "non_reentrant"):
        report(torch.equal(grads(form), plain), f"activation checkpointing ({form}) keeps the tracker's CUDA stream")
    tracker.reset()


def check_nccl(tmp: Path) -> None:
    import torch
    import torch.distributed as dist

    from lightning_determinism import DistributedPerplexity, perplexity

    if not dist.is_nccl_available():
        report(False, "NCCL", "torch.distributed has no NCCL backend")
        return
    dist.init_process_group("nccl", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    try:
        ints = torch.tensor([2**62 + 1, -3], dtype=torch.int64, device="cuda")
        floats = torch.tensor([1e-300, 0.1], dtype=torch.float64, device="cuda")
        ints_in, floats_in = ints.clone(), floats.clone()
        dist.all_reduce(ints)
        dist.all_reduce(floats)
        report(torch.equal(ints, ints_in) and torch.equal(floats, floats_in), "NCCL all-reduce int64/float64 exact")
        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(4, 33, 1000, generator=generator)
        target = torch.randint(0, 1000, (4, 33), generator=generator)
        synced, local = DistributedPerplexity(), DistributedPerplexity(sync_on_compute=False)
        for metric in (synced, local):
            metric.to("cuda").update(logits.cuda(), target.cuda())
        a, b = synced.compute(), local.compute()
        report(bool(torch.equal(a.cpu(), b.cpu())), "DistributedPerplexity synced over NCCL", f"{a.item()!r}")
        on_cpu = DistributedPerplexity(sync_on_compute=False)  # NCCL carries no CPU tensors
        on_cpu.update(logits, target)
        cpu_value = on_cpu.compute()
        report(
            cpu_value.item() == a.item(),
            "perplexity of the same logits on CPU and on CUDA (V=1000: float64 exponentials)",
            f"cpu {cpu_value.item().hex()} cuda {a.item().hex()}",
        )
        for dtype in (torch.float32, torch.bfloat16):  # V=32,000: the C kernel on CPU, the eager path on CUDA
            big = (torch.randn(256, 32_000, generator=generator) * 3).to(dtype)
            ids = torch.randint(0, 32_000, (256,), generator=generator)
            cpu_big = perplexity(big, ids)
            cuda_big = perplexity(big.cuda(), ids.cuda(), compile=False)
            report(
                cpu_big.item() == cuda_big.item(),
                f"perplexity on CPU (C kernel) and on CUDA (eager), V=32,000, {dtype}",
                f"cpu {cpu_big.item().hex()} cuda {cuda_big.item().hex()}",
            )
    finally:
        dist.destroy_process_group()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--train":
        print(train_once(int(sys.argv[2])))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for check in (check_backends, check_two_runs, check_resume, check_recompute, check_nccl):
            try:
                check(*([Path(tmp)] if check in (check_resume, check_nccl) else []))
            except Exception as error:  # one broken check must not hide the others' results
                report(False, check.__name__, f"{type(error).__name__}: {error}")
    print(f"{len(FAILED)} failed: {', '.join(FAILED)}" if FAILED else "all CUDA checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
