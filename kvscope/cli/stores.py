"""``kvscope info``, ``compact`` and ``verify``: a store described, rewritten smaller, checked."""

from __future__ import annotations

import json

from ..report import print_table
from .common import EXIT_BAD_INPUT, human_bytes


def add_info(sub) -> None:
    p = sub.add_parser("info", help="describe a trace store")
    p.add_argument("store")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="only the checks on open, not every committed chunk")
    p.set_defaults(func=cmd_info)


def cmd_info(args) -> int:
    from ..storage.rowformat import row_format
    from ..storage.store import store_info
    from ..storage.verify import refuse_if_damaged, verify

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
    forced = [
        f"{what} {info[key]}"
        for key, what in (("question_tokens", "question"), ("continuation_tokens", info["continuation_kind"]))
        if info[key] is not None
    ]
    if forced:
        print("forced steps per sample: " + ", then ".join(forced))
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


def add_verify(sub) -> None:
    p = sub.add_parser("verify", help="check every committed chunk of a trace or replay result and its values")
    p.add_argument("store", help="a trace (*.zarr) or a replay result (kvscope replay --out)")
    p.add_argument("--deep", action="store_true", help="also recompute a sample of rows from recorded q/k")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args) -> int:
    from ..replay.check import is_result, verify_result
    from ..storage.verify import verify

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


def add_compact(sub) -> None:
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
    p.set_defaults(func=cmd_compact)


def cmd_compact(args) -> int:
    from ..storage.compact import compact
    from ..storage.rowformat import row_format

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
