"""The probe's module and tensor hooks: what every module call saw, drew, produced and got back in the backward pass.

:class:`ModuleHooks` puts a forward pre-hook and a forward hook on each chosen module, a gradient hook on each output
of a call and on each parameter, and logs the torch functions each call ran (a ``TorchFunctionMode`` during the
forward). Hooks are installed only while steps are recorded and removed afterwards: a model without them costs
nothing. Between micro-batches (no event list to write to) the hooks return at once.

This module is a leaf: it knows torch, not Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_determinism.divergence.diagnosis.digest import digest, norm, rng_digests, tensors_in

_MAX_OPS = 16


def _key(path: str, call: int) -> str:
    return f"{path}#{call}"


def resolve_modules(root: nn.Module, modules: Sequence[str] | None) -> dict[str, nn.Module]:
    """The modules to hook by path (``named_modules()`` names); ``None``: every submodule, not the root itself.

    The root (``""``) is hooked only when named: under Lightning's DDP its ``forward`` is ``training_step`` (Lightning
    redirects the call), on one device it is not, and code outside the submodules should read the same on both.

    Raises:
        ValueError: naming the paths that are not modules of ``root``.

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
        >>> sorted(resolve_modules(net, None)), sorted(resolve_modules(net, ["", "1"]))
        (['0', '1'], ['', '1'])
    """
    named = dict(root.named_modules())
    if modules is None:
        return {path: module for path, module in named.items() if path}
    unknown = [m for m in modules if m not in named]
    if unknown:
        known = sorted(named)[:12]
        raise ValueError(f"`modules` must name modules of the model ({known} ...), got unknown {unknown}")
    return {m: named[m] for m in modules}


class _OpLog(TorchFunctionMode):
    """Logs the names of the torch functions the innermost module call runs (not the probe's own)."""

    def __init__(self, hooks: ModuleHooks) -> None:
        super().__init__()
        self.hooks = hooks

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        hooks = self.hooks
        if not hooks.busy and hooks.stack:
            name = getattr(func, "__name__", "")
            ops = hooks.ops.get(hooks.stack[-1])
            if ops is not None and name and not name.startswith("_") and name not in ops and len(ops) < _MAX_OPS:
                ops.append(name)
        return func(*args, **(kwargs or {}))


class ModuleHooks:
    """Hooks on a model's modules and parameters that append the probe's events to the current micro-batch.

    Args:
        root: the model (the ``LightningModule``, unwrapped).
        modules: the paths to hook (``None``: every submodule; the root ``""`` only when named).
        record_ops: log the torch functions each module call runs.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> net = nn.Sequential(nn.Linear(3, 2), nn.Tanh())
        >>> hooks = ModuleHooks(net, None)
        >>> hooks.install()
        >>> events = []
        >>> hooks.begin(events)
        >>> net(torch.randn(4, 3)).sum().backward()
        >>> hooks.end()
        >>> hooks.remove()
        >>> [(e["kind"], e.get("module", e.get("param"))) for e in events][:4]
        [('enter', '0'), ('exit', '0'), ('enter', '1'), ('exit', '1')]
    """

    def __init__(self, root: nn.Module, modules: Sequence[str] | None, record_ops: bool = True) -> None:
        self.root = root
        self.modules = resolve_modules(root, modules)
        self.record_ops = record_ops
        self.parameters = {name: p for name, p in root.named_parameters() if p.requires_grad}
        self.handles: list[Any] = []
        self.events: list[dict[str, Any]] | None = None
        self.scale = 1.0
        self.busy = False
        self.stack: list[str] = []
        self.ops: dict[str, list[str]] = {}
        self._calls: dict[str, int] = {}
        self._outputs: dict[int, tuple[torch.Tensor, str]] = {}
        self._mode: _OpLog | None = None

    @property
    def installed(self) -> bool:
        """Whether the hooks are on the model."""
        return bool(self.handles)

    def install(self) -> None:
        """Put the hooks on the modules and parameters (once)."""
        if self.handles:
            return
        for path, module in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(partial(self._enter, path), with_kwargs=True))
            self.handles.append(module.register_forward_hook(partial(self._exit, path), with_kwargs=True))
        for name, p in self.parameters.items():
            self.handles.append(p.register_hook(partial(self._param_grad, name)))

    def remove(self) -> None:
        """Take every hook off: the model runs as if never probed."""
        self.end()
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def begin(self, events: list[dict[str, Any]]) -> None:
        """Start a micro-batch: its events go to ``events``."""
        self.end()
        self.events, self.scale = events, 1.0
        if self.record_ops:
            self._mode = _OpLog(self)
            self._mode.__enter__()

    def end_forward(self) -> None:
        """The forward pass is over: stop logging functions."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def end(self) -> None:
        """End the micro-batch: forget its calls and outputs."""
        self.end_forward()
        self.events = None
        self.stack, self.ops, self._calls, self._outputs = [], {}, {}, {}

    def _enter(self, path: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.events is None or self.busy:
            return
        self.busy = True
        try:
            call = self._calls.get(path, 0)
            self._calls[path] = call + 1
            # Tensors only: plain arguments such as Lightning's `batch_idx` depend on how a step is split.
            inputs = tensors_in((args, kwargs))
            producers = [self._outputs[id(t)][1] for t in inputs if id(t) in self._outputs]
            self.events.append(
                {
                    "kind": "enter",
                    "module": path,
                    "call": call,
                    "input": digest(inputs),
                    "rng": rng_digests(),
                    "from": sorted(set(producers)),
                    "parent": self.stack[-1] if self.stack else None,
                }
            )
            key = _key(path, call)
            self.stack.append(key)
            self.ops[key] = []
        finally:
            self.busy = False

    def _exit(self, path: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.events is None or self.busy:
            return
        self.busy = True
        try:
            # The innermost open call of this module (a module may call itself).
            key = next((k for k in reversed(self.stack) if k.rpartition("#")[0] == path), _key(path, 0))
            if key in self.stack:
                self.stack.remove(key)
            call = int(key.rpartition("#")[2])
            self.events.append(
                {
                    "kind": "exit",
                    "module": path,
                    "call": call,
                    "output": digest(output),
                    "norm": norm(output),
                    "rng": rng_digests(),
                    "ops": self.ops.get(key, []),
                }
            )
            for index, tensor in enumerate(tensors_in(output)):
                self._outputs[id(tensor)] = (tensor, key)  # the tensor is kept: its id cannot be reused meanwhile
                if tensor.requires_grad:
                    tensor.register_hook(partial(self._grad, path, call, index))
        finally:
            self.busy = False

    def _scaled(self, grad: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return grad if self.scale == 1.0 else grad * self.scale

    def _grad(self, path: str, call: int, index: int, grad: torch.Tensor) -> None:
        if self.events is None:
            return
        grad = self._scaled(grad)
        self.events.append(
            {"kind": "grad", "module": path, "call": call, "index": index, "output": digest(grad), "norm": norm(grad)}
        )

    def _param_grad(self, name: str, grad: torch.Tensor) -> None:
        if self.events is None:
            return
        grad = self._scaled(grad)
        self.events.append({"kind": "param_grad", "param": name, "output": digest(grad), "norm": norm(grad)})


__all__ = ["ModuleHooks", "resolve_modules"]
