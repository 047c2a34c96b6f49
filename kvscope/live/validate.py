"""``kvscope validate``: does offline replay predict the live cache?

Given a full-KV trace with q/k/v (``STORE``), for one policy at one budget:

    1. open loop   replay(STORE, observe=exact)                  output error e_open[layer]
    2. live        re-decode STORE's prompts under a PolicyCache,  → LIVE.zarr (q/k/v in fp32,
                   recording what the live cache served          the cache's tiers at every event)
    3. agreement   replay(LIVE, observe=exact): its tier at every (event, layer, kv_head,
                   position) must equal the live cache's recorded tier
    4. live error  with 3 exact, replay's effective cache on LIVE *is* the live cache, so its
                   output error against full KV of the same (live) trajectory is the live
                   error e_live[layer]

Errors are the attention-output relative L2 errors of the first query after each event
(docs/concepts.md#output-error), averaged over events, KV heads and samples. ``predicted/live`` near 1 means the
open-loop number can be trusted for that layer; the token agreement of the two decodes says
how far the trajectories themselves parted.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import numpy as np

from ..errors import KvscopeError
from ..model.loading import ModelSource, load, recorded_model_dtype, trace_model_source
from ..model.prompts import Prompt
from ..policies import check_budget
from ..policies.allocation import Given, check_allocatable
from ..policies.allocation import parse as parse_allocation
from ..replay import replay
from ..storage.paths import output_path
from ..storage.store import open_trace
from ..tracing.runner import TraceSettings, check_out, trace_loaded
from .cache import LivePolicy, kv_storage_dtype
from .inputs import live_policy


def validate(
    store,
    policy,
    budget: float,
    *,
    live_out: str | Path | None = None,
    force: bool = False,
    model: str | None = None,
    kv_dtype: str | None = None,
    question_agnostic: bool = False,
    allocation="uniform",
    progress=None,
) -> dict:
    """Run steps 1–4 of the module docstring; returns a JSON-ready dict with per-layer
    ``predicted`` and ``live`` errors and the decision agreement. ``live_out`` keeps the live
    trace (an existing one is replaced only with ``force``); ``model`` overrides the model the
    store names (which is looked up locally only). The live decode follows the store's protocol
    (a question-agnostic trace feeds the question after the context); ``question_agnostic``
    refuses a store recorded otherwise. ``allocation`` splits the budget across layers and KV
    heads in all three; the clairvoyant oracle's split is the open-loop replay's, per sample,
    given to the live cache and to the replay of its trace."""
    budget = check_budget(budget)
    policy = live_policy(policy)
    allocation = parse_allocation(allocation)
    check_allocatable([policy], [allocation])
    if live_out is not None:
        _check_live_out(store, live_out, force)
    ds = _full_kv_trace(store, question_agnostic)
    attrs = ds.attrs
    source = trace_model_source(store, attrs.get("model"), model)
    model, tokenizer = load(source, attrs.get("device", "cpu"), recorded_model_dtype(store, attrs))
    dtype = kv_storage_dtype(model, kv_dtype)
    itemsize = dtype.itemsize

    open_loop = replay(
        ds, [policy], [budget], allocations=[allocation], observe="exact", kv_itemsize=itemsize,
        question_agnostic=question_agnostic,
    )  # fmt: skip
    if allocation.clairvoyant:  # [sample, layer, kv_head]: the split the replay found, per sample
        allocation = Given.of(open_loop["allocated"].values[0, 0, 0])
    settings = _live_settings(ds, source)
    cache = LivePolicy(policy, budget, str(dtype).removeprefix("torch."), allocation)
    prompts = [Prompt.from_doc(p) for p in attrs["prompts"]]
    tmp = None
    if live_out is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvscope-validate-")
        live_out = Path(tmp.name) / "live.zarr"
    try:
        trace_loaded(
            model, tokenizer, source, prompts, out=Path(live_out), settings=settings, force=force, progress=progress,
            cache=cache,
        )
        live = open_trace(live_out)
        closed = replay(
            live, [policy], [budget], allocations=[allocation], observe="exact", kv_itemsize=itemsize,
            every=settings.window,
        )  # fmt: skip
        report = _report(ds, live, open_loop, closed, label=policy.label(), budget=budget, itemsize=itemsize)
        report["allocation"] = str(open_loop["allocation"].values[0])
    finally:
        if tmp is not None:
            tmp.cleanup()
    report["live_store"] = None if tmp is not None else str(live_out)
    return report


def _full_kv_trace(store, question_agnostic: bool):
    """The store, opened and checked: a full-KV trace with q/k/v (question-agnostic if asked)."""
    ds = open_trace(store)
    if not all(name in ds for name in ("q", "k", "v")):
        raise KvscopeError(f"{store} has no q/k/v: validate needs a trace recorded with --record qkv")
    if "policy" in ds.attrs:
        raise KvscopeError(f"{store} was recorded under a policy; validate needs a full-KV trace")
    if question_agnostic and not ds.kvscope.question_agnostic:
        raise KvscopeError(f"{store} prefilled the question with the context; record it with trace --question-agnostic")
    return ds


def _live_settings(ds, source: ModelSource) -> TraceSettings:
    """The store's own trace settings for the live re-decode: kv rows with q/k/v in fp32, the
    same generation (and protocol)."""
    attrs, acc = ds.attrs, ds.kvscope
    generation = attrs.get("generation", {})
    settings = TraceSettings(
        model=source.spec,
        max_new_tokens=int(generation["max_new_tokens"]) if acc.question_agnostic else int(ds.sizes["step"]),
        question_agnostic=acc.question_agnostic,
        heads="kv",
        window=acc.w,
        n_sink=acc.n_sink,
        obs_window=acc.obs_window,
        record_qkv=True,
        dtype="float32",
        device=attrs.get("device", "cpu"),
        attn=attrs.get("attn_kernel", "sdpa"),
        model_dtype=attrs.get("settings", {}).get("model_dtype", "auto"),
        stop_at_eos=bool(generation.get("stop_at_eos", True)),
        chat=bool(generation.get("chat_template", False)),
    )
    settings.check()
    return settings


def _check_live_out(store, live_out, force: bool) -> None:
    """``live_out`` is never the input store, inside it or around it (not even with ``force``),
    and an existing path is replaced only with ``force``: checked before a model is loaded."""
    output_path(live_out, "--live-out", inputs=[store])
    if os.path.lexists(live_out) and not force:
        raise KvscopeError(f"--live-out {live_out} exists; pass --force to overwrite it or choose another path")
    check_out(live_out, force, flag="--live-out")


def _report(full, live, open_loop, closed, label, budget, itemsize) -> dict:
    replayed = closed["tiers"].values[0, 0, 0]  # [sample, event, layer, kv_head, pos]
    recorded = live["policy_tiers"].values  # [sample, event, layer, kv_head, pos]
    n_events = min(replayed.shape[1], recorded.shape[1])
    compared = agreeing = 0
    first = None
    query_pos = np.asarray(live["query_pos"].values)
    n_steps = np.asarray(live["n_steps"].values)
    every = int(live.attrs["policy"]["every"])
    for s in range(replayed.shape[0]):
        for e in range(n_events):
            step = e * every
            if step >= n_steps[s]:
                break
            exists = int(query_pos[s, step]) + 1
            a, b = replayed[s, e, ..., :exists], recorded[s, e, ..., :exists]
            same = a == b
            compared += same.size
            agreeing += int(same.sum())
            if first is None and not same.all():
                layer, head, pos = np.argwhere(~same)[0]
                first = {
                    "sample": s,
                    "event": e,
                    "step": step,
                    "layer": int(layer),
                    "kv_head": int(head),
                    "pos": int(pos),
                }
    predicted = _per_layer(open_loop["output_rel_l2"])
    measured = _per_layer(closed["output_rel_l2"])
    tokens_full = [full.kvscope.generated(s).tolist() for s in range(full.sizes["sample"])]
    tokens_live = [live.kvscope.generated(s).tolist() for s in range(live.sizes["sample"])]
    same_tokens = [
        np.mean([a == b for a, b in zip(x, y)]) if min(len(x), len(y)) else np.nan
        for x, y in zip(tokens_full, tokens_live)
    ]
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = predicted / measured
    return {
        "policy": label,
        "budget": budget,
        "kv_itemsize": itemsize,
        "decisions_compared": int(compared),
        "decisions_agreeing": int(agreeing),
        "decision_agreement": agreeing / compared if compared else float("nan"),
        "decisions_identical": bool(compared and agreeing == compared),
        "first_mismatch": first,
        "token_agreement": float(np.nanmean(same_tokens)),
        "bytes_ratio_live": float(np.max(live["policy_cache_bytes"].values) / closed["full_bytes"].values.max()),
        "layers": [
            {"layer": int(layer), "predicted": _num(p), "live": _num(m), "ratio": _num(r)}
            for layer, (p, m, r) in enumerate(zip(predicted, measured, ratio))
        ],
        "predicted_mean": _num(np.nanmean(predicted)),
        "live_mean": _num(np.nanmean(measured)),
        "correlation": _num(np.corrcoef(predicted, measured)[0, 1]) if len(predicted) > 2 else None,
    }


def _per_layer(err) -> np.ndarray:
    """``[policy, allocation, budget, sample, event, layer, kv_head]`` → mean per layer."""
    values = np.asarray(err.values[0, 0, 0], dtype=np.float64)  # [sample, event, layer, kv_head]
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(np.moveaxis(values, 2, 0).reshape(values.shape[2], -1), axis=1)


def _num(x):
    x = float(x)
    return None if not np.isfinite(x) else x
