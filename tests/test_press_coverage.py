"""Every press class kvpress exports, tried as a user would — live (a policy cache decoding on the
real model) and offline (``kvscope.replay`` of a q/k/v trace) — on a tiny GQA model: it runs, or
it is refused in one line for a reason that is the press's own (an asset only its hub has, a
knob no ratio sets, kvpress's base class). The table on the docs site (docs/presses.md) is this
walk's result; a new kvpress release's presses show up here first.

``KVSCOPE_WRITE_PRESSES=1 pytest tests/test_press_coverage.py`` rewrites the table."""

from __future__ import annotations

import os
import re

import kvscope
from kvscope.errors import KvscopeError

from .conftest import ROOT, TINY_GQA_STEPS

PAGE = ROOT / "docs" / "presses.md"
BEGIN, END = "<!-- coverage: begin (tests/test_press_coverage.py) -->", "<!-- coverage: end -->"
BUDGET, STEPS = 0.5, TINY_GQA_STEPS
# what a press needs given to run (what kvscope's errors ask for); every other press runs as press:NAME
GIVEN = {
    "AdaKVPress": "press=KnormPress",
    "BlockPress": "press=KnormPress:block_size=8",
    "CAMPress": "base_press=KnormPress:compression_interval=2",
    "ChunkKVPress": "press=KnormPress",
    "ChunkPress": "press=KnormPress:chunk_length=32",
    "ComposedPress": "presses=[KnormPress:compression_ratio=0.4,ThinKPress:key_channel_compression_ratio=0.25]",
    "CompressionRatioDecodingPress": "base_press=KnormPress:compression_interval=2",
    "CriticalAdaKVPress": "press=KnormPress",
    "CriticalKVPress": "press=SnapKVPress",
    "DMSPress": "press=KnormPress:threshold=-3.0:sliding_window_size=8",
    "DecodingPress": "base_press=KnormPress:compression_interval=2",
    "DuoAttentionPress": "head_compression_ratio=0.5",
    "EntropyGatedChunkKVPress": "press=KnormPress",
    "FinchPress": "window_size=8",
    "KeyRerotationPress": "press=KnormPress",
    "LUKVPress": "press=ExpectedAttentionPress",
    "MergingPress": "press=KnormPress",
    "PerLayerCompressionPress": "press=KnormPress:compression_ratios=[0.3,0.6]",
    "PrefillDecodingPress": "prefilling_press=KnormPress:decoding_press=DecodingPress:base_press=KnormPress:compression_interval=2",
    "SimLayerKVPress": "lazy_threshold=0.5:n_recent=8",
}  # fmt: skip
PLUMBING = re.compile(r"stand-in|kvscope does not hold|cannot run on|Traceback|kvscope's", re.IGNORECASE)


def _budget(spec: str, reached: bool) -> str:
    """How β set the press: nothing (it runs as its parameters say), or not reached at this β."""
    from kvscope.policies.kvpress_bridge import press_class
    from kvscope.policies.press_traits import traits_of

    if traits_of(press_class(spec.split(":")[1])).given is not None:
        return "; β sets nothing (its parameters do)"
    return "" if reached else f"; β = {BUDGET} not reached (its smallest setting)"


def _refused(error: KvscopeError, model_folder: str) -> str:
    """The refusal, the model's folder named as such; an asset's loader's own words left out."""
    text = str(error).replace(model_folder, "MODEL")
    where = "which cannot be loaded here"
    if where in text:
        hint = text[text.rindex(";") :] if "; give" in text else ""
        text = text[: text.index(where) + len(where)] + hint
    return f"refused: {text}"


def _live(model, ids, spec: str) -> str:
    from kvscope.live import PolicyCache
    from kvscope.live.run import decode

    try:
        cache = PolicyCache(model, spec, BUDGET, STEPS, check=True)
        decode(model, ids, cache, STEPS)
    except KvscopeError as error:
        return _refused(error, model.config.name_or_path)
    return "runs" + _budget(spec, bool(cache.state.reached))


def _offline(trace, spec: str, model_folder: str) -> tuple[str, str]:
    """The offline replay's cell and forced replay's (one ``replay --forced`` gives both)."""
    import json

    from kvscope.policies import parse

    try:
        policy = parse(spec)
        result = kvscope.replay(trace, [policy], [BUDGET], n_boot=10, forced=True)
    except KvscopeError as error:
        if "while decoding" in str(error):  # the replay ran; its forced decode refused
            result = kvscope.replay(trace, [policy], [BUDGET], n_boot=10)
            return _offline_cell(trace, policy, spec, result), _refused(error, model_folder)
        refused = _refused(error, model_folder)
        return refused, refused
    offline = _offline_cell(trace, policy, spec, result)
    forced = json.loads(result.attrs["forced"])
    label = policy.label()
    how = {"closed": "closed loop", "one round": "one forward", "open": "open loop"}[forced["loops"][label]]
    served = f", {forced['served'][label]}" if label in forced["served"] else ""
    assert bool(result["forced_converged"].values.all()) and float(result["forced_kl_mean"].values.max()) >= -1e-6
    return offline, f"runs ({how}{served})"


def _offline_cell(trace, policy, spec: str, result) -> str:
    where = "the trace's model" if policy.needs_model() else "q, k, v"
    return f"runs (on {where})" + _budget(spec, bool(result["budget_reached"].values.all()))


def _rows(tiny_gqa_trace) -> list[dict]:
    from kvscope.policies.kvpress_bridge import press_classes

    model, ids, trace = tiny_gqa_trace
    rows = []
    for name in sorted(press_classes()):
        spec = ":".join(["press", name, *([GIVEN[name]] if name in GIVEN else [])])
        offline, forced = _offline(trace, spec, model.config.name_or_path)
        rows.append({"press": name, "spec": spec, "live": _live(model, ids, spec), "offline": offline,
                     "forced": forced})  # fmt: skip
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: list[dict]) -> str:
    lines = [
        "| press | tried as | live (`kvscope run`) | offline (`kvscope replay`) | forced replay |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['press']} | `{_cell(row['spec'])}` | {_cell(row['live'])} | {_cell(row['offline'])} "
            f"| {_cell(row['forced'])} |"
        )
    return "\n".join(lines)


def test_every_kvpress_class_runs_or_is_refused_for_a_reason_of_its_own(tiny_gqa_trace):
    from kvscope.policies.kvpress_bridge import load

    rows = _rows(tiny_gqa_trace)
    assert {row["press"] for row in rows} == {
        n for n in load().__all__ if isinstance(getattr(load(), n), type) and issubclass(getattr(load(), n), load().BasePress)
    }  # fmt: skip
    for row in rows:
        for where in ("live", "offline", "forced"):
            text = row[where]
            assert text.startswith(("runs", "refused: press")), row
            assert "\n" not in text and not PLUMBING.search(text), row
    refused = {row["press"] for row in rows if row["live"].startswith("refused")}
    assert refused == {
        "BasePress", "ScorerPress",  # kvpress's base classes
        "QFilterPress", "KVzapPress", "DuoAttentionPress", "ExpectedAttentionStatsPress", "FastKVzipPress",
        "RestoreKVPress", "LUKVPress",  # learned assets from the hub (or a repository) this machine cannot reach
    }, refused  # fmt: skip
    assert {row["press"] for row in rows if row["offline"].startswith("refused")} == refused
    # forced replay serves the rewrites a press makes of the prompt's cache, not those made while decoding
    assert {row["press"] for row in rows if row["forced"].startswith("refused")} == refused | {"CAMPress"}
    table = _table(rows)
    page = PAGE.read_text()
    head, rest = page.split(BEGIN)
    current, tail = rest.split(END)
    if os.environ.get("KVSCOPE_WRITE_PRESSES"):
        PAGE.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
        return
    assert current.strip() == table, "docs/presses.md is out of date: rerun with KVSCOPE_WRITE_PRESSES=1"
