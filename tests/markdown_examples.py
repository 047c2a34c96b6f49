"""The documentation's code blocks are tests: sybil collects every fenced block of README.md and
docs/**/*.md (the root conftest.py), and the evaluators here run them as a reader would.

- ``sh`` / ``bash``: each command runs in ``bash``, in one working folder per page, so a page's
  blocks run in order (trace first, then the commands that read the store). A command must exit 0.
  ``kvscope`` on the page's PATH runs the installed package's ``kvscope.cli.main`` in a process of
  its own, forked from the worker's fork server, which has imported torch, transformers and the
  rest once (tests/forkserver.py; ``KVSCOPE_TEST_FORKSERVER=0``: the console script itself).
- ``python``: the statements run in one namespace per page, with that folder as working
  directory. A block whose first line is a file name comment (``# mypress.py``) is that file:
  it is written into the folder, not run.
- ``pycon``: a Python session (``>>>`` and what it prints, doctest's rules with whitespace
  normalized and ``...`` for elided text), in the page's namespace and folder.
- ``console``: ``$ command`` lines, each followed by what it prints; a command shown printing a
  ``kvscope: error: …`` line must exit 2, any other must exit 0.
- ``text``: diagrams and listings; nothing runs.

What a block shows is checked:

- ``#>`` lines after a command or statement are what it prints: each one is a line of its output,
  in order (lines may be left out); ``...`` (or ``…``) within a line stands for any text; a number
  written with d decimals matches within 10^-d, one written without decimals exactly.
- ``# [a, b, c]`` after a Python expression (or a one-name assignment) names the dims of its
  value (an xarray object; for a pandas table, its index and column names).
- A block whose output says ``n/a`` or ``nan`` fails, unless the block says why right there: a
  comment that names it (``# nan because …``, ``# NaN beyond the query``).

A block that cannot run headless says so visibly, in a comment ``# not run in the tests: REASON``:
on a line of its own it covers the whole block; after a command or statement, that one.

A page that reads ``prose.zarr`` without tracing it gets the store the README's quick start
traces (its ``kvscope trace … --out prose.zarr`` command, run once per test run); the quick
start's own block gets that run too: the store, and what the command printed, checked as its
``#>`` lines say."""

from __future__ import annotations

import ast
import contextlib
import doctest
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sybil import Example, Sybil
from sybil.evaluators.doctest import DocTest, OutputChecker
from sybil.parsers.markdown import CodeBlockParser

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/*.md", "docs/*/*.md", "docs/*/*/*.md"]
RUNS = {"sh", "bash", "python", "pycon", "console"}
NOT_RUN = {"text"}  # diagrams, listings: shown, not run
SKIP = "not run in the tests:"
OUTPUT = "#>"
MISSING = re.compile(r"(?<![\w/])(?:n/a|nan)(?![\w/])", re.IGNORECASE)
WHY_MISSING = re.compile(r"#(?!>)[^\n]*(?<![\w/])(?:n/a|nan)(?![\w/])", re.IGNORECASE)  # a comment, not #> output
FILE_BLOCK = re.compile(r"#\s*([\w./-]+\.py)\s*$")
DIMS_CLAIM = re.compile(r"#\s*\[([\w\s,]+)\]")
GIVEN_STORE = "prose.zarr"
TRACES_GIVEN = re.compile(r"--out\s+prose\.zarr\b|(?<!open_)trace\([^\n]*[\"']prose\.zarr[\"']")
COMMAND_TIMEOUT = 600


# -- what a block shows ---------------------------------------------------------------------

_TOKEN = re.compile(r"(?P<ellipsis>\.\.\.|…)|(?P<space>\s+)|(?P<number>[-+]?(?:\d+\.\d+|\.\d+|\d+)(?:[eE][-+]?\d+)?)")


def _normalize(line: str) -> str:
    return " ".join(line.split())


def _line_pattern(want: str) -> tuple[re.Pattern, list[str]]:
    """A regex for one shown output line and the numbers it shows, in order."""
    parts, numbers, at = [], [], 0
    for m in _TOKEN.finditer(want):
        parts.append(re.escape(want[at : m.start()]))
        if m["ellipsis"]:
            parts.append(".*?")
        elif m["space"]:
            parts.append(r"\s*")
        else:
            parts.append(r"([-+]?(?:\d+\.\d+|\.\d+|\d+)(?:[eE][-+]?\d+)?)")
            numbers.append(m["number"])
        at = m.end()
    parts.append(re.escape(want[at:]))
    return re.compile("".join(parts)), numbers


def _number_matches(want: str, got: str) -> bool:
    """``want`` as written: with d decimals it matches ``got`` within 10^-d, without any exactly."""
    mantissa, _, exponent = want.lower().partition("e")
    decimals = len(mantissa.partition(".")[2]) - int(exponent or 0)
    return abs(float(want) - float(got)) <= 10.0**-decimals * (1 + 1e-9) if decimals > 0 else float(want) == float(got)


def line_matches(want: str, got: str) -> bool:
    """Does the output line ``got`` read as the shown line ``want``? (whitespace runs are one space)"""
    pattern, numbers = _line_pattern(_normalize(want))
    m = pattern.fullmatch(_normalize(got))
    return bool(m) and all(_number_matches(w, g) for w, g in zip(numbers, m.groups()))


def unmatched_line(shown: list[str], output: str) -> str | None:
    """The first shown line that is not a line of ``output`` after the previous one's (None: all are)."""
    lines = output.splitlines()
    at = 0
    for want in shown:
        if _normalize(want) in ("...", "…"):
            continue
        while at < len(lines) and not line_matches(want, lines[at]):
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


def missing_values(text: str) -> list[str]:
    """Lines of ``text`` that say ``n/a`` or ``nan``."""
    return [line.strip() for line in text.splitlines() if MISSING.search(line)]


def _check_output(where: str, shown: list[str], output: str, block: str, stderr: str = "") -> None:
    missing = missing_values(output + "\n" + stderr)
    if missing and not WHY_MISSING.search(block):
        pytest.fail(f"{where} prints n/a or nan and the page does not say why:\n" + "\n".join(missing[:5]))
    lost = unmatched_line(shown, output)
    if lost is not None:
        pytest.fail(f"{where}: the page shows\n    {lost}\nwhich is not in what it printed:\n{output}")


def _skip_reason(text: str) -> str | None:
    _, found, reason = text.partition(SKIP)
    return reason.strip() or "no reason given" if found else None


def _block_skip(source: str) -> str | None:
    for line in source.splitlines():
        if line.lstrip().startswith("#") and (reason := _skip_reason(line)):
            return reason
    return None


# -- the page's working folder --------------------------------------------------------------


@dataclass
class Page:
    """One page's working folder and the environment its commands see; ``given``: where
    ``prose.zarr`` is traced once for the whole run (None: traced where a page traces it)."""

    path: Path
    folder: Path
    env: dict = field(default_factory=dict)
    given: Path | None = None

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else self.path.name


def page_environment() -> dict:
    """What a reader's shell has: the installed ``kvscope`` first on PATH, a fixed terminal width
    (tables wrap alike everywhere), no colour; the rest as the tests' own (root conftest.py)."""
    scripts = Path(sys.executable).parent
    if shutil.which("kvscope", path=str(scripts)) is None:
        pytest.fail(f"the kvscope console script is not installed beside {sys.executable}")
    env = {**os.environ, "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(COLUMNS="120", NO_COLOR="1", TERM="dumb")
    return env


def needs_given_store(text: str) -> bool:
    return GIVEN_STORE in text and not TRACES_GIVEN.search(text)


def quick_start_trace() -> str:
    """The README quick start's command that traces ``prose.zarr``."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("kvscope trace ") and TRACES_GIVEN.search(line):
            return line.split("  #")[0].strip()
    raise AssertionError("README.md's quick start has no `kvscope trace … --out prose.zarr` line")


def build_given_store(folder: Path, env: dict) -> Path:
    """``prose.zarr`` as the README's quick start traces it, in ``folder`` (once: kept there,
    with what the command printed in ``folder``/traced.json)."""
    store, done = folder / GIVEN_STORE, folder / "traced.json"
    if not done.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(store, ignore_errors=True)
        command = quick_start_trace()
        proc = subprocess.run(["bash", "-c", command], check=False, cwd=folder, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"{command} failed ({proc.returncode}):\n{proc.stderr}"
        done.write_text(json.dumps({"stdout": proc.stdout, "stderr": proc.stderr}))
    return store


def given_store(folder: Path, env: dict) -> Path:
    """:func:`build_given_store` under a lock: the test workers share one trace."""
    from filelock import FileLock

    with FileLock(str(folder) + ".lock"):
        return build_given_store(folder, env)


def _given_trace(page: Page, command: Command) -> subprocess.CompletedProcess | None:
    """The quick start's trace command, run once for the whole run: the store copied into the
    page's folder, and what the command printed (None: ``command`` is another one)."""
    if page.given is None or command.text.split("  #")[0].strip() != quick_start_trace():
        return None
    store = given_store(page.given, page.env)
    shutil.rmtree(page.folder / GIVEN_STORE, ignore_errors=True)
    shutil.copytree(store, page.folder / GIVEN_STORE)
    printed = json.loads((page.given / "traced.json").read_text())
    return subprocess.CompletedProcess(command.text, 0, printed["stdout"], printed["stderr"])


# -- evaluators -----------------------------------------------------------------------------


def _page(example: Example) -> Page:
    return example.namespace["_docs_page"]


@dataclass
class Command:
    line: int  # in the page
    text: str
    shown: list[str] = field(default_factory=list)


def shell_commands(source: str, first_line: int) -> list[Command]:
    """The commands of a shell block (``\\`` continuations joined), each with its ``#>`` lines."""
    commands: list[Command] = []
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        line, number = lines[i], first_line + i
        stripped = line.strip()
        i += 1
        if stripped.startswith(OUTPUT):
            if not commands:
                raise AssertionError(f"line {number}: output shown before any command")
            commands[-1].shown.append(stripped[len(OUTPUT) :].removeprefix(" "))
            continue
        if not stripped or stripped.startswith("#"):
            continue
        text = line
        while text.rstrip().endswith("\\") and i < len(lines):
            text += "\n" + lines[i]
            i += 1
        commands.append(Command(number, text))
    return commands


def _bash(page: Page, text: str) -> subprocess.CompletedProcess:
    """One command of a page, run by bash in the page's folder and environment."""
    return subprocess.run(
        ["bash", "-c", text], check=False, cwd=page.folder, env=page.env, capture_output=True, text=True,
        timeout=COMMAND_TIMEOUT,
    )  # fmt: skip


def _check_exit(where: str, proc: subprocess.CompletedProcess, expected: int) -> None:
    if proc.returncode != expected:
        pytest.fail(f"{where}\nexited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def evaluate_shell(example: Example) -> None:
    page = _page(example)
    source = example.parsed
    if reason := _block_skip(source):
        pytest.skip(reason)
    for command in shell_commands(source, example.line + 1):
        where = f"{page.name}:{command.line}: {command.text.strip()}"
        if _skip_reason(command.text):
            continue
        proc = _given_trace(page, command) or _bash(page, command.text)
        _check_exit(where, proc, 0)
        _check_output(where, command.shown, proc.stdout, source, proc.stderr)


def _dims_of(value) -> tuple | None:
    if hasattr(value, "dims"):
        return tuple(value.dims)
    if hasattr(value, "index") and hasattr(value, "columns"):  # a pandas DataFrame
        return (value.index.name, value.columns.name)
    if hasattr(value, "index") and hasattr(value.index, "name"):  # a pandas Series
        return (value.index.name,)
    return None


def _check_dims(where: str, value, claim: str) -> None:
    named = tuple(name.strip() for name in claim.split(","))
    dims = _dims_of(value)
    if dims is None or dims != named:
        pytest.fail(f"{where}: the page says [{claim}], the value has dims {dims} ({type(value).__name__})")


@contextlib.contextmanager
def _in_folder(folder: Path):
    """The working directory and import path a script in ``folder`` has; modules imported from
    the folder (a page's own ``mypress.py``) are forgotten afterwards."""
    before, modules = os.getcwd(), set(sys.modules)
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        os.chdir(before)
        sys.path.remove(str(folder))
        for name in set(sys.modules) - modules:
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(folder)):
                del sys.modules[name]


def evaluate_python(example: Example) -> None:
    page = _page(example)
    source = example.parsed
    lines = source.splitlines()
    first = example.line + 1  # the block's first line in the page
    if lines and (m := FILE_BLOCK.fullmatch(lines[0].strip())):
        target = page.folder / m[1]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
        return
    if reason := _block_skip(source):
        pytest.skip(reason)
    tree = ast.parse(source)
    ns = example.namespace
    with _in_folder(page.folder):
        for k, stmt in enumerate(tree.body):
            own = lines[stmt.lineno - 1 : stmt.end_lineno]
            after = lines[stmt.end_lineno : tree.body[k + 1].lineno - 1 if k + 1 < len(tree.body) else len(lines)]
            shown = [ln.strip()[len(OUTPUT) :].removeprefix(" ") for ln in after if ln.strip().startswith(OUTPUT)]
            where = f"{page.name}:{first + stmt.lineno - 1}: {own[0].strip()}"
            if any(_skip_reason(ln) for ln in own):
                continue
            module = ast.Module([stmt], type_ignores=[])
            ast.increment_lineno(module, first - 1)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                if isinstance(stmt, ast.Expr):
                    value = eval(compile(ast.Expression(module.body[0].value), str(page.path), "eval"), ns)
                else:
                    exec(compile(module, str(page.path), "exec"), ns)  # noqa: S102 (the page's own code)
                    target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
                    value = ns.get(target.id) if isinstance(target, ast.Name) else None
            sys.stdout.write(out.getvalue())
            if claim := DIMS_CLAIM.search(own[-1]):
                _check_dims(where, value, claim[1])
            _check_output(where, shown, out.getvalue(), source)


def evaluate_session(example: Example) -> None:
    page = _page(example)
    source = example.parsed
    if reason := _block_skip(source):
        pytest.skip(reason)
    examples = doctest.DocTestParser().get_examples(source)
    test = DocTest(examples, example.namespace, page.name, str(page.path), example.line, None)  # globs not copied
    runner = doctest.DocTestRunner(checker=OutputChecker(), optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    report: list[str] = []
    with _in_folder(page.folder):
        runner.run(test, out=report.append, clear_globs=False)
    if runner.failures:
        pytest.fail(f"{page.name}:{example.line + 1}: a session prints other than it shows:\n" + "".join(report))
    _check_output(f"{page.name}:{example.line + 1}", [], "".join(e.want for e in examples), source)


def console_commands(source: str, first_line: int) -> list[Command]:
    """The ``$ `` commands of a console block, each with the lines it is shown printing."""
    commands: list[Command] = []
    for i, line in enumerate(source.splitlines()):
        if line.startswith("$ "):
            commands.append(Command(first_line + i, line[2:]))
        elif commands and line.strip():
            commands[-1].shown.append(line)
        elif line.strip():
            raise AssertionError(f"line {first_line + i}: output shown before any command")
    return commands


def evaluate_console(example: Example) -> None:
    page = _page(example)
    source = example.parsed
    if reason := _block_skip(source):
        pytest.skip(reason)
    for command in console_commands(source, example.line + 1):
        where = f"{page.name}:{command.line}: $ {command.text}"
        proc = _bash(page, command.text)
        refused = bool(command.shown) and command.shown[0].startswith("kvscope: error: ")
        _check_exit(where, proc, 2 if refused else 0)
        _check_output(where, command.shown, proc.stdout + proc.stderr, source)


def collector() -> Sybil:
    """The sybil that turns every runnable block of the pages into a test."""
    return Sybil(
        parsers=[
            CodeBlockParser("sh", evaluate_shell),
            CodeBlockParser("bash", evaluate_shell),
            CodeBlockParser("python", evaluate_python),
            CodeBlockParser("pycon", evaluate_session),
            CodeBlockParser("console", evaluate_console),
        ],
        patterns=PAGES,
        excludes=["site/*", ".venv/*"],
        fixtures=["_docs_page"],
        path=str(ROOT),
    )


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$", re.MULTILINE)


def fences(text: str) -> list[tuple[int, str]]:
    """(line, language) of every fenced block that opens in ``text`` (closing fences skipped)."""
    out, open_fence = [], None
    for m in FENCE.finditer(text):
        if open_fence is None:
            out.append((text.count("\n", 0, m.start()) + 1, m["info"].strip().split(" ")[0]))
            open_fence = m["fence"]
        elif m["fence"].startswith(open_fence) and not m["info"].strip():
            open_fence = None
    return out


def page_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
