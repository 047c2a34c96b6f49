"""The shape of the house: one attention rule, one policy driver, metrics as objects in a
registry, plots without global state, and the two scientific defects fixed (issue 12)."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvscope
from kvscope import analysis as A
from kvscope.errors import KvscopeError
from kvscope.model.attention import AttentionRule
from kvscope.storage.synthetic import dataset_from_rows

from .conftest import ROOT
from .test_capture import PROMPT, eager_attentions, stored_tokens

# -- one attention rule -----------------------------------------------------------------------


def reference_probs(q, k, q_pos, k_pos, scaling, softcap, window):
    """The rule written out in numpy, float64: softcap(q·k·scaling), visible = p ≤ q ∧ q − p < window."""
    logits = np.einsum("rd,kd->rk", q.astype(np.float64), k.astype(np.float64)) * scaling
    if softcap:
        logits = softcap * np.tanh(logits / softcap)
    shown = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= 0)
    if window:
        shown &= q_pos[:, None] - k_pos[None, :] < window
    logits = np.where(shown, logits, -np.inf)
    with np.errstate(invalid="ignore"):
        e = np.exp(logits - logits.max(-1, keepdims=True))
        probs = e / e.sum(-1, keepdims=True)
    return np.nan_to_num(probs)


@settings(max_examples=40, deadline=None)
@given(
    n_q=st.integers(1, 6),
    n_k=st.integers(1, 12),
    softcap=st.sampled_from([None, 5.0, 50.0]),
    window=st.sampled_from([None, 1, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_the_rule_equals_its_numpy_definition(n_q, n_k, softcap, window, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_q, 16)).astype(np.float32) * 2
    k = rng.standard_normal((n_k, 16)).astype(np.float32) * 2
    q_pos = rng.integers(-1, n_k + 2, n_q)  # −1: a query before any key (all hidden: zeros)
    k_pos = np.arange(n_k)
    rule = AttentionRule(0.25, softcap, window)
    got = rule.probs(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(q_pos)[:, None], torch.from_numpy(k_pos)
    )
    expected = reference_probs(q, k, q_pos, k_pos, 0.25, softcap, window)
    np.testing.assert_allclose(got.numpy(), expected, atol=2e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral_sliding", "gemma2"])
def test_the_rule_of_every_layer_equals_eager(tmp_path, tiny_models, kind):
    """Recorded post-RoPE q/k through ``ModelSpec.rule(layer)`` give the model's own eager
    attention for every position (sliding windows of 8 and Gemma 2's softcap included)."""
    out = tmp_path / "t.zarr"
    model = str(tiny_models[kind])
    kvscope.trace(PROMPT, out, model=model, max_new_tokens=10, dtype="float32", record_qkv=True, stop_at_eos=False)
    ds = kvscope.open_trace(out)
    spec = ds.kvscope.model
    tokens = stored_tokens(ds)[:-1]  # the last token is never attended from: no q/k of it
    T = len(tokens)
    ref = eager_attentions(tiny_models[kind], tokens)  # [layer, head, T, T]
    q = torch.from_numpy(ds.q.values[0, :T])  # [qpos, layer, head, D]
    k = torch.from_numpy(ds.k.values[0, :, :, :T])  # [layer, kv_head, pos, D]
    pos = torch.arange(T)
    assert spec.global_only == (kind not in ("mistral_sliding", "gemma2"))
    for layer in range(spec.n_layers):
        rule = spec.rule(layer)
        for h in range(spec.n_heads):
            got = rule.probs(q[:, layer, h], k[layer, h // spec.group], pos[:, None], pos)
            np.testing.assert_allclose(got.numpy(), ref[layer, h], atol=1e-5)


def test_the_stacked_rules_equal_each_layer_alone():
    rules = kvscope.model.spec.ModelSpec(
        3,
        4,
        2,
        8,
        sliding_window=4,
        layer_types=("full_attention", "sliding_attention", "full_attention"),
        attn_logit_softcapping=20.0,
    ).rules()
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.standard_normal((3, 2, 2, 8)).astype(np.float32))  # [L, Hkv, g, D]
    k = torch.from_numpy(rng.standard_normal((3, 2, 12, 8)).astype(np.float32))  # [L, Hkv, n, D]
    stacked = rules.probs(q, k, 11)
    for layer, rule in enumerate(rules.rules):
        alone = rule.probs(q[layer], k[layer], torch.tensor(11), torch.arange(12))
        np.testing.assert_allclose(stacked[layer].numpy(), alone.numpy(), atol=1e-7)
    assert (stacked[1, ..., :8] == 0).all() and (stacked[0, ..., :8] > 0).all()  # layer 1 slides over 4


# -- one policy driver ------------------------------------------------------------------------


@dataclass
class _Liar(kvscope.policies.Policy):
    """Keeps everything and claims to fit any budget."""

    name: ClassVar[str] = "liar"
    kind: ClassVar[str] = "test"

    def start(self, spec, k=None, v=None, rope=None):
        return kvscope.policies.CacheState(self, spec)


def test_the_driver_enforces_the_budget_for_every_caller():
    from kvscope.policies import BudgetExceeded, CacheSpec, PolicyDriver

    spec = CacheSpec(2, 1, 8, 20, 24, 0.5)
    driver = PolicyDriver(_Liar().start(spec), where=" of sample 0")
    with pytest.raises(BudgetExceeded, match=r"liar used 640 bytes in layer 0, kv_head 0 at step 0 of sample 0, over its share 384"):
        driver.prefill(np.zeros((2, 1, 20)), None)
    fits = PolicyDriver(kvscope.policies.make("streaming").start(spec))
    used = fits.prefill(np.zeros((2, 1, 20)), None)
    assert used.max() <= spec.capacity and fits.step == 0
    fits.append(20)
    assert fits.decide().max() <= spec.capacity and fits.step == 1


def test_replay_and_the_live_cache_share_the_driver():
    import inspect

    from kvscope.live import cache
    from kvscope.replay import sample

    assert "PolicyDriver(" in inspect.getsource(cache.PolicyCache) and "PolicyDriver(" in inspect.getsource(sample)
    for module in (cache, sample):  # neither drives a state by hand any more
        source = inspect.getsource(module)
        assert ".compress()" not in source and ".observe(" not in source


# -- metrics as objects -----------------------------------------------------------------------


def _rows_trace(n_samples=2, n_steps=12, prompt=16, n_layers=2, n_kv=2, seed=0):
    rng = np.random.default_rng(seed)
    T = prompt + n_steps
    attn = np.full((n_samples, n_steps, n_layers, n_kv, T), np.nan, dtype=np.float32)
    for s in range(n_samples):
        for t in range(n_steps):
            q = prompt - 1 + t
            p = rng.random((n_layers, n_kv, q + 1)) ** 4
            attn[s, t, :, :, : q + 1] = p / p.sum(-1, keepdims=True)
    return dataset_from_rows(attn, prompt_len=prompt, w=4, n_sink=2)


@dataclass(kw_only=True)
class Toy(A.UnitMetric):
    """Mean per-step mass of the newest existing window, at each event."""

    name: ClassVar[str] = "toy"
    title: ClassVar[str] = "newest-window mass (a test metric)"
    scale: float = kvscope.params.param(1.0, low=0, help="multiplies the mass")

    def width(self, run):
        return len(run.steps)

    def per_unit(self, u, run):
        newest = np.maximum(u.units.n_existing(u.query_pos[run.steps]) - 1, 0)  # [event]
        return self.scale * u.m[..., run.steps, newest]  # [H, event]

    def reduce(self, flat, run):
        import xarray as xr

        return xr.Dataset({"newest": float(np.nanmean(flat))}, attrs=self.attrs(run))

    def summary(self, r):
        return {**self.base_summary(r), "newest": float(r["newest"])}

    def table(self, doc):
        return [("newest-window mass", f"{doc['newest']:.4f}")]


def test_a_registered_metric_shows_up_in_the_cli_and_its_json(tmp_path, capsys):
    from kvscope.cli import main
    from kvscope.storage.synthetic import write_synthetic_store

    store = write_synthetic_store(tmp_path / "s.zarr", n_samples=1, n_steps=16, n_layers=2, n_kv=2, prompt_len=24)
    A.register(Toy)
    try:
        assert main(["analyze", "toy", str(store), "--json", "--scale", "2"]) == 0
        doc = json.loads(capsys.readouterr().out)
        expected = 2 * float(Toy()(kvscope.open_trace(store))["newest"])
        assert doc["analysis"] == "toy" and doc["scale"] == 2.0 and doc["newest"] == pytest.approx(expected)
        assert main(["analyze", "toy", str(store), "--scale", "-1"]) == 2
        assert "toy --scale must be ≥ 0 (got -1.0)" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(["analyze", "--help"])
        assert "toy" in capsys.readouterr().out
    finally:
        del A.METRICS["toy"]


def test_metric_parameters_are_checked_on_construction():
    for name, params, words in [
        ("fmm", {"horizon": 0}, "fmm --horizon must be ≥ 1 (got 0)"),
        ("churn", {"top_frac": 1.0}, "churn --top-frac must lie in (0, 1) (got 1.0)"),
        ("lir", {"h_lir": 0}, "lir --h-lir must be ≥ 1 (got 0)"),
        ("peaks", {"k": 2.5}, "peaks --top-k must be an integer (got 2.5)"),
        ("fmm", {"n_boot": 0}, "fmm --bootstrap must be ≥ 1 (got 0)"),
        ("fmm", {"layers": []}, "fmm --layers must list indices"),
        ("concentration", {"every": -1}, "concentration --every must be ≥ 1 (got -1)"),
        ("fmm", {"top_frac": float("nan")}, "must be a finite number"),
        ("fmm", {"resample": "prompts"}, "must be one of samples, units"),
    ]:
        with pytest.raises(KvscopeError) as err:
            A.make(name, **params)
        assert words in str(err.value)


def test_every_metric_has_one_set_of_defaults():
    from kvscope import defaults

    assert A.FMM().horizon == defaults.HORIZON and A.Churn().top_frac == defaults.TOP_FRAC
    assert A.LIR().local == defaults.LOCAL == kvscope.policies.QEvict().local
    assert A.Peaks().k == defaults.PEAKS_TOP_K and kvscope.policies.Oracle().horizon == defaults.HORIZON


def test_plots_return_figures_without_touching_the_backend(tmp_path):
    """Every metric's figure and the replay figures in a fresh process: Figures come back,
    pyplot is never imported and the backend stays what the process had."""
    code = f"""
import sys, matplotlib
matplotlib.use("svg")
import numpy as np, kvscope
from kvscope import analysis as A
from kvscope.plots import plot_compare, plot_tiers
from kvscope.storage.synthetic import write_synthetic_store
from matplotlib.figure import Figure
store = write_synthetic_store({str(tmp_path / "s.zarr")!r}, n_samples=2, n_steps=40, n_layers=2, n_kv=2, prompt_len=30)
ds = kvscope.open_trace(store)
figures = []
for name, cls in A.available().items():
    metric = cls(n_boot=20) if "n_boot" in cls.__dataclass_fields__ else cls()
    figures.append(metric.plot(metric(ds)))
r = kvscope.replay(ds, ["streaming", "h2o"], [0.3, 0.5], n_boot=20)
figures += [plot_compare(r), plot_tiers(r, "h2o", 0.3)]
assert all(isinstance(f, Figure) for f in figures), figures
assert "matplotlib.pyplot" not in sys.modules
figures[0].savefig({str(tmp_path / "fmm.png")!r})
print(matplotlib.get_backend(), len(figures))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["svg", str(len(A.available()) + 2)]
    assert (tmp_path / "fmm.png").read_bytes()[:4] == b"\x89PNG"


# -- the two scientific defects ---------------------------------------------------------------


def test_the_history_oracle_counts_the_last_prompt_row_once():
    """Step 0's row is the prompt's last row, which the column sums already hold. Here it puts
    0.9 on window 0; the column sums (that row included) give window 0 1.0 and window 1 1.05:
    the oracle must keep window 1 (counting the row twice made window 0 1.9 and kept it)."""
    n_steps, T = 3, 8 + 3
    attn = np.full((1, n_steps, 1, 1, T), np.nan, dtype=np.float32)
    for t in range(n_steps):
        attn[0, t, 0, 0, : 8 + t] = 0
    attn[0, 0, 0, 0, 0], attn[0, 0, 0, 0, 4] = 0.9, 0.1  # step 0 = the last prompt row
    attn[0, 1:, 0, 0, 7] = 1.0  # later rows look elsewhere (window 1, last position)
    prefill = np.zeros((1, 1, 1, T), dtype=np.float32)
    prefill[0, 0, 0, 0], prefill[0, 0, 0, 4] = 1.0, 1.05  # column sums incl. the last row's 0.9 / 0.1
    ds = dataset_from_rows(attn, prompt_len=8, prefill_colsum=prefill, w=4, n_sink=0)
    sel = A.Prepared(ds, A.Units("window", 4, 0)).history_selection(every=4, top_frac=0.5, local=0)
    np.testing.assert_array_equal(sel.values[0, 0, 0, 0, :2], [0, 1])
    scores = A.cumulative_scores(
        A.unit_mass(ds, A.Units("window", 4, 0)), A.prefill_unit_mass(ds, A.Units("window", 4, 0))
    )
    np.testing.assert_allclose(scores.values[0, :, 0, 0, 0], [1.0, 1.0, 1.0])  # window 0 never counts 0.9 twice
    np.testing.assert_allclose(scores.values[0, :, 0, 0, 1], [1.05, 2.05, 3.05])


def test_step_zero_is_the_last_prefill_row(tmp_path, tiny_models):
    """On a real trace the row of step 0 and the last stored prompt row are the same numbers."""
    out = tmp_path / "t.zarr"
    kvscope.trace(PROMPT, out, model=str(tiny_models["llama"]), max_new_tokens=4, stop_at_eos=False)
    ds = kvscope.open_trace(out)
    np.testing.assert_array_equal(ds.attn.values[0, 0], ds.prefill_tail.values[0, :, :, -1])


def test_intervals_resample_prompts_by_default():
    """Two prompts, every unit of one at 0.1 and of the other at 0.9: prompts disagree, so the
    interval must span them; resampling the 20 units as if independent hides that."""
    num = np.concatenate([np.full((1, 10), 0.1), np.full((1, 10), 0.9)])  # [sample, unit]
    den = np.ones((2, 10))
    est, lo, hi = A.bootstrap_ratio(num, den, n_boot=400, seed=1)
    assert est == pytest.approx(0.5) and lo == pytest.approx(0.1) and hi == pytest.approx(0.9)
    _, ulo, uhi = A.bootstrap_ratio(num, den, n_boot=400, seed=1, resample="units")
    assert 0.25 < ulo < 0.5 < uhi < 0.75  # the within-prompt interval is far narrower
    one = A.bootstrap_ratio(num[:1], den[:1], n_boot=50)
    assert one[0] == pytest.approx(0.1) and math.isnan(one[1]) and math.isnan(one[2])


def test_every_result_says_which_interval(tmp_path):
    two = _rows_trace(n_samples=2)
    one = _rows_trace(n_samples=1)
    assert A.fmm(two, horizon=4, n_boot=50).attrs["ci"] == "bootstrap over 2 samples (prompts)"
    r = A.fmm(one, horizon=4, n_boot=50)
    assert r.attrs["ci"] == "none: one sample, so no between-prompt interval" and np.isnan(float(r["ci_low"]))
    units = A.fmm(one, horizon=4, n_boot=50, resample="units")
    assert units.attrs["ci"].startswith("bootstrap over 4 trace units") and np.isfinite(float(units["ci_low"]))
    p = A.peaks(one, n_boot=10)
    assert p.attrs["ci"].startswith("none") and np.isnan(float(p["alpha_low"]))
    doc = A.Churn(n_boot=50).summary(A.churn(one, n_boot=50))
    assert doc["ci"].startswith("none") and doc["ci95"] == [None, None]
    from kvscope.storage.synthetic import write_synthetic_store

    store = write_synthetic_store(tmp_path / "s.zarr", n_samples=2, n_steps=16, n_layers=2, n_kv=2, prompt_len=24)
    replayed = kvscope.replay(store, ["h2o"], [0.5], n_boot=50)
    assert replayed.attrs["ci"] == "bootstrap over 2 samples (prompts)" and replayed.attrs["resample"] == "samples"


# -- calls pass their arguments on by keyword -------------------------------------------------


def test_no_call_passes_more_than_four_arguments_by_position():
    """A call to a function, method or class defined in kvscope passes at most four arguments by
    position, the rest by keyword (``*args`` not counted). Callees are matched by name, not
    resolved: a library call whose name kvscope also defines (``tensor.view``, ``xr.Dataset.transpose``,
    ``Client.submit``) counts too, and passes its arguments as one tuple, a ``*`` or by keyword."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8"), str(path)) for path in (ROOT / "kvscope").rglob("*.py")}
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    defined = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, defs)}
    found = []
    for path, tree in sorted(trees.items()):
        for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
            func = call.func
            callee = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            n = sum(not isinstance(arg, ast.Starred) for arg in call.args)
            if callee in defined and n > 4:
                found.append((path.relative_to(ROOT).as_posix(), call.lineno, f"{callee} ({n} positional)"))
    assert not found, "pass the arguments after the fourth by keyword:\n" + "\n".join(
        f"{path}:{line}: {what}" for path, line, what in sorted(found)
    )
