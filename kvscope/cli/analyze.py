"""``kvscope analyze METRIC``: one subcommand per registered metric."""

from __future__ import annotations

import dataclasses
import json

from ..errors import KvscopeError
from .common import DaskContext, Parser, allocation_names, policy_names, say_lossy_rows


def add_analyze(sub, metrics: bool = True) -> None:
    """One subcommand per registered metric, its options generated from the metric's fields
    (``metrics=False``: the command alone, for a command line that runs another one — the
    metrics' modules import xarray, dask and scipy)."""
    if not metrics:
        sub.add_parser("analyze", help="metrics of a trace")
        return
    from ..analysis import available

    p = sub.add_parser("analyze", help="metrics of a trace: " + ", ".join(available()))
    metrics = p.add_subparsers(dest="analysis", required=True, parser_class=Parser, metavar="METRIC")
    policies, allocations = policy_names(), allocation_names()
    for name, cls in available().items():
        q = metrics.add_parser(name, help=_escaped(cls.title), description=_escaped(cls.title))
        q.add_argument("store")
        _add_param_options(q, cls)
        q.add_argument("--policy", default=None, help="use this policy's replayed selection: " + _escaped(policies))
        q.add_argument("--budget", type=float, default=None, help="the budget β of --policy")
        q.add_argument(
            "--allocation",
            default="uniform",
            help=f"--policy: how β is split across layers and KV heads: {allocations}",
        )
        q.add_argument("--dask", default=None, help="local:N (LocalCluster) or tcp://host:port (a scheduler)")
        q.add_argument("--from-qk", action="store_true", help="recompute the rows from recorded q/k (--record qkv)")
        q.add_argument("--json", action="store_true")
        q.add_argument("--plot", default=None, metavar="FILE", help="write a figure (PNG, PDF, SVG)")
        q.set_defaults(func=cmd_analyze, metric_class=cls)


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


def cmd_analyze(args) -> int:
    from ..figures import save
    from ..report import print_rows
    from ..storage.paths import figure_path
    from ..storage.store import open_trace

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
