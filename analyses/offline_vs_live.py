"""Does offline replay rank KV-cache policies the way live decoding does?

For each workload (``niah``, ``passkey``, ``vt_chains``) and ``--prompts`` prompts of it::

    offline   one trace per prompt (q/k/v recorded, greedy, no EOS stop); every policy × budget
              replayed on it: FMM@H, FMM fp@H, attention L1 and output error, per prompt the
              mean over events, layers and KV heads; and forced replay (``--forced``): the
              model's own output under each policy's cache, teacher-forced on the trace's
              tokens — KL to full KV, perplexity and 1 − top-1 agreement per prompt, with the
              rounds its closed loop took. The byte model counts full-precision entries at the
              model's dtype (4 bytes for SmolLM2 in float32), as the live caches do.
    live      kvscope run's decodes of each prompt under every policy × budget (the full-KV
              decode made once per prompt): task score, teacher-forced KL to full KV, greedy
              token agreement
    transfer  Kendall τ and Spearman ρ between each offline metric and each live measure, the
              live measure taken as a loss (KL, 1 − agreement, 1 − score), so that +1 means
              offline ranks exactly as live: over the policy × budget grid (means over
              prompts), and within each budget over the policies (the choice a user makes at
              a given memory), with 95% bootstrap intervals over prompts
    cost      the offline grid's time (traces + replays, on ``--workers`` threads) over the live
              grid's (its decodes' seconds over ``--workers`` processes), same machine

An interrupted study resumes: each workload's offline grid and each prompt's live grid is kept
under ``results/offline_vs_live/parts/`` (keyed by every setting that decides it) once finished.

    python analyses/offline_vs_live.py [--prompts 10] [--budgets 0.2,0.3,0.5]
        [--workloads niah,passkey,vt_chains] [--workers 2] [--device cpu]
            → results/offline_vs_live/{summary.md,summary.json} (every record), docs/offline-vs-live.md,
              docs/figures/offline_vs_live.png

On a GPU the same script runs larger (``--device cuda --prompts 50 --context 4096``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload_traces import add_arguments

OURS = ["streaming", "h2o", "snapkv", "kivi", "logquant", "qevict"]
PRESSES = [
    "press:SnapKVPress",
    "press:TOVAPress",
    "press:KnormPress",
    "press:ExpectedAttentionPress",
    "press:PyramidKVPress:window_size=16:beta=2",  # kvpress's window 64 is SnapKV below ~1,300 tokens
    "press:KeyDiffPress",
    # presses that read more than q, k, v: offline on the trace's own model, its prompt prefilled once
    "press:KVzipPress",
    "press:LeverageScorePress",
    "press:CompactorPress",
]
POLICIES = OURS + PRESSES
OFFLINE = {
    "fmm": "FMM", "fmm_fp": "FMM fp", "attn_l1": "attn L1", "output_rel_l2": "output error",
    "forced_kl": "forced KL", "forced_nll": "forced log-perplexity", "forced_disagreement": "forced 1 − top-1",
}  # fmt: skip
PER_EVENT = ("fmm", "fmm_fp", "attn_l1", "output_rel_l2")  # means over events, layers and KV heads
PER_STEP = {"forced_kl": "forced_kl", "forced_nll": "forced_nll", "forced_disagreement": "forced_top1"}
LIVE = {"kl": "KL", "disagreement": "1 − agreement", "score_loss": "1 − score"}
# new tokens: niah's four 7-digit numbers, passkey's key and a sentence, vt_chains's list of variables
STEPS = {"niah": 40, "passkey": 24, "vt_chains": 32}
HORIZON = 16
N_BOOT = 1000


def steps(args, name: str) -> int:
    """New tokens decoded for workload ``name``: ``--steps`` where given, else its own :data:`STEPS`."""
    return STEPS[name] if args.steps is None else args.steps


class Done:
    """Finished parts of the grid under ``--results``/offline_vs_live/parts, one JSON file each,
    keyed by everything that decides them: an interrupted study resumes where it stopped."""

    def __init__(self, args, phase: str):
        stamp = [args.model, args.context, args.prompts, args.seed, args.device, args.policies, args.budgets]
        # --steps: other parts (the default's digest as before it existed)
        stamp += [STEPS, HORIZON] + ([] if args.steps is None else [args.steps])
        digest = __import__("hashlib").sha256(json.dumps(stamp).encode()).hexdigest()[:12]
        self.folder = Path(args.results) / "offline_vs_live" / "parts" / f"{phase}-{digest}"
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, *key) -> Path:
        return self.folder / ("-".join(map(str, key)) + ".json")

    def get(self, *key):
        path = self._path(*key)
        return json.loads(path.read_text()) if path.is_file() else None

    def put(self, *key, value) -> None:
        tmp = self._path(*key).with_suffix(".tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(self._path(*key))


# -- live ---------------------------------------------------------------------------------------
_LOADED = {}


def _load(model: str, device: str) -> None:
    import torch

    from kvscope.live import prepare
    from kvscope.model.loading import load, resolve

    torch.set_num_threads(1)
    model_obj, tokenizer = load(resolve(model, allow_hub=False), device)
    _LOADED.update(model=prepare(model_obj), tokenizer=tokenizer)


def live_prompt(task: dict) -> list[dict]:
    """Every policy × budget on one prompt (a worker process): the full-KV decode once, then
    the policy decodes of :func:`kvscope.live.run.run_loaded`."""
    from kvscope import workloads
    from kvscope.live.run import full_decode, run_loaded

    model, tokenizer = _LOADED["model"], _LOADED["tokenizer"]
    ids, steps = task["ids"], task["steps"]
    scorer = workloads.get(task["workload"]).scorer
    started = time.perf_counter()
    full = full_decode(model, ids, steps)
    full_s = (time.perf_counter() - started) / (len(task["policies"]) * len(task["budgets"]))
    out = []
    for policy in task["policies"]:
        for budget in task["budgets"]:
            started = time.perf_counter()
            r = run_loaded(
                model, tokenizer, ids, policy, budget, steps, scorer=scorer, expected=task["expected"], full=full
            )
            out.append({
                "workload": task["workload"], "sample": task["sample"], "policy": policy, "budget": budget,
                "score": r.score, "score_full": r.score_full, "kl": r.kl, "agreement": r.agreement,
                "bytes": r.bytes_actual_peak / r.full_bytes, "reached": r.budget_reached,
                "seconds": time.perf_counter() - started + full_s,  # with its share of the full decode
            })  # fmt: skip
    return out


def live_grid(args, prompts: dict) -> tuple[list[dict], float]:
    """Every prompt of every workload on ``args.workers`` processes → (records, seconds: the
    decodes' time over the workers); prompts done before are read back."""
    from kvscope.model.loading import load_tokenizer, resolve
    from kvscope.model.prompts import encode

    tokenizer = load_tokenizer(resolve(args.model, allow_hub=False))
    tasks = []
    for name, (items, chat) in prompts.items():
        for s, (ids, prompt) in enumerate(zip(encode(tokenizer, items, chat), items)):
            tasks.append({
                "workload": name, "sample": s, "ids": ids, "expected": prompt.expected, "steps": steps(args, name),
                "policies": args.policies, "budgets": args.budgets,
            })  # fmt: skip
    done = Done(args, "live")
    todo = [t for t in tasks if done.get(t["workload"], t["sample"]) is None]
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers, initializer=_load, initargs=(args.model, args.device)) as pool:
        for n, (task, rows) in enumerate(zip(todo, pool.map(live_prompt, todo)), 1):
            done.put(task["workload"], task["sample"], value=rows)
            print(f"live: {n}/{len(todo)} prompts ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    records = [r for t in tasks for r in done.get(t["workload"], t["sample"])]
    return records, sum(r["seconds"] for r in records) / args.workers


# -- offline ------------------------------------------------------------------------------------
def offline_grid(args, prompts: dict, folder: Path) -> tuple[list[dict], float, dict]:
    """Trace every workload's prompts (one sample each) and replay the grid on them →
    (records, seconds, {workload: {trace, replay, forced} seconds}); a workload done before is read back."""
    done = Done(args, "offline")
    for name, (items, chat) in prompts.items():
        if done.get(name) is None:
            done.put(name, value=offline_workload(args, name, items, chat, folder))
    parts = {name: done.get(name) for name in prompts}
    records = [r for part in parts.values() for r in part["records"]]
    seconds = {name: part["seconds"] for name, part in parts.items()}
    return records, sum(s["trace"] + s["replay"] for s in seconds.values()), seconds


def offline_workload(args, name: str, items, chat: bool, folder: Path) -> dict:
    """One workload's traces and its grid replayed, forced included → {records, seconds}."""
    import kvscope

    folder.mkdir(parents=True, exist_ok=True)
    store = folder / f"{name}.zarr"  # under --results: two studies never share a trace
    t0 = time.perf_counter()
    kvscope.trace(
        items, store, model=args.model, max_new_tokens=steps(args, name), chat=chat, record_qkv=True,
        stop_at_eos=False, device=args.device, force=True,
    )  # fmt: skip
    t1 = time.perf_counter()
    result = kvscope.replay(
        store, args.policies, args.budgets, horizon=HORIZON, threads=args.workers, n_boot=1, forced=True,
        device=args.device,
    )  # fmt: skip
    result = result.sel(allocation="uniform")
    per_prompt = {var: result[var].mean(["event", "layer", "kv_head"], skipna=True).values for var in PER_EVENT}
    for var, stepwise in PER_STEP.items():  # [policy, budget, sample]: the mean over the scored steps
        per_prompt[var] = result[stepwise].mean("step", skipna=True).values
    per_prompt["forced_disagreement"] = 1 - per_prompt["forced_disagreement"]
    rounds = result["forced_rounds"].values  # [policy, budget, sample]
    converged = result["forced_converged"].values
    used = result["byte_ratio"].values  # [policy, budget, sample] peak bytes over the full cache
    forced = json.loads(result.attrs["forced"])
    seconds = {"trace": t1 - t0, "replay": time.perf_counter() - t1, "forced": forced["seconds"]}
    records = []
    for pi, policy in enumerate(result.policy.values):
        for bi, budget in enumerate(result.budget.values):
            for s in range(result.sizes["sample"]):
                row = {"workload": name, "sample": s, "policy": str(policy), "budget": float(budget)}
                row.update({var: float(per_prompt[var][pi, bi, s]) for var in OFFLINE})
                row["bytes_offline"] = float(used[pi, bi, s])
                row["rounds"], row["converged"] = int(rounds[pi, bi, s]), bool(converged[pi, bi, s])
                records.append(row)
    return {"records": records, "seconds": seconds}


# -- transfer -----------------------------------------------------------------------------------
def _tables(records: list[dict], workload: str):
    """``({measure: [policy, budget, sample]}, policies, budgets)`` of one workload (policies in
    the order the records give them, budgets ascending)."""
    rows = [r for r in records if r["workload"] == workload]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    budgets = sorted({r["budget"] for r in rows})
    samples = sorted({r["sample"] for r in rows})
    out = {m: np.full((len(policies), len(budgets), len(samples)), np.nan) for m in [*OFFLINE, *LIVE]}
    for r in rows:
        i, j, s = policies.index(r["policy"]), budgets.index(r["budget"]), samples.index(r["sample"])
        for m, table in out.items():
            if r.get(m) is not None:
                table[i, j, s] = r[m]
    return out, policies, budgets


def _correlations(x: np.ndarray, y: np.ndarray) -> dict:
    """τ and ρ of the grid ``[policy, budget]`` flattened, and their means within each budget."""
    from scipy.stats import kendalltau, spearmanr

    def pair(a, b):
        ok = np.isfinite(a) & np.isfinite(b)
        if ok.sum() < 3 or np.ptp(a[ok]) == 0 or np.ptp(b[ok]) == 0:
            return np.nan, np.nan
        return kendalltau(a[ok], b[ok]).statistic, spearmanr(a[ok], b[ok]).statistic

    grid = pair(x.ravel(), y.ravel())
    within = np.array([pair(x[:, j], y[:, j]) for j in range(x.shape[1])])  # [budget, 2]
    means = _mean(within.T)  # [2]: τ and ρ averaged over the budgets
    return {"tau": grid[0], "rho": grid[1], "tau_within": means[0], "rho_within": means[1]}


def transfer(records: list[dict], workload: str, seed: int = 0) -> dict:
    """Every offline metric × live measure — and live KL against the task score, the reference an
    offline metric can at best reach — τ, ρ (grid and within budgets) with bootstrap 95% intervals
    over prompts."""
    tables, _, _ = _tables(records, workload)
    n = next(iter(tables.values())).shape[-1]
    draws = np.random.default_rng(seed).integers(0, n, size=(N_BOOT, n))
    pairs = [(off, live) for off in OFFLINE for live in LIVE] + [("kl", "score_loss")]
    return {f"{x}|{y}": _paired(tables[x], tables[y], draws) for x, y in pairs}


def _paired(x: np.ndarray, y: np.ndarray, draws: np.ndarray) -> dict:
    """τ, ρ of ``x`` against ``y`` (``[policy, budget, sample]``), each ``[value, low, high]``."""
    with np.errstate(all="ignore"):
        point = _correlations(_mean(x), _mean(y))
        boots = [_correlations(_mean(x[..., d]), _mean(y[..., d])) for d in draws]
    entry = {}
    for key, value in point.items():
        values = np.array([b[key] for b in boots], dtype=float)
        low, high = np.nanpercentile(values, [2.5, 97.5]) if np.isfinite(values).any() else (np.nan, np.nan)
        entry[key] = [_num(value), _num(low), _num(high)]
    return entry


def breaks(records: list[dict], workload: str, off: str, live: str, top: int = 5) -> list:
    """The grid points whose offline and live ranks differ most (rank 1 = least loss)."""
    from scipy.stats import rankdata

    tables, policies, budgets = _tables(records, workload)
    with np.errstate(all="ignore"):
        x, y = _mean(tables[off]).ravel(), _mean(tables[live]).ravel()
    cells = [(p, b) for p in policies for b in budgets]
    ok = np.flatnonzero(np.isfinite(x) & np.isfinite(y))  # cells a metric has no value for are not ranked
    x, y, cells = x[ok], y[ok], [cells[k] for k in ok]
    rx, ry = rankdata(x), rankdata(y)
    order = np.argsort(-np.abs(rx - ry))[:top]
    return [
        {"policy": cells[k][0], "budget": cells[k][1], "offline": _num(x[k]), "offline_rank": int(rx[k]),
         "live": _num(y[k]), "live_rank": int(ry[k])}
        for k in order
    ]  # fmt: skip


def _mean(x: np.ndarray) -> np.ndarray:
    """The mean over prompts (last axis), NaN where a cell has no value."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, -1)


def _num(x):
    x = float(x)
    return None if not np.isfinite(x) else round(x, 4)


# -- report -------------------------------------------------------------------------------------
def figure_points(records, workloads, best: dict) -> dict:
    """What the figure shows, per workload: the best offline metric and, per policy, its mean
    over prompts and the mean live KL at each budget (``[[offline, kl], …]``)."""
    out = {}
    for name in workloads:
        tables, policies, budgets = _tables(records, name)
        with np.errstate(all="ignore"):
            x, y = _mean(tables[best[name]]), _mean(tables["kl"])
        out[name] = {
            "metric": best[name],
            "budgets": budgets,
            "policies": {
                p: [[_num(x[i, j]), _num(y[i, j])] for j in range(len(budgets))] for i, p in enumerate(policies)
            },
        }
    return out


def figure(points: dict, path: Path) -> None:
    """Offline metric against live KL, one panel per workload (:func:`figure_points`)."""
    import matplotlib

    from kvscope.figures import axes, save

    fig, panels = axes(height=4.2 * len(points) + 1.4, nrows=len(points))
    panels = panels if len(points) > 1 else [panels]
    markers = ["o", "s", "^", "D", "v"]
    for ax, (name, p) in zip(panels, points.items()):
        colors = matplotlib.colormaps["tab20"](np.linspace(0, 1, len(p["policies"])))
        for i, (policy, cells) in enumerate(p["policies"].items()):
            for j, (x, y) in enumerate(cells):
                ax.scatter(x if x is not None else np.nan, y if y is not None else np.nan, color=colors[i],
                           marker=markers[j % len(markers)], s=36,
                           label=policy.removeprefix("press:").split(":")[0] if j == 0 else None)  # fmt: skip
        ax.set_xlabel(f"offline {OFFLINE[p['metric']]} (replay)")
        ax.set_ylabel("live KL to full KV (nats/token)")
        ax.set_yscale("log")
        ax.set_title(f"{name}: markers ○ □ △ = β {', '.join(map(str, p['budgets']))}")
    handles, labels = panels[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4)
    save(fig, path)


def summary_md(doc: dict) -> str:
    budgets = doc["budgets"]
    lines = [
        "# Offline replay vs live decoding",
        "",
        f"{doc['date']} · {doc['machine']} · `{doc['command']}`",
        "",
        (
            f"{len(doc['policies'])} policies × β {', '.join(map(str, budgets))} × {doc['prompts']} prompts per workload"
            f"{'' if 'context' not in doc else ' of ' + str(doc['context']) + ' tokens'}; "
            "τ / ρ with the live measure as a loss (+1: offline ranks as live), [95% bootstrap over prompts]."
        ),
        "",
    ]
    for name, w in doc["workloads"].items():
        full = "—" if w["score_full"] is None else f"{w['score_full']:.2f}"
        lines += [f"## {name} (full-KV score {full}, {w['steps']} new tokens)", ""]
        lines += [
            "| offline metric | live measure | τ grid | ρ grid | τ within β | ρ within β |",
            "|---|---|---|---|---|---|",
        ]
        for key, entry in w["transfer"].items():
            off, live = key.split("|")
            name = "live KL (reference)" if off == "kl" else OFFLINE[off]
            lines.append(f"| {name} | {LIVE[live]} | " + " | ".join(_cells(entry)) + " |")
        lines += ["", f"Best offline predictor of live KL within a budget: **{OFFLINE[w['best']]}**.", ""]
        lines += [_rounds_line(w["rounds"]), ""]
        lines += ["| policy | " + " | ".join(f"β {b}: {OFFLINE[w['best']]} · KL · score" for b in budgets) + " |"]
        lines += ["|---|" + "---|" * len(budgets)]
        for policy, cells in w["grid"].items():
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        breaks = [b for b in w["breaks"] if b["offline_rank"] != b["live_rank"]]
        if not breaks:
            lines += ["", f"Ranked by {OFFLINE[w['best']]}, every cell takes the rank live KL gives it.", ""]
        else:
            lines += ["", "Largest rank differences (offline vs live KL, rank 1 = least loss):", ""]
        for b in breaks:
            lines.append(
                f"- {b['policy']} at β {b['budget']}: offline rank {b['offline_rank']} ({b['offline']}), "
                f"live rank {b['live_rank']} (KL {b['live']})"
            )
        lines.append("")
    c = doc["cost"]
    lines += [
        "## Cost",
        "",
        (
            f"Offline grid (traces {c['trace_s']:.0f} s + replays {c['replay_s']:.0f} s, of which forced replay "
            f"{c.get('forced_s', 0):.0f} s) {c['offline_s']:.0f} s; live grid {c['live_s']:.0f} s: offline / live = "
            f"**{c['ratio']:.3f}**."
        ),
        "",
    ]
    return "\n".join(lines)


def _cells(entry: dict) -> list[str]:
    return [f"{v[0]:+.2f} [{v[1]:+.2f}, {v[2]:+.2f}]" if v[0] is not None else "—" for v in entry.values()]


def rounds(records: list[dict], workload: str) -> dict:
    """Forced replay's closed loops on one workload: ``{rounds: runs}`` of the sample runs, and how
    many reached their fixed point."""
    rows = [r for r in records if r["workload"] == workload and "rounds" in r]
    counts: dict[int, int] = {}
    for r in rows:
        counts[r["rounds"]] = counts.get(r["rounds"], 0) + 1
    return {"runs": len(rows), "converged": sum(bool(r["converged"]) for r in rows),
            "by_rounds": {str(k): counts[k] for k in sorted(counts)}}  # fmt: skip


def _rounds_line(r: dict) -> str:
    spread = ", ".join(f"{n} in {k} round{'s' * (k != '1')}" for k, n in r["by_rounds"].items())
    return (
        f"Forced replay: {r['converged']} of {r['runs']} runs (policy × budget × prompt) reached the fixed point of "
        f"their closed loop ({spread}; a round is one forward of a chunk)."
    )


def grid_cells(records, name, best) -> dict:
    tables, policies, budgets = _tables(records, name)
    with np.errstate(all="ignore"):
        means = {m: _mean(t) for m, t in tables.items()}
    out = {}
    for i, policy in enumerate(policies):
        out[policy] = [
            f"{means[best][i, j]:.3f} · {means['kl'][i, j]:.3f} · {1 - means['score_loss'][i, j]:.2f}"
            for j in range(len(budgets))
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10, help="prompts per workload")
    ap.add_argument("--budgets", default="0.2,0.3,0.5")
    ap.add_argument("--policies", default=",".join(POLICIES))
    add_arguments(ap)  # --context, --workloads, --model, --seed, --results as every study takes them
    ap.set_defaults(workloads="niah,passkey,vt_chains")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--steps", type=int, help="new tokens decoded per prompt (default: per workload, " + str(STEPS) + ")"
    )
    ap.add_argument("--workers", type=int, default=2, help="processes (live) and threads (replay)")
    ap.add_argument("--figure", default=str(ROOT / "docs" / "figures" / "offline_vs_live.png"))
    ap.add_argument("--report", help="a summary.json of an earlier run: its analysis again, without decoding")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "offline-vs-live.md"), help="the summary, for the docs")
    args = ap.parse_args()
    args.budgets = [float(b) for b in args.budgets.split(",")]
    args.policies = args.policies.split(",")
    folder = Path(args.results) / "offline_vs_live"
    if args.report:
        report(json.loads(Path(args.report).read_text()), folder, Path(args.doc), Path(args.figure))
        return
    from kvscope import workloads

    folder.mkdir(parents=True, exist_ok=True)
    names = args.workloads.split(",")
    prompts = {}
    for name in names:
        recipe = workloads.get(name).recipe
        new = steps(args, name)
        items = workloads.prompts_for_model(
            name, args.model, context=args.context, seed=args.seed, samples=args.prompts, max_new_tokens=new
        )
        prompts[name] = (items, bool(recipe.get("chat", False)))
    offline, offline_s, parts = offline_grid(args, prompts, folder / "traces")
    print(f"offline grid: {offline_s:.0f} s", file=sys.stderr)
    live, live_s = live_grid(args, prompts)
    records = _merge(offline, live)
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": _machine(args),
        "command": " ".join(["python analyses/offline_vs_live.py", *sys.argv[1:]]),
        "budgets": args.budgets,
        "policies": args.policies,
        "prompts": args.prompts,
        "context": args.context,
        "horizon": HORIZON,
        "cost": {
            "offline_s": offline_s,
            "live_s": live_s,
            "ratio": offline_s / live_s,
            "trace_s": sum(p["trace"] for p in parts.values()),
            "replay_s": sum(p["replay"] for p in parts.values()),
            "forced_s": sum(p["forced"] for p in parts.values()),
        },
        "workloads": {name: {"steps": steps(args, name)} for name in names},
        "records": records,
    }
    report(doc, folder, Path(args.doc), Path(args.figure))


def report(doc: dict, folder: Path, page: Path, figure_path: Path) -> None:
    """The transfer analysis of ``doc``'s records → ``folder``/summary.{json,md}, ``page``,
    ``figure_path`` (``--report``: again from a summary.json, without decoding)."""
    records, names, best = doc["records"], list(doc["workloads"]), {}
    for name in names:
        table = transfer(records, name)
        best[name] = max(OFFLINE, key=lambda m, t=table: t[f"{m}|kl"]["tau_within"][0] or -2)
        full = {
            r["sample"]: r["score_full"] for r in records if r["workload"] == name and r.get("score_full") is not None
        }
        doc["workloads"][name] |= {
            "score_full": float(np.mean(list(full.values()))) if full else None,
            "transfer": table,
            "best": best[name],
            "breaks": breaks(records, name, best[name], "kl"),
            "rounds": rounds(records, name),
            "grid": grid_cells(records, name, best[name]),
        }
    doc["figure"] = figure_points(records, names, best)  # what the figure plots: the page's means
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(doc, indent=1))
    (folder / "summary.md").write_text(summary_md(doc))
    page.write_text(summary_md(doc))
    figure(doc["figure"], figure_path)
    print(summary_md(doc))


def _merge(offline: list[dict], live: list[dict]) -> list[dict]:
    """One record per (workload, sample, policy, budget) with offline metrics and live measures."""

    def key(r):
        return r["workload"], r["sample"], r["policy"], r["budget"]

    merged = {key(r): dict(r) for r in offline}
    for r in live:
        row = merged.setdefault(key(r), {k: r[k] for k in ("workload", "sample", "policy", "budget")})
        row.update({k: v for k, v in r.items() if k not in row})
        row["disagreement"] = 1 - r["agreement"]
        row["score_loss"] = None if r["score"] is None else 1 - r["score"]
    return list(merged.values())


def _machine(args) -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    return f"{platform.system()} {cpu}, {os.cpu_count()} CPUs, device {args.device}, {args.workers} workers"


if __name__ == "__main__":
    main()
