"""Every ```python block of README.md and docs/*.md runs, so that the snippets cannot rot.

The convention (CONTRIBUTING.md, "Snippets in the docs"): a block runs in a fresh namespace, in a temporary
directory, unless HTML comments on the lines just above its fence say otherwise (a blank line may separate them):

- ``<!-- skip: reason -->``: not run; the reason is required.
- ``<!-- continues -->``: runs in the namespace the previous block of the same file left.
- ``<!-- setup: code -->``: one line of Python run first, in the block's namespace: what a fragment takes as given.
- ``<!-- check: code -->``: one line of Python run after the block, e.g. ``fit_lm(LM)`` to train a module the block
  only defines; the helpers below (:data:`HELPERS`) are available to it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_determinism.seeding.rng import capture_rng_state, get_rng_tracker, restore_rng_state

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARKER = re.compile(r"^<!--\s*(skip|continues|setup|check)\s*(?::\s*(.*?))?\s*-->$")
_FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass
class Snippet:
    """One ```python block and the markers above it."""

    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None = None
    continues: bool = False
    setup: list[str] = field(default_factory=list)
    check: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"


def _markers(lines: list[str], fence: int) -> list[tuple[str, str]]:
    """The markers on the comment lines just above line index ``fence`` (blank lines between them are allowed)."""
    found = []
    i = fence - 1
    while i >= 0 and (not lines[i].strip() or _MARKER.match(lines[i].strip())):
        match = _MARKER.match(lines[i].strip())
        if match:
            found.append((match.group(1), match.group(2) or ""))
        i -= 1
    return found[::-1]


def extract(page: Path) -> list[Snippet]:
    """The ```python blocks of one Markdown page, with their markers.

    Raises:
        ValueError: for a ``skip`` without a reason or a ``setup``/``check`` without code, naming the line.
    """
    lines = page.read_text().splitlines()
    snippets, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if opening.group(1) == "python":
            snippet = Snippet(page, i + 1, "\n".join(lines[i + 1 : end]) + "\n")
            for kind, text in _markers(lines, i):
                if kind != "continues" and not text:
                    raise ValueError(f"{snippet.id}: `<!-- {kind}: ... -->` needs a reason or code after the colon")
                if kind == "skip":
                    snippet.skip = text
                elif kind == "continues":
                    snippet.continues = True
                else:
                    getattr(snippet, kind).append(text)
            snippets.append(snippet)
        i = end + 1
    return snippets


def fit_lm(module_class: type, vocab: int = 11) -> Any:
    """Train (2 steps) and validate a docs' ``LM`` that calls ``self(batch["input_ids"])``: only its own steps.

    The page's class leaves out the model and the optimizer; a subclass adds an embedding as the model and SGD.
    """
    import lightning as L
    from torch.utils.data import DataLoader

    class Tiny(module_class):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(vocab, vocab)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.embedding(input_ids)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (8, 6), generator=generator)
    labels = torch.randint(vocab, (8, 6), generator=generator)
    labels[0, :2] = -100  # padding, as the pages' ignore_index expects
    batches = [{"input_ids": ids[i : i + 4], "labels": labels[i : i + 4]} for i in (0, 4)]
    loader = DataLoader(batches, batch_size=None)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    model = Tiny()
    if "training_step" in vars(module_class):
        trainer.fit(model, loader, loader)
    else:
        trainer.validate(model, loader, verbose=False)
    return trainer.callback_metrics


HELPERS = {"fit_lm": fit_lm}
"""Names the ``check`` code of a marker can use besides the block's own."""

SNIPPETS = [snippet for page in PAGES for snippet in extract(page)]


@pytest.fixture
def _isolated(tmp_path, monkeypatch):
    """A temporary working directory; the environment, RNG streams and tracker as they were (conftest does flags)."""
    monkeypatch.chdir(tmp_path)
    environ, rng, tracker = dict(os.environ), capture_rng_state(), get_rng_tracker().get_states()
    yield
    os.environ.clear()
    os.environ.update(environ)
    restore_rng_state(rng)
    get_rng_tracker().set_states(tracker)


_namespaces: dict[Path, dict[str, Any]] = {}


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
@pytest.mark.usefixtures("_isolated")
def test_snippet_runs(snippet: Snippet):
    if snippet.skip:
        pytest.skip(snippet.skip)
    if snippet.continues:
        if snippet.page not in _namespaces:
            pytest.fail(f"{snippet.id} continues a block that did not run (run the whole page)")
        namespace = _namespaces[snippet.page]
    else:
        namespace = {"__name__": "__snippet__"}
    _namespaces.pop(snippet.page, None)  # a failure must not leave a half-run namespace to the next block
    for code in snippet.setup:
        exec(compile(code, f"{snippet.id} (setup)", "exec"), namespace)
    exec(compile(snippet.code, snippet.id, "exec"), namespace)
    for code in snippet.check:
        exec(compile(code, f"{snippet.id} (check)", "exec"), {**HELPERS, **namespace})
    _namespaces[snippet.page] = namespace


def test_markers_are_read_and_a_skip_needs_a_reason(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- setup: x = 1 -->\n\n```python\ny = x + 1\n```\n"
        "<!-- continues -->\n<!-- check: assert z == 3 -->\n```python\nz = y + 1\n```\n"
        "```bash\nls\n```\n<!-- skip: needs 2 GPUs -->\n```python\nraise SystemExit\n```\n"
    )
    first, second, third = extract(page)
    assert (first.setup, first.code, first.continues) == (["x = 1"], "y = x + 1\n", False)
    assert (second.continues, second.check, second.skip) == (True, ["assert z == 3"], None)
    assert third.skip == "needs 2 GPUs"
    page.write_text("<!-- skip -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match=r"page.md:2: `<!-- skip: ... -->` needs a reason"):
        extract(page)
