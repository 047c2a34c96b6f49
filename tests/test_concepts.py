"""docs/concepts.md states only numbers kvscope computes: its Python sessions and command lines run
with every page's blocks (tests/markdown_examples.py: doctest, one namespace, in page order) on the
toy trace of ``kvscope.storage.synthetic``; here: the toy's table is that trace, every number of
three or more decimals in its prose is one a session printed, the agreed anchors exist. And the
documentation points nowhere outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvscope.storage.synthetic import TOY_PREFILL_COLSUM, TOY_ROWS, toy_trace

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "concepts.md"
SESSION = re.compile(r"```pycon\n(.*?)```", re.DOTALL)
ANCHORS = {  # page → the ids other pages and docstrings link to
    "concepts.md": [
        "steps-and-rows", "trace-unit", "sinks", "windows", "event-step", "tiers", "history-oracle", "analyses",
        "fmm", "tier-resolved-mass", "churn", "lir", "peaks", "coverage", "concentration", "drift", "observe",
        "budget", "geometry", "allocation", "quantizer", "policies", "logquant", "qevict", "output-error",
        "forced-replay", "live-metrics", "presses", "bad-input",
    ],
    "trace-format.md": ["capture", "arrays"],
    "getting-started.md": ["models"],
}  # fmt: skip


def test_the_toy_table_is_the_toy_trace():
    rows = re.findall(r"^\| (\d) \| (\d+) \| (.+) \|$", PAGE.read_text(), re.MULTILINE)
    assert len(rows) == len(TOY_ROWS)
    ds = toy_trace()
    for (step, query, cells), row in zip(rows, TOY_ROWS, strict=True):
        shown = {int(p): float(v) for p, v in (cell.split(": ") for cell in cells.split(", "))}
        assert shown == row and int(query) == int(ds.query_pos.values[0, int(step)])
        stored = ds.attn.values[0, int(step), 0, 0]
        assert np.flatnonzero(np.nan_to_num(stored)).tolist() == sorted(row)
    colsums = re.search(r"are\s+`([\d., ]+)` for positions 0–9", PAGE.read_text()).group(1)
    assert tuple(float(x) for x in colsums.split(", ")) == TOY_PREFILL_COLSUM


def test_every_precise_number_in_the_prose_is_one_a_session_printed():
    text = PAGE.read_text()
    printed = " ".join(
        line for block in SESSION.findall(text) for line in block.splitlines() if not line.startswith((">>>", "..."))
    )
    prose = SESSION.sub("", text)
    numbers = set(re.findall(r"(?<![\d.])\d+\.\d{3,}", prose))
    assert numbers, "the prose states worked numbers"
    missing = sorted(n for n in numbers if n not in printed)
    assert not missing, f"numbers in the prose that no session prints: {missing}"


@pytest.mark.parametrize("page", sorted(ANCHORS))
def test_the_agreed_anchors_exist(page):
    ids = set(re.findall(r"\{#([\w-]+)\}", (ROOT / "docs" / page).read_text()))
    assert set(ANCHORS[page]) <= ids, sorted(set(ANCHORS[page]) - ids)


def _documentation():
    yield ROOT / "README.md"
    for path in sorted((ROOT / "docs").rglob("*")):
        if path.is_file() and path.suffix in (".md", ".py", ".yml", ".yaml", ".html", ".css", ".js"):
            yield path


LINK = re.compile(r"\]\(([^)\s]+)[^)]*\)|(?:href|src)=\"([^\"]+)\"")


def test_the_documentation_points_nowhere_outside_the_repository():
    """No page names the specification the project was built from, and no relative link or
    image leaves the repository (the site is built from it alone)."""
    for path in _documentation():
        text = path.read_text()
        assert "SPEC" not in text, (path.relative_to(ROOT), "mentions SPEC: link the concepts page instead")
        assert "shared/" not in text, (path.relative_to(ROOT), "points at a folder beside the repository")
        for match in LINK.finditer(text):
            target = (match.group(1) or match.group(2)).split("#")[0]
            if not target or re.match(r"^[a-z]+:", target):
                continue  # an anchor on the page, or a URL
            resolved = (path.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), (path.relative_to(ROOT), target)
