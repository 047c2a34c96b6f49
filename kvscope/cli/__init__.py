"""``kvscope`` command line: a thin layer over the Python API (docs/concepts.md#bad-input).

Bad input ends with one line ``kvscope: error: …`` on stderr and exit code 2.

One module per command group: ``trace``, ``stores`` (info, verify, compact),
``analyze``, ``replay`` (replay, compare, tune), ``catalog`` (policies, workloads,
models), ``live`` (run, validate), ``view``; ``common`` holds what they share.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import sys

from ..errors import KvscopeError, first_line
from .analyze import add_analyze
from .catalog import add_models, add_policies, add_workloads
from .common import EXIT_BAD_INPUT, Parser, in_codec, one_line, quiet_libraries
from .live import add_run, add_validate
from .replay import add_compare, add_replay, add_tune
from .stores import add_compact, add_info, add_verify
from .trace import add_trace
from .view import add_view

# imported from here by benchmarks/ and tests/ (``from kvscope.cli import main``)
__all__ = ["EXIT_BAD_INPUT", "build_parser", "main", "quiet_libraries"]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command`` (the subcommand a command line runs) the
    others' options may be left out where building them costs imports."""
    from .. import __version__

    parser = Parser(prog="kvscope", description="What an LLM's KV cache really needs.")
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_trace(sub)
    add_info(sub)
    add_verify(sub)
    add_compact(sub)
    add_analyze(sub, metrics=command in (None, "analyze"))
    add_replay(sub)
    add_compare(sub)
    add_tune(sub)
    add_policies(sub)
    add_run(sub)
    add_validate(sub)
    add_workloads(sub)
    add_models(sub)
    add_view(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the subcommand: the first word that is not an option (the options before it, --help and
    # --version, take no value)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        with quiet_libraries():
            return int(args.func(args) or 0)
    except KvscopeError as exc:
        return one_line(exc)
    except KeyboardInterrupt:
        print("kvscope: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (| head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # never a traceback (KVSCOPE_DEBUG=1 shows it)
        if os.environ.get("KVSCOPE_DEBUG"):
            raise
        if in_codec(exc):  # CRC-valid bytes that still do not decode: a damaged chunk
            return one_line(
                KvscopeError(f"a chunk could not be decoded ({first_line(exc, named=True)}); run kvscope verify")
            )
        print(
            f"kvscope: internal error: {first_line(exc, named=True)} (KVSCOPE_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        _stop_io_at_exit()


def _stop_io_at_exit() -> None:
    """zarr's reads and writes still under way when the command ends (the other chunks of a read
    that failed) are stopped at exit: after this process's threads are joined (threading's
    shutdown), before zarr closes its event loop (atexit runs the handler registered last first)."""
    if "zarr.core.sync" in sys.modules:
        _register_stop_io()


@functools.cache
def _register_stop_io() -> None:
    from ..storage.store import stop_background_io

    atexit.register(stop_background_io)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
