"""Every python block of the README and of the docs (docs/*.md) runs as written.

A block runs on its own: a fresh namespace, dynamo reset, on the CPU, offline. A block that
cannot (a fragment, or one that needs a GPU or several processes) says so on the line before
its fence, with the reason, in a comment that neither GitHub nor the site shows:

    <!-- not run: a fragment of the owner's forward -->
    ```python
"""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE_LINE = re.compile(r"^(```|~~~)", re.M)
BLOCK = re.compile(r"^(?P<fence>```|~~~)(?P<lang>[^\s`]*)[^\n]*\n(?P<code>.*?)^(?P=fence)[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not run:(?P<why>[^>]*)-->\s*\Z")
MARKER = re.compile(r"<!--\s*not run:")
PYTHON = {"python", "py", "python3"}
# the blocks run today; a change that finds fewer (a parsing slip, a page dropped) fails
MIN_RUN = 13


def _blocks():
    """(page, line, code, why) for every python block; `why` is None for a block that runs."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            if m.group("lang").lower() not in PYTHON:
                continue
            marker = NOT_RUN.search(text, 0, m.start())
            why = marker.group("why").strip() if marker else None
            line = text.count("\n", 0, m.start()) + 1
            found.append((page.relative_to(ROOT).as_posix(), line, m.group("code"), why))
    return found


BLOCKS = _blocks()
RUN = [b for b in BLOCKS if b[3] is None]


def test_the_pages_have_blocks_to_run():
    assert len(RUN) >= MIN_RUN, f"{len(RUN)} python blocks run, expected at least {MIN_RUN}"
    assert any(page == "README.md" for page, *_ in RUN)
    assert all(why for *_, why in BLOCKS if why is not None), "a `not run:` comment gives its reason"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_fences_are_closed_and_markers_sit_on_python_blocks(page):
    text = page.read_text(encoding="utf-8")
    assert len(FENCE_LINE.findall(text)) % 2 == 0, f"{page.name}: a code fence is not closed"
    marked = {m.start() for m in BLOCK.finditer(text) if NOT_RUN.search(text, 0, m.start())
              and m.group("lang").lower() in PYTHON}
    for m in MARKER.finditer(text):
        nxt = BLOCK.search(text, m.end())
        assert nxt is not None and nxt.start() in marked, (
            f"{page.name}, line {text.count(chr(10), 0, m.start()) + 1}: a `not run:` comment "
            "must stand right before the python block it is about")


@pytest.mark.parametrize("page,line,code,why", RUN, ids=[f"{p}:{line}" for p, line, *_ in RUN])
def test_python_block_runs(page, line, code, why):
    torch._dynamo.reset()
    # blank lines up to the block's first line, so a traceback names the page's own line
    source = "\n" * line + code
    exec(compile(source, page, "exec"), {"__name__": "__docs__"})
