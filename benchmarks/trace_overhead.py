"""Trace overhead: traced vs untraced decoding, measured side by side in one run.

Default model, a 1,024-token prompt of real English prose (the reference-manual topics
that ship with Python in ``pydoc_data``), 128 new tokens, kv-group token rows (fp16).

* untraced: a plain greedy decode loop with the model's own ``sdpa`` (or ``--attn``)
  kernel and a DynamicCache — what a user runs without kvscope;
* traced: ``kvscope.trace`` on the same loaded model: capturing attention function,
  prefill column sums and tail rows, row assembly, background writer, Zarr store,
  metadata consolidation — everything, store creation included; once per layer-output
  mode of ``--attn-output`` (default both: ``kernel``, the untraced model's outputs bit for
  bit, and ``probs``, the outputs from the recorded probabilities).

Repeats are interleaved (untraced, traced kernel, traced probs, untraced, …), each traced run
is divided by the untraced run of its own repeat, and the medians of those ratios compared.

The prefill ratio comes from its own *adjacent pairs* (``--prefill-pairs``): an untraced prefill
right before a one-step trace of the same prompt per mode (store creation, the prompt's forward
with capture, step 0's rows — what a repeat's traced prefill times), a few seconds apart. Inside a
repeat the untraced and traced prefills lie a whole decode apart, so a machine whose speed drifts
by the second (this project's VM: ±12% on one matmul) puts that drift into the ratio; it is
reported beside it (``prefill_ratio_within_repeats``). Also reports bytes on disk per step of
``attn`` against raw fp16 rows.

    python benchmarks/trace_overhead.py [--repeats 5] [--prefill-pairs 8] [--prompt-tokens 1024]
        [--new-tokens 128] [--device cpu] [--attn-output kernel,probs]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import record  # benchmarks/record.py: runs as data


def prose_prompt(tokenizer, n_tokens: int) -> str:
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def untraced_decode(model, input_ids, new_tokens: int, sync) -> tuple[float, float, list[int]]:
    """Plain greedy decoding; returns (prefill seconds, decode seconds, tokens)."""
    import torch
    from transformers import DynamicCache

    from kvscope.model.spec import cache_keyword, last_logits_only, returned_cache

    cache = DynamicCache(config=model.config)
    tokens = []
    last_only = last_logits_only(model)  # as the trace's forwards (and generate)
    keyword = cache_keyword(model)
    sync()
    stamps = [time.perf_counter()]
    with torch.no_grad():
        x = input_ids
        for _ in range(new_tokens):
            out = model(input_ids=x, use_cache=True, **{keyword: cache}, **last_only)
            cache = returned_cache(out)
            x = out.logits[:, -1:].float().argmax(-1)
            tokens.append(int(x))
            sync()
            stamps.append(time.perf_counter())
    return stamps[1] - stamps[0], stamps[-1] - stamps[1], tokens


def one_repeat(model, tokenizer, source, prompt: str, input_ids, settings, outputs, out: Path, sync) -> dict:
    """One plain decode, then one ``trace_loaded`` of the same prompt per layer-output mode in
    ``outputs`` (stores under the folder ``out``): ``{"plain": {prefill, decode, tokens},
    mode: {prefill, decode, total, tokens}}``."""
    model.set_attn_implementation(settings.attn)
    p_prefill, p_decode, plain_tokens = untraced_decode(model, input_ids, settings.max_new_tokens, sync)
    measured = {"plain": {"prefill": p_prefill, "decode": p_decode, "tokens": plain_tokens}}
    for mode in outputs:
        mode_settings = dataclasses.replace(settings, attn_output=mode)
        measured[mode] = traced_run(model, tokenizer, source, prompt, mode_settings, out / f"{mode}.zarr", sync)
    return measured


def traced_run(model, tokenizer, source, prompt: str, settings, out: Path, sync) -> dict:
    """Seconds of one ``trace_loaded`` into ``out`` (prefill = store creation + prefill with
    capture, to the first step's callback; decode = the remaining steps; total adds the final
    flush and consolidation), the traced tokens and the decode loop's waits (``writer_wait_s``:
    back-pressure, ``writer_waits`` times; ``copies_wait_s``: for the rows' copies off the device)."""
    import kvscope
    from kvscope.model.prompts import Prompt
    from kvscope.tracing.runner import trace_loaded

    stamps = []

    def on_step(_progress):
        sync()
        stamps.append(time.perf_counter())

    sync()
    t0 = time.perf_counter()
    result = trace_loaded(
        model, tokenizer, source, [Prompt(prompt, "pydoc_data")], out=out, settings=settings, progress=on_step
    )
    sync()
    t_end = time.perf_counter()
    ds = kvscope.open_trace(out)
    P = int(ds.prompt_len[0])
    return {
        "prefill": stamps[0] - t0,
        "decode": stamps[-1] - stamps[0],
        "total": t_end - t0,
        "tokens": ds.tokens.values[0, P:].tolist(),
        "writer_wait_s": result.waits.writer_s,
        "writer_waits": result.waits.writer_times,
        "copies_wait_s": result.waits.copies_s,
    }


def _after_warm_up(count: int, label: str, measure) -> list:
    """``count`` results of ``measure(r, workdir) -> (result, text)`` after one warm-up call
    (``r = 0``, dropped), each call's ``text`` printed to stderr; ``workdir`` (a temporary
    folder, removed at the end) holds what a call writes."""
    measured = []
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-bench-"))
    try:
        for r in range(count + 1):
            result, text = measure(r, workdir)
            print(f"{label} {r}{' (warm-up)' if r == 0 else ''}: {text}", file=sys.stderr)
            if r > 0:
                measured.append(result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return measured


def run_repeats(model, tokenizer, source, prompt, input_ids, settings, outputs, repeats: int, sync):
    """``(measured, info)``: ``repeats`` measured repeats of :func:`one_repeat` after one warm-up
    repeat (dropped), and the ``store_info`` of the last repeat's store under ``outputs[0]``
    (every repeat writes the same bytes); each repeat's stores are removed once measured."""
    from kvscope.storage.store import store_info

    info = {}

    def repeat(r: int, workdir: Path):
        out = workdir / f"r{r}"
        out.mkdir()
        m = one_repeat(model, tokenizer, source, prompt, input_ids, settings, outputs, out, sync)
        if r == repeats:
            info.update(store_info(out / f"{outputs[0]}.zarr"))
        shutil.rmtree(out, ignore_errors=True)
        seconds = ", ".join(f"{mode} {run['prefill']:.2f} + {run['decode']:.2f} s" for mode, run in m.items())
        return m, f"(prefill + decode) {seconds}"

    return _after_warm_up(repeats, "repeat", repeat), info


def prefill_pairs(model, tokenizer, source, prompt, input_ids, settings, outputs, pairs: int, sync) -> list[dict]:
    """``pairs`` adjacent prefill pairs after one warm-up pair (dropped): an untraced prefill,
    then per layer-output mode a one-step trace of the same prompt (its ``prefill``: store
    creation, the prompt's forward with capture, step 0's rows); ``[{"plain": s, mode: s}]``."""
    if pairs < 1:
        return []
    one_step = dataclasses.replace(settings, max_new_tokens=1)

    def pair(r: int, workdir: Path):
        model.set_attn_implementation(settings.attn)
        seconds = {"plain": untraced_decode(model, input_ids, 1, sync)[0]}
        for mode in outputs:
            out = workdir / f"p{r}-{mode}.zarr"
            mode_settings = dataclasses.replace(one_step, attn_output=mode)
            seconds[mode] = traced_run(model, tokenizer, source, prompt, mode_settings, out, sync)["prefill"]
            shutil.rmtree(out, ignore_errors=True)
        return seconds, ", ".join(f"{mode} {s:.2f} s" for mode, s in seconds.items())

    return _after_warm_up(pairs, "prefill pair", pair)


def _quartiles(values) -> list[float]:
    """``[q1, median, q3]`` within the values (statistics' inclusive method; the value itself for one)."""
    values = list(values)
    return [values[0]] * 3 if len(values) == 1 else statistics.quantiles(values, n=4, method="inclusive")


def summarize(measured: list[dict], outputs, pairs: list[dict] | None = None) -> dict:
    """Medians over the repeats: the plain run's seconds and, per layer-output mode, its
    seconds, its ratios to the plain run of the same repeat and whether every traced
    decode gave the untraced tokens. With ``pairs`` (:func:`prefill_pairs`) the prefill
    ratio is the median over those adjacent pairs (quartiles beside it); the one within
    the repeats stays as ``prefill_ratio_within_repeats``."""
    plain = [m["plain"] for m in measured]
    report = {f"plain_{k}_median_s": statistics.median(p[k] for p in plain) for k in ("prefill", "decode")}
    for mode in outputs:
        runs = [m[mode] for m in measured]
        within = statistics.median(t["prefill"] / p["prefill"] for t, p in zip(runs, plain))
        report[mode] = {
            **{f"{k}_median_s": statistics.median(t[k] for t in runs) for k in ("prefill", "decode", "total")},
            # decode: the per-step cost of tracing (the target); end to end adds the
            # O(P²) prefill column sums, store creation and consolidation
            "decode_ratio": statistics.median(t["decode"] / p["decode"] for t, p in zip(runs, plain)),
            # the strict reading: until the store is closed — the writer's last blocks (compressed
            # after the last step) and consolidation counted as decode too
            "decode_through_close_ratio": statistics.median(
                (t["total"] - t["prefill"]) / p["decode"] for t, p in zip(runs, plain)
            ),
            "prefill_ratio": within,
            "prefill_ratio_within_repeats": within,
            "end_to_end_ratio": statistics.median(
                t["total"] / (p["prefill"] + p["decode"]) for t, p in zip(runs, plain)
            ),
            "tokens_equal_untraced": all(t["tokens"] == p["tokens"] for t, p in zip(runs, plain)),
            # back-pressure: the decode loop's waits for the writer (a block still queued), and for the copies
            "writer_wait_median_s": statistics.median(t["writer_wait_s"] for t in runs),
            "writer_waits_max": max(t["writer_waits"] for t in runs),
            "copies_wait_median_s": statistics.median(t["copies_wait_s"] for t in runs),
        }
        if pairs:
            quartiles = _quartiles(pair[mode] / pair["plain"] for pair in pairs)
            report[mode]["prefill_ratio"] = quartiles[1]
            report[mode]["prefill_ratio_quartiles"] = quartiles
            report[mode]["prefill_pair_count"] = len(pairs)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-pairs", type=int, default=8, help="adjacent untraced/traced prefill pairs (0: none)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--attn-output", default="kernel,probs", help="layer-output modes traced, comma-separated")
    ap.add_argument("--json", action="store_true")
    record.add_argument(ap)
    args = ap.parse_args()
    machine_info = record.machine()  # the load as the run begins

    import torch

    from kvscope.cli import quiet_libraries
    from kvscope.model.loading import load, resolve
    from kvscope.tracing.runner import TraceSettings

    quiet_libraries().__enter__()  # for the whole benchmark process
    outputs = args.attn_output.split(",")
    source = resolve(args.model)
    model, tokenizer = load(source, args.device)
    prompt = prose_prompt(tokenizer, args.prompt_tokens)
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    settings = TraceSettings(
        model=args.model, max_new_tokens=args.new_tokens, device=args.device, attn=args.attn, stop_at_eos=False
    )
    measured, info = run_repeats(model, tokenizer, source, prompt, input_ids, settings, outputs, args.repeats, sync)
    pairs = prefill_pairs(model, tokenizer, source, prompt, input_ids, settings, outputs, args.prefill_pairs, sync)
    summary = summarize(measured, outputs, pairs)
    if "kernel" in outputs:  # the kernel's outputs are the untraced model's, bit for bit
        assert summary["kernel"]["tokens_equal_untraced"], "traced tokens differ from untraced"
    attn = info["arrays"]["attn"]
    n_steps = args.new_tokens
    _, _, n_layers, n_kv, n_pos = attn["shape"]
    raw_per_step = n_layers * n_kv * n_pos * 2
    stored_per_step = attn["stored_bytes"] / n_steps
    report = {
        "model": args.model,
        "device": args.device,
        "device_name": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "attn": args.attn,
        "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": n_steps,
        "repeats": args.repeats,
        **summary,
        "attn_bytes_per_step_on_disk": stored_per_step,
        "attn_raw_fp16_bytes_per_step": raw_per_step,
        "disk_over_raw_fp16": stored_per_step / raw_per_step,
    }
    record.finish("trace_overhead", args, report, machine_info)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"trace overhead ({report['model']}, {report['device']}, {report['attn']}, "
        f"{report['prompt_tokens']} + {n_steps} tokens, medians of {args.repeats}; "
        f"untraced prefill {report['plain_prefill_median_s']:.2f} s, decode {report['plain_decode_median_s']:.2f} s):"
    )
    for mode in outputs:
        r = report[mode]
        spread = ""
        if "prefill_pair_count" in r:
            q1, _, q3 = r["prefill_ratio_quartiles"]
            spread = (
                f" (median of {r['prefill_pair_count']} adjacent pairs, quartiles {q1:.3f}–{q3:.3f}; "
                f"within the repeats {r['prefill_ratio_within_repeats']:.3f})"
            )
        print(
            f"  --attn-output {mode:6s}  decode ({n_steps - 1} steps) {r['decode_median_s']:.2f} s, ratio "
            f"{r['decode_ratio']:.3f} (target ≤ 1.10; until the store is closed "
            f"{r['decode_through_close_ratio']:.3f}) · prefill {r['prefill_median_s']:.2f} s, ratio "
            f"{r['prefill_ratio']:.3f}{spread} (≤ 1.25) · end to end {r['end_to_end_ratio']:.3f} · "
            f"tokens {'equal' if r['tokens_equal_untraced'] else 'DIFFER'}"
        )
    print(
        f"  attn on disk     {stored_per_step / 1024:.1f} KiB/step vs raw fp16 {raw_per_step / 1024:.1f} KiB/step"
        f" = {report['disk_over_raw_fp16']:.3f}  (target ≤ 0.65, lossless)"
    )


if __name__ == "__main__":
    main()
