"""The front door: the README is a landing page that starts with the two commands, and every
page the site's navigation names exists (or is generated when the site is built). The strict
site build itself (`make docs`: broken links, anchors and references fail) runs in `.ci/run`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
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


# -- the pages' code blocks are tests (tests/markdown_examples.py, collected by the root conftest.py) --


def test_every_fenced_block_is_run_or_is_a_listing():
    """Each fence names a language the runner knows, and sybil collects exactly the sh, bash and
    python ones: no block of README.md or docs/ escapes the tests unnoticed."""
    from tests.markdown_examples import NOT_RUN, RUNS, collector, fences, page_paths

    sybil = collector()
    pages = page_paths()
    assert any(p.name == "getting-started.md" for p in pages) and any("guide" in p.parts for p in pages)
    for path in pages:
        blocks = fences(path.read_text())
        unknown = [(line, lang) for line, lang in blocks if lang not in RUNS | NOT_RUN]
        assert not unknown, (path.name, unknown)
        assert sybil.should_parse(path), path
        collected = sorted(example.line for example in sybil.parse(path).examples())
        assert collected == [line for line, lang in blocks if lang in RUNS], path.name


def test_the_few_blocks_not_run_say_why_on_the_page():
    from tests.markdown_examples import SKIP, fences, page_paths

    reasons = []
    for path in page_paths():
        text = path.read_text()
        for line in text.splitlines():
            if SKIP in line:
                reason = line.partition(SKIP)[2].strip()
                assert len(reason.split()) >= 3, (path.name, line)
                reasons.append(reason)
        assert len(fences(text)) or SKIP not in text
    assert 1 <= len(reasons) <= 12, reasons


def test_the_quick_starts_run_from_an_empty_folder():
    """The README's page gets nothing: its blocks trace before they read. The guide pages read
    the quick start's trace, made by the README's own command."""
    from tests.markdown_examples import needs_given_store, quick_start_trace

    readme = (ROOT / "README.md").read_text()
    assert not needs_given_store(readme)
    assert quick_start_trace() in readme and "--record qkv" in quick_start_trace()
    assert needs_given_store((ROOT / "docs" / "guide" / "analyze.md").read_text())


def test_shown_output_lines_match_with_written_precision():
    from tests.markdown_examples import line_matches, unmatched_line

    row = "│ h2o       │ 0.2 │ 0.200         │ 0.2144           │ 360 / 360 │"
    assert line_matches("│ h2o │ 0.2 │ 0.200 │ 0.214 │ 360 / 360 │", row)
    assert line_matches("│ h2o │ 0.2 │ 0.20 │ 0.21 │ 360 / 360 │", row)  # fewer decimals, wider tolerance
    assert not line_matches("│ h2o │ 0.2 │ 0.200 │ 0.216 │ 360 / 360 │", row)
    assert not line_matches("│ h2o │ 0.2 │ 0.200 │ 0.214 │ 360 / 361 │", row)  # integers exactly
    assert not line_matches("│ h2o │ 0.2 │", row)  # a shown line is a whole line…
    assert line_matches("│ h2o │ 0.2 │ …", row)  # …unless … says what is left out
    assert line_matches("[('share', '0.…')]", "[('share', '0.150')]")
    assert line_matches(
        "traced 1 sample(s), 64 steps in … → p.zarr", "traced 1 sample(s), 64 steps in 21.7 s (3.0 steps/s) → p.zarr"
    )
    assert not line_matches("traced 1 sample(s), 64 steps", "traced 1 sample(s), 65 steps")
    output = "a 1\nb 2\nc 3"
    assert unmatched_line(["a 1", "c 3"], output) is None  # lines may be left out
    assert unmatched_line(["c 3", "a 1"], output) == "a 1"  # but not reordered
    assert unmatched_line(["b 3"], output) == "b 3"


def test_output_saying_n_a_or_nan_is_found():
    from tests.markdown_examples import missing_values

    assert missing_values("FMM n/a\nok 0.3\nci [nan, nan]\nNaN\n") == ["FMM n/a", "ci [nan, nan]", "NaN"]
    assert missing_values("nanoseconds, banana, a/n/a/b, n/answer, nano.zarr") == []


def _run_page(tmp_path, markdown: str) -> list:
    """Evaluate every block of a page written in the test; (line, outcome) per block."""
    from tests.markdown_examples import Page, collector, page_environment

    page = tmp_path / "page.md"
    page.write_text(markdown)
    folder = tmp_path / "work"
    folder.mkdir()
    document = collector().parse(page)
    document.namespace["_docs_page"] = Page(page, folder, page_environment())
    outcomes = []
    for example in document.examples():
        try:
            example.evaluate()
            outcomes.append("passed")
        except pytest.skip.Exception as exc:
            outcomes.append(f"skipped: {exc.msg}")
        except pytest.fail.Exception as exc:
            outcomes.append(f"failed: {exc.msg.splitlines()[0]}")
    return outcomes


def test_a_page_runs_in_order_in_one_folder_and_its_output_is_checked(tmp_path):
    outcomes = _run_page(
        tmp_path,
        "```sh\nprintf 'value 0.302\\n' > v.txt\ncat v.txt\n#> value 0.30\n```\n\n"  # the next block sees v.txt
        "```sh\ncat v.txt\n#> value 0.300\n```\n\n"  # 0.302 is not 0.300 written to 3 decimals
        "```sh\necho 'FMM n/a'\n```\n\n"
        "```sh\n# n/a because the trace has no event step\necho 'FMM n/a'\n```\n\n"
        "```sh\nexit 3\n```\n\n"
        "```sh\nexit 3   # not run in the tests: it would fail\necho ok\n#> ok\n```\n\n"
        "```sh\n# not run in the tests: needs a browser\nexit 3\n```\n\n"
        "```python\n# helper.py\nVALUE = 6\n```\n\n"  # a file block is written, not run
        "```python\nfrom helper import VALUE\nprint(VALUE * 7)\n#> 42\nx = VALUE\n```\n\n"
        "```python\nprint(x + 1)\n#> 8\n```\n\n",  # one namespace per page
    )
    assert outcomes[0] == "passed" and outcomes[1].startswith("failed: page.md:8: cat v.txt: the page shows")
    assert outcomes[2].startswith("failed: page.md:13: echo 'FMM n/a' prints n/a or nan") and outcomes[3] == "passed"
    assert outcomes[4].startswith("failed: page.md:22: exit 3") and outcomes[5] == "passed"
    assert outcomes[6] == "skipped: needs a browser"
    assert outcomes[7:] == ["passed", "passed", "failed: page.md:49: print(x + 1): the page shows"]


def test_dims_named_beside_a_value_are_checked(tmp_path):
    outcomes = _run_page(
        tmp_path,
        "```python\nimport pandas as pd\nimport xarray as xr\n"
        "a = xr.DataArray([[1.0]], dims=('policy', 'budget'))   # [policy, budget]\n"
        "a.to_pandas()                                           # [policy, budget]\n"
        "a.sel(policy=0)                                         # [budget]\n```\n\n"
        "```python\nxr.DataArray([[[1.0]]], dims=('policy', 'allocation', 'budget')).sel(policy=0)   # [policy, budget]\n```\n",
    )
    assert outcomes[0] == "passed"
    assert outcomes[1].startswith("failed: page.md:10: xr.DataArray([[[1.0]]]")
    assert outcomes[1].endswith(
        "the page says [policy, budget], the value has dims ('allocation', 'budget') (DataArray)"
    )


def test_sessions_and_console_blocks_print_what_they_show(tmp_path):
    outcomes = _run_page(
        tmp_path,
        "```pycon\n>>> x = 6\n>>> x * 7\n42\n```\n\n"
        "```pycon\n>>> x + 1\n8\n```\n\n"  # the page's namespace, and a wrong output
        "```pycon\n>>> float('nan')   # nan: there is no value\nnan\n```\n\n"
        "```console\n$ echo hello\nhello\n$ echo 'kvscope: error: no store' >&2; exit 2\nkvscope: error: no store\n```\n\n"
        "```console\n$ exit 2\n```\n",  # a refusal the page does not show
    )
    assert outcomes[0] == "passed" and outcomes[1].startswith("failed: page.md:8: a session prints other than")
    assert outcomes[2:4] == ["passed", "passed"] and outcomes[4].startswith("failed: page.md:25: $ exit 2")


LAYOUT_ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[\w.]+/|[\w.]+\.py)(?: {2,}(?P<role>\S.*))?$")


def layout_modules() -> dict[str, str]:
    """``{path: role}`` of the module tree in docs/development.md#layout (the ``text`` block that
    starts with ``kvscope/``): two spaces of indent a level, a module's role after two spaces or
    more on its line, a package's on its own line or left out."""
    text = (ROOT / "docs" / "development.md").read_text()
    layout = text[text.index("## Layout") :]
    block = next(b for b in re.findall(r"```text\n(.*?)```", layout, re.DOTALL) if b.startswith("kvscope/"))
    out, parents = {}, []
    for line in block.splitlines():
        match = LAYOUT_ENTRY.match(line)
        if match is None:
            continue  # a role that goes on over a second line
        depth = len(match["indent"]) // 2
        parents[depth:] = [match["name"].rstrip("/")]
        if match["name"].endswith(".py"):
            out["/".join(parents)] = (match["role"] or "").strip()
    return out


def test_the_layout_names_every_module_of_kvscope_with_its_role():
    """docs/development.md's layout is the map of the package: every module, and nothing else."""
    named = layout_modules()
    modules = {
        str(path.relative_to(ROOT)) for path in (ROOT / "kvscope").rglob("*.py") if path.name != "__init__.py"
    }
    assert sorted(modules - named.keys()) == [], "modules the layout does not name"
    assert sorted(named.keys() - modules) == [], "the layout names modules that do not exist"
    assert [path for path, role in named.items() if len(role) < 10] == [], "modules without a role"


def test_a_served_command_prints_and_exits_as_the_console_script(tmp_path):
    """tests/forkserver.py: a command forked from the worker's fork server gives the console
    script's stdout, stderr and exit status — a result, a refusal (exit 2), argparse's own exit, a
    module found on PYTHONPATH, and output written after a pipe closes."""
    from tests import forkserver

    (tmp_path / "mypolicy.py").write_text("")
    env = {**os.environ, "PYTHONPATH": ".", "COLUMNS": "120", "NO_COLOR": "1"}
    commands = [
        "kvscope --version",
        "kvscope info nowhere.zarr",
        "kvscope frobnicate",
        "kvscope replay nowhere.zarr --policies press:mypolicy.Missing --budgets 0.3",
        "kvscope workloads | head -n 2",
        "echo 'not json' | kvscope info -",
    ]
    programs = (str(Path(sys.executable).parent / "kvscope"), str(forkserver.client()))
    for command in commands:
        script, served = (
            subprocess.run(["bash", "-c", command.replace("kvscope", program, 1)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=False)
            for program in programs
        )  # fmt: skip
        assert (served.returncode, served.stdout, served.stderr) == (script.returncode, script.stdout, script.stderr)
