"""Task accuracy per task and per policy (docs/concepts.md#task-accuracy): ``report.task_accuracy``,
the figure of accuracy against β (``plots.plot_accuracy``, and ``plot_compare``'s panels), the
samples a policy loses or gains against full KV (``report.answer_table``, the explorer's table) —
all on a small result built by hand, whose accuracies are written out below."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from kvscope import figures
from kvscope.plots import plot_accuracy, plot_compare, spanning
from kvscope.report import answer_table, sample_tasks, task_accuracy, task_names

nan = np.nan
POLICIES, KINDS = ["full", "h2o", "snapkv"], ["full", "eviction", "eviction"]
BUDGETS = [0.2, 0.5]
TASKS = ["a", "a", "a", "b", "b", "", ""]  # sample 5 without a task, sample 6 without an answer
# answer_exact [policy, budget, sample]
EXACT = np.array([
    [[1, 1, 0, 1, 0, 1, nan], [1, 1, 0, 1, 0, 1, nan]],  # full: full KV's own answers at every β
    [[1, 0, 0, 1, 0, 0, nan], [1, 1, 0, 1, 1, 1, nan]],  # h2o: loses sample 1 at 0.2, gains sample 4 at 0.5
    [[0, 0, 0, 0, 0, 0, nan], [1, 1, 1, 1, 0, 1, nan]],  # snapkv: gains sample 2 at 0.5
])  # fmt: skip
FULL = np.array([1, 1, 0, 1, 0, 1, nan])  # answer_exact_full [sample]
REACHED = np.array([[False, False], [True, True], [False, True]])  # budget_reached [policy, budget]


def result_with_answers(tasks=TASKS) -> xr.Dataset:
    """What ``plot_compare`` and the answer views read of a replay result with answers (one
    allocation, 7 samples), every number by hand."""
    run = ("policy", "allocation", "budget")
    exact = EXACT[:, None]  # [policy, allocation, budget, sample]
    graded = np.isfinite(exact)
    mean = np.where(graded, exact, 0).sum(-1) / graded.sum(-1)
    fmm = np.array([[[0.0, 0.0]], [[0.4, 0.2]], [[0.5, 0.1]]])
    tier_mean = np.stack([1 - fmm, np.zeros_like(fmm), fmm], -1)  # [*run, tier]
    return xr.Dataset(
        {
            "answer_exact": (run + ("sample",), exact),
            "answer_exact_full": (("sample",), FULL),
            "accuracy": (run, mean),
            "accuracy_ci_low": (run, mean - 0.1),
            "accuracy_ci_high": (run, mean + 0.1),
            "budget_reached": (run, REACHED[:, None]),
            "byte_ratio_used": (run, np.array([[[1.0, 1.0]], [[0.2, 0.5]], [[0.25, 0.5]]])),
            "fmm_fp_mean": (run, fmm),
            "fmm_fp_ci_low": (run, fmm),
            "fmm_fp_ci_high": (run, fmm),
            "tier_mean": (run + ("tier",), tier_mean),
        },
        coords={
            "policy": POLICIES,
            "policy_name": ("policy", POLICIES),
            "policy_kind": ("policy", KINDS),
            "allocation": ["uniform"],
            "budget": BUDGETS,
            "sample": np.arange(7),
            "task": ("sample", tasks),
            "tier": ["FP", "Q", "EVICTED"],
        },
        attrs={"horizon": 32, "resample": "samples"},
    )


def test_samples_take_their_task_and_the_accuracy_of_each_task_is_its_samples_mean():
    result = result_with_answers()
    assert sample_tasks(result).tolist() == ["a", "a", "a", "b", "b", "no task", "no task"]
    assert task_names(result) == ["a", "b", "no task"]  # sample 6 has no answer: no panel of its own
    table = task_accuracy(result)
    acc = table["accuracy"].sel(allocation="uniform")  # [policy, budget, task]
    # by hand: a = samples 0–2, b = 3–4, no task = 5
    np.testing.assert_allclose(acc.sel(policy="h2o").values, [[1 / 3, 1 / 2, 0], [2 / 3, 1, 1]])
    np.testing.assert_allclose(acc.sel(policy="snapkv").values, [[0, 0, 0], [1, 1 / 2, 1]])
    assert table["n"].values.tolist() == [3, 2, 1]
    np.testing.assert_allclose(table["accuracy_full"].values, [2 / 3, 1 / 2, 1])
    # a bootstrap over the task's samples: all equal → no spread; h2o's [1, 0, 0] spans 0 … 1
    snap = table.sel(policy="snapkv", allocation="uniform", budget=0.2, task="a")
    assert (float(snap["ci_low"]), float(snap["ci_high"])) == (0.0, 0.0)
    h2o = table.sel(policy="h2o", allocation="uniform", budget=0.2, task="a")
    assert (float(h2o["ci_low"]), float(h2o["ci_high"])) == (0.0, 1.0)


def test_one_task_holding_every_sample_is_the_results_own_accuracy_and_ci():
    result = result_with_answers(tasks=[""] * 7)
    assert task_names(result) == ["all"]
    table = task_accuracy(result).isel(task=0)
    for name, stored in (("accuracy", "accuracy"), ("ci_low", "accuracy_ci_low"), ("ci_high", "accuracy_ci_high")):
        np.testing.assert_array_equal(table[name].values, result[stored].values)
    no_coordinate = result.drop_vars("task")  # a result written before the task coordinate
    assert sample_tasks(no_coordinate).tolist() == ["all"] * 7


def _panel(fig, task: str):
    (ax,) = [ax for ax in fig.axes if ax.get_title().split("\n")[0] == task]
    return ax


def _lines(ax) -> dict[str, tuple[list, list]]:
    return {
        ln.get_label(): (np.asarray(ln.get_xdata()).tolist(), np.asarray(ln.get_ydata()).tolist()) for ln in ax.lines
    }


def test_the_accuracy_figure_draws_each_policy_against_beta_in_a_panel_per_task():
    fig = plot_accuracy(result_with_answers())
    a = _panel(fig, "a")
    assert a.get_title() == "a\n3 samples, full KV 0.67"
    lines = _lines(a)
    assert "full" not in lines  # full KV is the dashed reference
    assert lines["h2o"] == ([0.2, 0.5], pytest.approx([1 / 3, 2 / 3]))
    assert lines["snapkv"] == ([0.2, 0.5], [0.0, 1.0])
    hollow = [ln for ln in a.lines if ln.get_markerfacecolor() == "white"]
    assert [ln.get_xdata().tolist() for ln in hollow] == [[0.2]]  # snapkv could not fit β = 0.2
    (reference,) = [ln for ln in a.lines if ln.get_linestyle() == "--"]
    assert np.asarray(reference.get_ydata()).tolist() == pytest.approx([2 / 3, 2 / 3])
    h2o_band = a.collections[0].get_paths()[0].vertices[:, 1]  # the CI band of h2o over β
    assert (h2o_band.min(), h2o_band.max()) == (0.0, 1.0)
    assert _lines(_panel(fig, "b"))["h2o"] == ([0.2, 0.5], [0.5, 1.0])
    assert _lines(_panel(fig, "no task"))["snapkv"] == ([0.2, 0.5], [0.0, 1.0])
    assert fig.get_figwidth() <= figures.WIDTH and figures.smallest_shown(fig) >= figures.MIN_PT


def test_compare_adds_the_accuracy_panels_below_and_draws_as_before_without_answers():
    result = result_with_answers()
    fig = plot_compare(result)
    assert _lines(_panel(fig, "b"))["snapkv"] == ([0.2, 0.5], [0.0, 0.5])
    assert len(fig.axes) == 2 + 3  # FMM, the tier stacks, three tasks
    assert len(fig.axes[1].patches) == 3 * 2 * 3 and not _panel(fig, "a").patches  # bars: policy × β × tier
    assert fig.get_figwidth() <= figures.WIDTH and figures.smallest_shown(fig) >= figures.MIN_PT
    without = result.drop_vars(["answer_exact", "answer_exact_full", "accuracy", "accuracy_ci_low",
                                "accuracy_ci_high", "task"])  # fmt: skip
    assert len(plot_compare(without).axes) == 2
    empty = plot_accuracy(without)
    assert [t.get_text() for t in empty.axes[0].texts] == [
        "no answers: replay --forced a trace made with trace --dataset"
    ]


def test_panels_of_rows_of_different_lengths_share_each_row_equally():
    assert spanning([["fmm", "kl"], ["tiers"], ["t0", "t1", "t2"]]) == [
        ["fmm"] * 3 + ["kl"] * 3,
        ["tiers"] * 6,
        ["t0", "t0", "t1", "t1", "t2", "t2"],
    ]


def test_the_answer_table_marks_what_each_policy_lost_and_gained_against_full_kv():
    result = result_with_answers()
    low = answer_table(result, 0.2)
    assert low == {
        "sample": [0, 1, 2, 3, 4, 5],  # sample 6 has no answer
        "task": ["a", "a", "a", "b", "b", "no task"],
        "full KV": ["1", "1", "0", "1", "0", "1"],
        "full": ["1", "1", "0", "1", "0", "1"],
        "h2o": ["1", "lost", "0", "1", "0", "lost"],
        "snapkv": ["lost", "lost", "0", "lost", "0", "lost"],
    }
    high = answer_table(result, 0.5)
    assert high["h2o"] == ["1", "1", "0", "1", "gained", "1"]
    assert high["snapkv"] == ["1", "1", "gained", "1", "0", "1"]
    older = answer_table(result.drop_vars("answer_exact_full"), 0.5)  # no reference: the answers alone
    assert older["full KV"] == ["?"] * 6 and older["h2o"] == ["1", "1", "0", "1", "1", "1"]


def explorer_inputs(result: xr.Dataset) -> tuple[xr.Dataset, xr.Dataset]:
    """A 7-sample synthetic trace (6 steps, 30-token prompts, one layer and KV head) and ``result``
    with tiers of that shape (every position FP at one event), as ``kvscope view`` takes them."""
    from kvscope.storage.synthetic import dataset_from_rows

    rows = np.full((7, 6, 1, 1, 36), np.nan, dtype=np.float32)  # [sample, step, layer, kv_head, pos]
    for t in range(6):
        rows[:, t, :, :, : 30 + t] = 1 / (30 + t)
    ds = dataset_from_rows(rows, prompt_len=30)
    lead = (3, 1, 2, 7, 1, 1, 1)  # [policy, allocation, budget, sample, event, layer, kv_head]
    tiers = np.full(lead + (36,), 2, dtype=np.int8)
    result = result.assign(
        tiers=(("policy", "allocation", "budget", "sample", "event", "layer", "kv_head", "pos"), tiers),
        tier_mass=(("policy", "allocation", "budget", "sample", "event", "layer", "kv_head", "tier"),
                   np.zeros(lead + (3,))),
    ).assign_coords(event_step=("event", [0]), layer=[0], kv_head=[0], pos=np.arange(36))  # fmt: skip
    result.attrs["model"] = str(ds.attrs.get("model", {}).get("name", ""))
    return ds, result


def test_the_explorer_shows_the_samples_each_policy_loses_at_the_chosen_beta(tmp_path):
    from kvscope.explorer.app import Explorer, load
    from kvscope.explorer.static import write_html

    ds, result = explorer_inputs(result_with_answers())
    app = Explorer(load(ds, result, tokens="ids"))
    table = app.answers_table
    assert [c.field for c in table.columns] == ["sample", "task", "full KV", "full", "h2o", "snapkv"]
    assert app.answers.data["h2o"] == ["1", "lost", "0", "1", "0", "lost"]  # β = 0.2, the first
    app.widgets["budget"].value = "0.5"
    app.redraw()
    assert app.answers.data["h2o"] == ["1", "1", "0", "1", "gained", "1"]
    assert app.answers.data["snapkv"] == ["1", "1", "gained", "1", "0", "1"]
    assert "β = 0.5" in app.answers_note.text
    page = tmp_path / "page.html"
    write_html(ds, result, page, tokens="ids")
    html = page.read_text()
    assert "answers-table" in html and '"gained"' in html and "page.answers" in html
    without = result.drop_vars(["answer_exact", "answer_exact_full", "accuracy", "accuracy_ci_low",
                                "accuracy_ci_high", "task"])  # fmt: skip
    assert Explorer(load(ds, without, tokens="ids")).answers_table is None  # a result without answers: as before
