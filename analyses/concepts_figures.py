"""The figures of docs/concepts.md, drawn from the toy trace of that page
(``kvscope.storage.synthetic.toy_trace``) and LogQuant's index lists.

    python analyses/concepts_figures.py [--out docs/figures]
        → concepts_toy_trace.png, concepts_policies.png, concepts_logquant.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def toy_trace_figure(ds):
    """Decode step × key position of the toy trace, each probability written in its cell, the
    sinks and windows marked, the query's own key outlined."""
    from matplotlib.patches import Rectangle

    from kvscope.figures import axes

    a = ds["attn"].values[0, :, 0, 0]  # [step, pos]
    qpos = ds["query_pos"].values[0]
    n_sink, w = ds.attrs["n_sink"], ds.attrs["w"]
    fig, ax = axes(height=3.9)
    ax.imshow(np.ma.masked_invalid(a), cmap="Blues", vmin=0, vmax=0.6, aspect="auto")
    for t, p in np.argwhere(np.isfinite(a) & (a > 0)):
        ax.text(p, t, f"{a[t, p]:.2f}".lstrip("0"), ha="center", va="center", fontsize=9,
                color="white" if a[t, p] > 0.3 else "black")  # fmt: skip
    for t, q in enumerate(qpos):
        ax.add_patch(Rectangle((q - 0.5, t - 0.5), 1, 1, fill=False, edgecolor="#c44e52", lw=1.5))
    edges = [n_sink + j * w for j in range((a.shape[1] - n_sink) // w + 1)]
    for x in edges:
        ax.axvline(x - 0.5, color="0.3", lw=1)
    top = ax.secondary_xaxis("top")
    centers = [(n_sink - 1) / 2] + [e + (w - 1) / 2 for e in edges[:-1]]
    top.set_xticks(centers, ["sinks"] + [f"window {j}" for j in range(len(edges) - 1)])
    top.tick_params(length=0)
    ax.set_xticks(range(a.shape[1]))
    ax.set_yticks(range(a.shape[0]), [f"{t} (event)" if t % w == 0 else str(t) for t in range(a.shape[0])])
    ax.set_xlabel("key position p (red: the query's own position; blank: not yet attended)")
    ax.set_ylabel("decode step t")
    return fig


def policies_figure(ds):
    """The tiers of streaming, H2O and the oracle at β = 0.5 and of QEvict at β = 0.75 after the
    toy's two events (kvscope.plots.plot_tiers)."""
    import kvscope
    from kvscope.figures import axes
    from kvscope.plots import plot_tiers

    runs = [("streaming", 0.5), ("h2o", 0.5), ("oracle", 0.5), ("qevict:local=0:q_frac=0.3", 0.75)]
    fig, panels = axes(height=7.2, nrows=len(runs))
    for ax, (policy, budget) in zip(panels, runs, strict=True):
        r = kvscope.replay(ds, [policy], [budget], horizon=3)
        plot_tiers(r, policy, budget, layer=0, sample=0, ax=ax)
        ax.set_yticks([0, 1], ["step 0", "step 4"])
        ax.set_ylabel("event")
        ax.set_title(f"{policy.split(':')[0]} at β = {budget}")
    for ax in panels[:-1]:
        ax.set_xlabel("")
    return fig


def logquant_figure(prompt_len: int = 20, last: int = 139, W: int = 8):
    """LogQuant's FP set (reserve ∪ local) and its quantized positions at every step."""
    from matplotlib.colors import ListedColormap

    from kvscope.figures import TIER_COLORS, axes
    from kvscope.policies.logquant import fp_sets_per_step

    steps = last - prompt_len + 2  # step t's query sits at prompt_len − 1 + t
    grid = np.full((steps, last + 1), -1)
    for t, fp in enumerate(fp_sets_per_step(prompt_len, steps, W)):
        grid[t, : prompt_len + t] = 1  # everything that exists is Q ...
        grid[t, fp] = 2  # ... but the FP set
    fig, ax = axes(height=4.4)
    cmap = ListedColormap([TIER_COLORS[t] for t in ("none", "Q", "FP")])
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-1.5, vmax=2.5)
    ax.set_xlabel("key position")
    ax.set_ylabel("decode step")
    ax.set_title(f"LogQuant, W = {W}, prompt of {prompt_len}: FP (blue) and 2-bit (orange) positions")
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    args = ap.parse_args()
    from kvscope.figures import save
    from kvscope.storage.synthetic import toy_trace

    out = Path(args.out)
    ds = toy_trace()
    save(toy_trace_figure(ds), out / "concepts_toy_trace.png")
    save(policies_figure(ds), out / "concepts_policies.png")
    save(logquant_figure(), out / "concepts_logquant.png")


if __name__ == "__main__":
    main()
