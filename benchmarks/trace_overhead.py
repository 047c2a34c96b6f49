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
Also reports bytes on disk per step of ``attn`` against raw fp16 rows.

    python benchmarks/trace_overhead.py [--repeats 5] [--prompt-tokens 1024] [--new-tokens 128] [--device cpu]
        [--attn-output kernel,probs]
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


def prose_prompt(tokenizer, n_tokens: int) -> str:
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def untraced_decode(model, input_ids, new_tokens: int, sync) -> tuple[float, float, list[int]]:
    """Plain greedy decoding; returns (prefill seconds, decode seconds, tokens)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    tokens = []
    sync()
    stamps = [time.perf_counter()]
    with torch.no_grad():
        x = input_ids
        for _ in range(new_tokens):
            out = model(input_ids=x, cache=cache, use_cache=True)
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
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
    flush and consolidation) and the traced tokens."""
    import kvscope
    from kvscope.prompts import Prompt
    from kvscope.tracing.runner import trace_loaded

    stamps = []

    def on_step(_progress):
        sync()
        stamps.append(time.perf_counter())

    sync()
    t0 = time.perf_counter()
    trace_loaded(model, tokenizer, source, [Prompt(prompt, "pydoc_data")], out, settings, progress=on_step)
    sync()
    t_end = time.perf_counter()
    ds = kvscope.open_trace(out)
    P = int(ds.prompt_len[0])
    return {
        "prefill": stamps[0] - t0,
        "decode": stamps[-1] - stamps[0],
        "total": t_end - t0,
        "tokens": ds.tokens.values[0, P:].tolist(),
    }


def run_repeats(model, tokenizer, source, prompt, input_ids, settings, outputs, repeats: int, sync):
    """``(measured, info)``: ``repeats`` measured repeats of :func:`one_repeat` after one warm-up
    repeat (dropped), and the ``store_info`` of the last repeat's store under ``outputs[0]``
    (every repeat writes the same bytes); each repeat's stores are removed once measured."""
    from kvscope.store import store_info

    measured, info = [], None
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-bench-"))
    try:
        for r in range(repeats + 1):
            out = workdir / f"r{r}"
            out.mkdir()
            m = one_repeat(model, tokenizer, source, prompt, input_ids, settings, outputs, out, sync)
            if r == repeats:
                info = store_info(out / f"{outputs[0]}.zarr")
            shutil.rmtree(out, ignore_errors=True)
            seconds = ", ".join(f"{mode} {run['prefill']:.2f} + {run['decode']:.2f} s" for mode, run in m.items())
            print(f"repeat {r}{' (warm-up)' if r == 0 else ''} (prefill + decode): {seconds}", file=sys.stderr)
            if r > 0:
                measured.append(m)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return measured, info


def summarize(measured: list[dict], outputs) -> dict:
    """Medians over the repeats: the plain run's seconds and, per layer-output mode, its
    seconds, its ratios to the plain run of the same repeat and whether every traced
    decode gave the untraced tokens."""
    plain = [m["plain"] for m in measured]
    report = {f"plain_{k}_median_s": statistics.median(p[k] for p in plain) for k in ("prefill", "decode")}
    for mode in outputs:
        runs = [m[mode] for m in measured]
        report[mode] = {
            **{f"{k}_median_s": statistics.median(t[k] for t in runs) for k in ("prefill", "decode", "total")},
            # decode: the per-step cost of tracing (the target); end to end adds the
            # O(P²) prefill column sums, store creation and consolidation
            "decode_ratio": statistics.median(t["decode"] / p["decode"] for t, p in zip(runs, plain)),
            "prefill_ratio": statistics.median(t["prefill"] / p["prefill"] for t, p in zip(runs, plain)),
            "end_to_end_ratio": statistics.median(
                t["total"] / (p["prefill"] + p["decode"]) for t, p in zip(runs, plain)
            ),
            "tokens_equal_untraced": all(t["tokens"] == p["tokens"] for t, p in zip(runs, plain)),
        }
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--attn-output", default="kernel,probs", help="layer-output modes traced, comma-separated")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from kvscope.cli import quiet_libraries
    from kvscope.models import load, resolve
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
    summary = summarize(measured, outputs)
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
        print(
            f"  --attn-output {mode:6s}  decode ({n_steps - 1} steps) {r['decode_median_s']:.2f} s, ratio "
            f"{r['decode_ratio']:.3f} (target ≤ 1.10) · prefill {r['prefill_median_s']:.2f} s, ratio "
            f"{r['prefill_ratio']:.3f} (≤ 1.25) · end to end {r['end_to_end_ratio']:.3f} · "
            f"tokens {'equal' if r['tokens_equal_untraced'] else 'DIFFER'}"
        )
    print(
        f"  attn on disk     {stored_per_step / 1024:.1f} KiB/step vs raw fp16 {raw_per_step / 1024:.1f} KiB/step"
        f" = {report['disk_over_raw_fp16']:.3f}  (target ≤ 0.65, lossless)"
    )


if __name__ == "__main__":
    main()
