"""Activation checkpointing keeps the package's streams: every checkpointing form gives the gradients of the model
without it, bitwise, with dropout drawn from the tracker's forks (nested, several streams, a checkpointed block inside
a fork) and noise from a named generator; torch alone does not (the reference that shows the test can fail)."""

import functools

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import lightning_determinism.seeding.generators as generators_module
from lightning_determinism._compat import checkpointing
from lightning_determinism.seeding import recompute
from lightning_determinism.seeding.generators import generator
from lightning_determinism.seeding.rng import DEFAULT_STREAM, get_rng_tracker
from lightning_determinism.seeding.seeds import derive_seed

OUTER = "outer"  # a second stream, forked around the whole model in the "inside a fork" runs


@pytest.fixture(autouse=True)
def _clean_streams(monkeypatch):
    tracker = get_rng_tracker()
    saved, gens = tracker.get_states(), dict(generators_module._GENERATORS)
    tracker.reset()
    generators_module._GENERATORS.clear()
    monkeypatch.setenv("LDET_BASE_SEED", "11")
    yield
    tracker.set_states(saved)
    generators_module._GENERATORS.clear()
    generators_module._GENERATORS.update(gens)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        tracker = get_rng_tracker()
        h = self.up(x)
        with tracker.fork():  # the tensor-parallel pattern: the shard's dropout from the tracker
            h = nn.functional.dropout(h, 0.5)
            with tracker.fork():  # nested fork of the active stream: a no-op
                h = nn.functional.dropout(h, 0.2)
            with tracker.fork(OUTER):  # another stream inside
                h = h * torch.rand_like(h)
        h = h + 0.1 * torch.randn(h.shape, generator=generator("noise"))
        with tracker.fork(OUTER):  # the outer stream's own fork: nested when the block runs inside one
            h = nn.functional.dropout(h, 0.1)
        return nn.functional.dropout(self.down(h), 0.3)  # the default stream, torch's to restore


class Net(nn.Module):
    def __init__(self, form: str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.form = form
        if form == "wrapper":
            self.blocks = nn.ModuleList([checkpoint_wrapper(b) for b in self.blocks])
        elif form == "wrapper_reentrant":
            self.blocks = nn.ModuleList(
                [checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.REENTRANT) for b in self.blocks]
            )
        elif form == "apply":
            apply_activation_checkpointing(self, check_fn=lambda m: isinstance(m, Block))
        elif form == "composable":
            for block in self.blocks:
                composable_checkpoint(block)

    def forward(self, x):
        for block in self.blocks:
            if self.form == "reentrant":
                x = checkpoint(block, x, use_reentrant=True)
            elif self.form == "non_reentrant":
                x = checkpoint(block, x, use_reentrant=False)
            elif self.form == "selective":  # matmuls saved, the rest (dropout included) recomputed
                policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
                x = checkpoint(block, x, use_reentrant=False, context_fn=policy)
            else:
                x = block(x)
        return x


FORMS = ["reentrant", "non_reentrant", "wrapper", "wrapper_reentrant", "apply", "selective", "composable"]


def fresh_streams():
    """The tracker's two streams at their start, no named generator yet; returns the tracker."""
    tracker = get_rng_tracker()
    tracker.reset()
    generators_module._GENERATORS.clear()
    tracker.add(DEFAULT_STREAM, 1234)
    tracker.add(OUTER, 99)
    return tracker


def train(form, inside_fork=False, steps=2):
    """Two steps from fixed seeds; the gradients of every step, the streams' states after the last."""
    tracker = fresh_streams()
    torch.manual_seed(0)
    net = Net(form)
    torch.manual_seed(5)  # the default stream of the run
    grads = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step), requires_grad=True)
        if inside_fork:
            with tracker.fork(OUTER):
                loss = net(x).square().sum()
        else:
            loss = net(x).square().sum()
        loss.backward()
        grads.append({name.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for name, p in
                      net.named_parameters()})  # fmt: skip
        net.zero_grad()
    streams = {name: state["cpu"] for name, state in tracker.get_states().items()}
    return grads, streams, generator("noise").get_state(), torch.get_rng_state()


def assert_same(got, want):
    g_grads, g_streams, g_noise, g_default = got
    w_grads, w_streams, w_noise, w_default = want
    assert len(g_grads) == len(w_grads)
    for g, w in zip(g_grads, w_grads, strict=True):
        assert g.keys() == w.keys()
        for name in w:
            assert torch.equal(g[name], w[name]), name
    for name in w_streams:  # the recomputation put every stream back where the forward left it
        assert torch.equal(g_streams[name], w_streams[name]), name
    assert torch.equal(g_noise, w_noise)
    assert torch.equal(g_default, w_default)


@pytest.mark.parametrize("inside_fork", [False, True], ids=["plain", "inside-a-fork"])
@pytest.mark.parametrize("form", FORMS)
def test_every_checkpointing_form_gives_the_gradients_without_it(form, inside_fork):
    assert_same(train(form, inside_fork), train(None, inside_fork))


@pytest.mark.parametrize("form", ["reentrant", "non_reentrant", "wrapper"])
def test_without_the_replay_the_recomputed_masks_differ(form):
    reference = train(None)
    checkpointing.uninstall()
    try:
        grads = train(form)[0]
    finally:
        checkpointing.install(recompute.snapshot)
    assert checkpointing.installed()
    assert any(not torch.equal(grads[0][name], reference[0][0][name]) for name in grads[0])


def _masked():
    """A function whose mask comes from the tracker's default stream, and the list of every mask it drew."""
    tracker = get_rng_tracker()
    tracker.add(DEFAULT_STREAM, 7)
    drawn = []

    def masked(x):
        with tracker.fork():
            drawn.append(torch.rand(4))
        return x * drawn[-1]

    return masked, drawn


def test_preserve_rng_state_false_replays_nothing_as_torch_replays_nothing():
    masked, drawn = _masked()
    x = torch.ones(4, requires_grad=True)
    checkpoint(masked, x, use_reentrant=False, preserve_rng_state=False).sum().backward()
    assert not torch.equal(drawn[0], drawn[1])  # the recomputation went on with the stream
    checkpoint(masked, x, use_reentrant=False).sum().backward()
    assert torch.equal(drawn[2], drawn[3])


def test_a_second_backward_through_a_retained_graph_replays_again():
    masked, drawn = _masked()
    x = torch.ones(4, requires_grad=True)
    y = checkpoint(masked, x, use_reentrant=False).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert torch.equal(drawn[0], drawn[1]) and torch.equal(drawn[0], drawn[2])
    assert torch.equal(x.grad, 2 * drawn[0])


def test_a_stream_first_forked_inside_the_block_replays_from_its_seed():
    drawn = []

    def masked(x):  # the default stream is made by this first fork, outside model parallelism
        with get_rng_tracker().fork():
            drawn.append(torch.rand(4))
        return x * drawn[-1]

    x = torch.ones(4, requires_grad=True)
    checkpoint(masked, x, use_reentrant=True).sum().backward()
    assert torch.equal(drawn[0], drawn[1])
    with get_rng_tracker().fork():  # and the stream goes on from where the forward left it
        after = torch.rand(4)
    seed = derive_seed(11, "tracker", DEFAULT_STREAM, 0)
    assert torch.equal(after, torch.rand(8, generator=torch.Generator().manual_seed(seed))[4:])


def test_fork_outside_model_parallelism_draws_this_ranks_own_stream_from_the_base_seed():
    tracker = get_rng_tracker()
    with tracker.fork():
        inside = torch.rand(3)
    seed = derive_seed(11, "tracker", DEFAULT_STREAM, 0)  # LDET_BASE_SEED=11, rank 0
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(seed)))
    assert tracker.seeds == {DEFAULT_STREAM: seed}


def test_fork_outside_model_parallelism_without_a_base_seed_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("LDET_BASE_SEED")
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    with pytest.raises(RuntimeError, match="'model-parallel-rng' is not tracked.*or seed the run"):
        with get_rng_tracker().fork():
            pass
    with pytest.raises(RuntimeError, match="'other' is not tracked"):  # a named stream is never made up
        with get_rng_tracker().fork("other"):
            pass


def test_a_compiled_checkpointed_block_gives_the_eager_gradients():
    # the recipe's order: activation checkpointing inside, torch.compile around it; the fork's Python-side state
    # switch is a graph break, so the checkpointed call runs (and is recomputed) with the replay
    def net(form):
        torch.manual_seed(0)
        model = Net(form)
        model.blocks = nn.ModuleList([torch.compile(block) for block in model.blocks]) if form else model.blocks
        return model

    compiled, eager = net("wrapper"), net(None)

    def grads(model):
        fresh_streams()
        torch.manual_seed(5)
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step), requires_grad=True)
            model(x).square().sum().backward()
        return {name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): p.grad
                for name, p in model.named_parameters()}  # fmt: skip

    want, got = grads(eager), grads(compiled)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
