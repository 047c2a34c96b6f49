"""Summaries of analysis results for the CLI: a JSON-able dict and table rows."""

from __future__ import annotations

import math

import numpy as np


def _f(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else round(x, 6)


def _list(da) -> list:
    return [_f(v) for v in np.asarray(da).ravel()]


def summary(name: str, r) -> dict:
    """The headline numbers of one analysis result (``r`` an xarray Dataset)."""
    base = {"analysis": name, **{k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in r.attrs.items()}}
    if name == "fmm":
        return {
            **base,
            "fmm": _f(r["mean"]),
            "ci95": [_f(r["ci_low"]), _f(r["ci_high"])],
            "n_events": int(r["n_events"]),
            "n_censored": int(r["n_censored"]),
            "curve": {str(int(h)): _f(v) for h, v in zip(r["horizon"].values, r["curve"].values)},
            "per_layer": _list(r["fmm_layer"]),
            **({"tier_mass": dict(zip(["FP", "Q", "EVICTED"], _list(r["tier_mean"])))} if "tier_mean" in r else {}),
        }
    if name == "churn":
        return {
            **base,
            "churn": _f(r["mean"]),
            "ci95": [_f(r["ci_low"]), _f(r["ci_high"])],
            "per_layer": _list(r["churn_layer"]),
            "over_time": _list(r["churn_over_time"]),
        }
    if name == "lir":
        return {
            **base,
            "lir": _f(r["lir"]),
            "ci95": [_f(r["ci_low"]), _f(r["ci_high"])],
            "eligible": int(r["n_eligible"]),
            "reactivated": int(r["n_reactivated"]),
            "p01": _f(r["p01"]),
            "p10": _f(r["p10"]),
            "per_layer": _list(r["lir_layer"]),
        }
    if name == "peaks":
        return {
            **base,
            "alpha": _f(r["alpha"]),
            "ci95": [_f(r["alpha_low"]), _f(r["alpha_high"])],
            "lambda": _f(r["lambda"]),
            "aic": dict(zip(r["model"].values.tolist(), _list(r["aic"]))),
            "n_peaks": int(r["n_peaks"]),
            "n_rows": int(r["n_rows"]),
            "log2_bins": [
                {"from": int(lo), "count": int(c), "exposure": int(e), "density": _f(d)}
                for lo, c, e, d in zip(
                    r["bin_low"].values, r["count"].values, r["exposure"].values, r["density"].values
                )
            ],
            "alpha_per_layer": _list(r["alpha_layer"]),
            "coverage_logquant_per_layer": _list(r["coverage_logquant"]),
            "coverage_recency_per_layer": _list(r["coverage_recency"]),
            "coverage_logquant": _f(np.nanmean(r["coverage_logquant"].values)),
            "coverage_recency": _f(np.nanmean(r["coverage_recency"].values)),
        }
    if name == "concentration":
        return {
            **base,
            "top_share": {f"{p:.0%}": _f(v) for p, v in zip(r["top_frac"].values, r["top_share_mean"].values)},
            "windows_needed": {f"{q:.0%}": _f(v) for q, v in zip(r["mass_level"].values, r["needed_mean"].values)},
        }
    if name == "drift":
        return {
            **base,
            "returning_windows": int(r["returning"].sum()),
            "windows": int(r.sizes["window"]),
            "churn_over_time": _list(r["churn_over_time"]),
        }
    raise KeyError(name)


def table_rows(name: str, s: dict) -> list[tuple[str, str]]:
    """(quantity, value) rows for a readable table."""

    def ci(key="ci95"):
        lo, hi = s[key]
        return f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else ""

    def num(x, fmt=".3f"):
        return "n/a" if x is None else format(x, fmt)

    if name == "fmm":
        rows = [
            (f"FMM@{s['H']} ({s['selection']}, top {s['top_frac']:.0%}, local {s['local']})", num(s["fmm"]) + ci()),
            ("events scored / censored", f"{s['n_events']} / {s['n_censored']}"),
        ]
        rows += [(f"FMM(H={h})", num(v)) for h, v in s["curve"].items()]
        return rows
    if name == "churn":
        return [("mean churn (Jaccard distance)", num(s["churn"]) + ci())]
    if name == "lir":
        return [
            (f"Global LIR (m={s['m']}, H_lir={s['H_lir']})", num(s["lir"]) + ci()),
            ("episodes eligible / reactivated", f"{s['eligible']} / {s['reactivated']}"),
            (f"P01 cold→hot (δ={s['delta']})", num(s["p01"])),
            ("P10 hot→cold", num(s["p10"])),
        ]
    if name == "peaks":
        rows = [
            (f"α (power law, top-{s['k']} peaks)", num(s["alpha"]) + ci()),
            ("best model by AIC", s["best_model"]),
            (
                "AIC power / exponential / uniform",
                " / ".join(num(s["aic"][m], ".1f") for m in ("power", "exponential", "uniform")),
            ),
            (
                f"coverage LogQuant FP set (W={s['logquant_W']}) vs recency",
                f"{num(s['coverage_logquant'])} vs {num(s['coverage_recency'])}",
            ),
        ]
        rows += [(f"density d∈[{b['from']}, {2 * b['from']})", num(b["density"], ".4g")) for b in s["log2_bins"]]
        return rows
    if name == "concentration":
        return [(f"mass in top {k} windows", num(v)) for k, v in s["top_share"].items()] + [
            (f"windows needed for {k} of mass", num(v)) for k, v in s["windows_needed"].items()
        ]
    if name == "drift":
        return [
            ("windows that left and re-entered the top set", str(s["returning_windows"])),
            ("windows", str(s["windows"])),
        ]
    raise KeyError(name)
