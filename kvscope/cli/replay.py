"""``kvscope replay``, ``compare`` and ``tune``: policies replayed offline, their results, their parameters."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .. import defaults
from ..errors import KvscopeError
from ..params import split_outside_brackets
from ..report import print_table
from .common import DaskContext, add_allocation, policy_names, progress_bar, say_lossy_rows


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


def _save_figure(fig, path) -> None:
    from ..figures import save

    save(fig, path)


def add_replay(sub) -> None:
    p = sub.add_parser("replay", help="replay KV-cache policies offline against a trace at equal bytes")
    p.add_argument("store")
    p.add_argument(
        "--policies",
        required=True,
        help="comma-separated, each name or name:key=value:…, e.g. h2o,qevict:q_frac=0.5 (see kvscope policies): "
        + policy_names(),
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
    p.add_argument(
        "--forced", action="store_true",
        help="also the model's own output under each policy's cache, teacher-forced on the trace's continuation: "
        "KL to full KV, perplexity, top-1 agreement (loads the trace's model)",
    )  # fmt: skip
    p.add_argument(
        "--forced-chunk", type=int, default=defaults.FORCED_CHUNK, metavar="N",
        help=f"decode steps per forward of --forced (default {defaults.FORCED_CHUNK}; a press that acts while decoding "
        "runs step by step)",
    )  # fmt: skip
    p.add_argument(
        "--max-rounds", type=int, default=defaults.FORCED_MAX_ROUNDS, metavar="N",
        help="forwards of one chunk before a closed loop that still changes is labelled not converged "
        f"(default {defaults.FORCED_MAX_ROUNDS})",
    )  # fmt: skip
    p.add_argument("--device", default=None, help="where --forced runs the model (default: the trace's device)")
    p.add_argument("--out", default=None, metavar="RESULT.zarr", help="write the result Dataset")
    p.add_argument(
        "--plot", default=None, metavar="FILE",
        help="write the comparison figure (with answers: accuracy against β per policy, one panel per task)",
    )  # fmt: skip
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
    p.set_defaults(func=cmd_replay)


def cmd_replay(args) -> int:
    from ..plots import plot_compare
    from ..policies import parse
    from ..replay import replay
    from ..replay.store import refuse_existing
    from ..storage.paths import figure_path, output_path

    policies = [parse(x) for x in split_outside_brackets(args.policies) if x.strip()]
    if not policies:
        raise KvscopeError("--policies needs at least one policy")
    budgets = _budgets(args.budgets)
    allocations = _allocations(args.allocation)
    if args.out:
        output_path(args.out, "--out", inputs=[args.store])
        refuse_existing(args.out)  # before the trace is read; replay checks again when it renames
    if args.plot:
        figure_path(args.plot)
    if args.forced:
        from ..replay.forced import check_forced

        check_forced(args.forced_chunk, args.max_rounds)
    quiet = args.quiet or args.json or not sys.stderr.isatty()
    bar, task = progress_bar(f"replay {len(policies)}×{len(allocations)}×{len(budgets)}", quiet, "steps")
    with bar, DaskContext(args.dask) as client:
        result = replay(
            args.store, policies, budgets, allocations=allocations, observe=args.observe, horizon=args.horizon, every=args.every,
            question_agnostic=args.question_agnostic, layers_per_task=args.layers_per_task,
            kv_heads_per_task=args.kv_heads_per_task, client=client, processes=args.processes,
            progress=lambda done, total: bar.update(task, completed=done, total=total), out=args.out,
            forced=args.forced, forced_chunk=args.forced_chunk, max_rounds=args.max_rounds, device=args.device,
        )  # fmt: skip
    if args.plot:
        _save_figure(plot_compare(result), args.plot)
    protocol = " · question-agnostic" if result.attrs.get("protocol") == "question-agnostic" else ""
    code = _show_comparison(result, args, f"replay · {args.store} · observe={args.observe}{protocol}")
    if not args.json:
        from ..storage.store import read_attrs

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


def add_compare(sub) -> None:
    p = sub.add_parser("compare", help="policy × allocation × budget table and figures of a replay result")
    p.add_argument("result", help="a RESULT.zarr written by kvscope replay --out")
    p.add_argument(
        "--plot", default=None, metavar="FILE",
        help="FMM vs budget, output error vs budget, tier mass; with answers, accuracy vs β per policy for each task",
    )  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    from ..plots import plot_compare
    from ..replay import open_result
    from ..storage.paths import figure_path

    if args.plot:
        figure_path(args.plot)
    result = open_result(args.result)
    if args.plot:
        _save_figure(plot_compare(result), args.plot)
    return _show_comparison(result, args, f"compare · {args.result} · observe={result.attrs.get('observe')}")


def add_tune(sub) -> None:
    from ..tune import OBJECTIVES

    p = sub.add_parser("tune", help="search a policy's and its allocation's parameters offline, check the best live")
    p.add_argument("store", help="a trace (with q/k/v for --objective output-error)")
    p.add_argument(
        "--policy", required=True, help="the policy whose parameters are searched: " + policy_names(tunable=True)
    )
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
    p.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    from ..storage.paths import output_path
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
