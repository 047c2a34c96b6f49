"""What the commands share: the one-line parser and error, the quiet libraries, the prompt and
allocation options, progress bars, the dask cluster of ``--dask``, sizes in words."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings

from ..errors import KvscopeError
from ..storage.paths import human_bytes  # noqa: F401 - sizes in words, for every command

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    """An option is written in full: ``--force`` is not taken for ``--forced`` (no abbreviations)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, exit 2 (argparse prints usage + error otherwise)
        print(f"kvscope: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


@contextlib.contextmanager
def quiet_libraries():
    """What the command line keeps out of its output while it runs: transformers' info logs
    and progress bars, zarr's note on consolidated metadata, libraries' FutureWarnings. The hub
    client's telemetry is off unless set (its extra request would wait on an unreachable hub)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # a refused chunk ends zarr's concurrent reads early: the others are stopped at exit
    # (_stop_io_at_exit), and asyncio's notes on them kept out of the output
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:  # imported already (the environment above is read at import)
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Consolidated metadata.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def one_line(exc: Exception) -> int:
    print(f"kvscope: error: {' '.join(str(exc).split())}", file=sys.stderr)
    return EXIT_BAD_INPUT


def in_codec(exc: BaseException) -> bool:
    """The exception was raised while zarr decoded a chunk."""
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if "/zarr/codecs/" in name or "/numcodecs/" in name:
            return True
        tb = tb.tb_next
    return False


def progress_bar(label: str, quiet: bool, what: str = "", fields: dict | None = None):
    """A transient rich progress bar on stderr: ``(bar, task)``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TextColumn(what), TimeRemainingColumn()
    )  # fmt: skip
    bar = Progress(*columns, console=Console(stderr=True), disable=quiet, transient=True)
    return bar, bar.add_task(label, total=None, **(fields or {}))


def add_prompt_sources(p, required: bool = True) -> None:
    """``--prompt | --prompts FILE | --workload NAME [--context] [--samples] | --dataset FILE`` (read by
    ``read_prompts``; ``required=False``: the command checks that one is given, where it needs one)."""
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument(
        "--prompts", metavar="FILE.jsonl", help='JSONL, one {"prompt": …} or {"context": …, "question": …} per line'
    )
    src.add_argument("--workload", help=f"a built-in workload (see kvscope workloads): {workload_names()}")
    src.add_argument(
        "--dataset", metavar="FILE",
        help="your own data with kvpress's evaluation columns, JSON lines (.jsonl) or Parquet (.parquet): context, "
        "question, answer (a string or a list), answer_prefix, max_new_tokens, task; one sample per row",
    )  # fmt: skip
    p.add_argument("--context", type=int, default=None, help="--workload: prompt length in tokens (recipe's default)")
    p.add_argument("--samples", type=int, default=None, help="--workload: number of prompts (recipe's default)")


def add_protocol(p, agnostic: str) -> None:
    """``--question-agnostic | --question-aware`` of ``trace`` and ``run`` (``agnostic``: the first's
    help): where a policy first compresses, resolved by ``question_agnostic``."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--question-agnostic", action="store_true", help=agnostic + " (the default of --dataset)")
    group.add_argument(
        "--question-aware", dest="question_agnostic", action="store_false",
        help="prefill each prompt's context and question together: a press sees the question (the default, but "
        "with --dataset)",
    )  # fmt: skip
    p.set_defaults(question_agnostic=None)


def question_agnostic(args) -> bool:
    """The protocol of ``add_protocol``'s flags, set on ``args``: as given, else question-agnostic for
    ``--dataset`` (kvpress's evaluation protocol: the context is compressed before any question) and
    question-aware for every other source."""
    if args.question_agnostic is None:
        args.question_agnostic = getattr(args, "dataset", None) is not None
    return args.question_agnostic


def read_prompts(args):
    """The prompts of ``--prompt``, ``--prompts FILE``, ``--workload NAME`` (and the workload) or
    ``--dataset FILE`` (``kvscope.model.dataset``: prompts with answers, whose gold answers a
    trace forces), with their continuations where the command takes them (``trace``:
    ``--continuation FILE`` for ``--prompt``, a ``"continuation"`` per JSONL line,
    ``--continuation-tokens N`` for a workload that continues a text); ``--max-new-tokens``
    left out means all of each continuation (or gold answer)."""
    from ..model.prompts import Prompt, continuations, load_continuation_file, load_prompts_file

    workload = None
    continuation, follow = getattr(args, "continuation", None), getattr(args, "continuation_tokens", None)
    if continuation is not None and args.prompt is None:
        raise KvscopeError(
            '--continuation FILE goes with a single --prompt (with --prompts, give a "continuation" on each line; '
            "with --workload prose or code, --continuation-tokens N)"
        )
    if follow is not None and args.workload is None:
        raise KvscopeError(
            "--continuation-tokens goes with --workload prose or code (a text of your own: --continuation)"
        )
    if args.workload is not None:
        from .. import workloads

        workload = workloads.get(args.workload)
        recipe = workload.recipe
        follow = recipe.get("continuation_tokens", 0) if follow is None else follow
        if not follow:
            args.max_new_tokens = args.max_new_tokens or int(recipe.get("max_new_tokens", 64))
        args.chat = args.chat or bool(recipe.get("chat", False))
        prompts = workloads.prompts_for_model(
            args.workload, args.model, context=args.context, seed=args.seed, samples=args.samples,
            chat=args.chat, max_new_tokens=args.max_new_tokens or 0, trust_remote_code=args.trust_remote_code,
            continuation_tokens=follow,
        )  # fmt: skip
    else:
        if args.context is not None or args.samples is not None:
            raise KvscopeError("--context and --samples go with --workload")
        if getattr(args, "dataset", None) is not None:
            from ..model.dataset import load_dataset

            prompts = load_dataset(args.dataset)
        elif args.prompt is not None:
            if not args.prompt.strip():
                raise KvscopeError("--prompt is empty")
            given = load_continuation_file(continuation) if continuation is not None else None
            prompts = [Prompt(args.prompt, "cli", continuation=given)]
        else:
            prompts = load_prompts_file(args.prompts)
    if args.max_new_tokens is None and continuations(prompts) is None:
        raise KvscopeError("--max-new-tokens is required (except with --workload or a given continuation)")
    return prompts, workload


def add_allocation(p, several: bool) -> None:
    p.add_argument(
        "--allocation", default="uniform",
        help=("comma-separated, each " if several else "")
        + f"how β's bytes are split across layers and KV heads: {allocation_names()}"
        + " (name or name:key=value, e.g. pyramid:beta=10; default uniform)",
    )  # fmt: skip


# The names that help texts list, read from their registries (a name registered there is offered
# by every command that takes one; the error for an unknown name lists the same registry).


def workload_names() -> str:
    """The built-in workloads (``kvscope.workloads``)."""
    from ..workloads import WORKLOADS

    return ", ".join(WORKLOADS)


def allocation_names() -> str:
    """The registered allocations (``kvscope.policies.allocation``)."""
    from ..policies.allocation import REGISTRY

    return ", ".join(REGISTRY)


def policy_names(live: bool = False, tunable: bool = False) -> str:
    """The registered policies, then ``press:NAME`` with kvpress's presses; ``live``: those a
    live cache runs (not the clairvoyant ones); ``tunable``: those with parameters to search
    (no presses)."""
    from ..params import specs
    from ..policies import REGISTRY, Press
    from ..policies.kvpress_bridge import INSTALL, press_names

    names = [
        name
        for name, cls in REGISTRY.items()
        if cls is not Press and not (live and cls.clairvoyant) and not (tunable and not specs(cls))
    ]
    if tunable:
        return ", ".join(names)
    presses = sorted(press_names())
    press = (
        f"press:NAME, NAME one of kvpress's {', '.join(presses)}"
        if presses
        else f"press:NAME (needs kvpress: {INSTALL})"
    )
    return f"{', '.join(names)}; {press}"


class DaskContext:
    """``--dask local:N`` starts a LocalCluster; ``tcp://…`` connects to a scheduler."""

    def __init__(self, spec: str | None):
        self.spec = spec
        self.client = self.cluster = None
        self.environ: dict = {}

    def __enter__(self):
        if not self.spec:
            return None
        from distributed import Client

        from ..cluster import local_cluster

        if self.spec.startswith("local:"):
            try:
                n = int(self.spec.split(":", 1)[1])
            except ValueError:
                raise KvscopeError(f"--dask local:N needs a worker count (got {self.spec!r})") from None
            if n < 1:
                raise KvscopeError("--dask local:N needs N ≥ 1")
            self.environ = dict(os.environ)  # the nanny sets OMP_NUM_THREADS=1 … here too, for its workers
            self.cluster = local_cluster(n)
            self.client = Client(self.cluster)
        elif self.spec.startswith(("tcp://", "tls://")):
            try:
                self.client = Client(self.spec, timeout="10s")
            except OSError as exc:
                raise KvscopeError(f"cannot reach the dask scheduler at {self.spec}: {exc}") from None
        else:
            raise KvscopeError(f"--dask takes local:N or tcp://host:port (got {self.spec!r})")
        return self.client

    def __exit__(self, *exc):
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()
            os.environ.clear()
            os.environ.update(self.environ)


def say_lossy_rows(attrs: dict) -> None:
    """One line after a table whose numbers come from a trace with lossy rows (kvscope compact)."""
    from ..storage.rowformat import RowFormat

    rows = RowFormat.of(attrs)
    if rows.lossy:
        print(rows.line())
