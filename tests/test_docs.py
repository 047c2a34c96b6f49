"""The front door: the README is a landing page that starts with the two commands, and every
page the site's navigation names exists (or is generated when the site is built). The strict
site build itself (`make docs`: broken links, anchors and references fail) runs in `.ci/run`."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"benchmarks.md", "notebooks/explore_attention_drift.ipynb", "notebooks/compare_policies.ipynb"}


def test_readme_is_a_landing_page_that_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    commands = [line.split("#")[0].strip() for line in lines[3:5]]
    assert lines[:3] == ["# kvscope", "", "```sh"] and commands == ["make demo", "make test"]
    assert not any(re.search(r"\b20\d\d-\d\d-\d\d\b", line) for line in lines), "dated figures belong in the records"


def _nav_pages(entries):
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        yield from _nav_pages(value) if isinstance(value, list) else [value]


def test_every_page_of_the_navigation_exists_or_is_generated():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # the !!python tag unread
    pages = list(_nav_pages(config["nav"]))
    assert set(GENERATED) <= set(pages)
    missing = [p for p in pages if p not in GENERATED and not (ROOT / "docs" / p).is_file()]
    assert not missing
    notebooks = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert notebooks <= set(pages)


def test_the_docs_describe_the_software_not_who_ran_it():
    words = re.compile(r"\b(other|another) agents?\b|\blent\b|\ballowances?\b", re.IGNORECASE)
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        hits = [line for line in path.read_text().splitlines() if words.search(line)]
        assert not hits, (path.name, hits[:2])
