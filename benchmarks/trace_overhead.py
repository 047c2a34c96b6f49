"""Trace overhead: traced vs untraced decoding, measured side by side in one run.

Default model, a 1,024-token prompt of real English prose (the reference-manual topics
that ship with Python in ``pydoc_data``), 128 new tokens, kv-group token rows (fp16).

* untraced: a plain greedy decode loop with the model's own ``sdpa`` (or ``--attn``)
  kernel and a DynamicCache — what a user runs without kvscope;
* traced: ``kvscope.trace`` on the same loaded model: capturing attention function,
  prefill column sums and tail rows, row assembly, background writer, Zarr store,
  metadata consolidation — everything, store creation included.

Repeats are interleaved (untraced, traced, untraced, …) and the medians compared.
Also reports bytes on disk per step of ``attn`` against raw fp16 rows.

    python benchmarks/trace_overhead.py [--repeats 5] [--prompt-tokens 1024] [--new-tokens 128] [--device cpu]
"""

from __future__ import annotations

import argparse
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
    import pydoc_data.topics as topics

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


def one_pair(model, tokenizer, source, prompt: str, input_ids, settings, out: Path, sync) -> dict:
    """One plain decode and one ``trace_loaded`` of the same prompt into ``out``: their seconds
    (traced prefill = store creation + prefill with capture, to the first step's callback; traced
    decode = the remaining steps; total adds the final flush and consolidation) and whether the
    traced tokens equal the untraced ones."""
    import kvscope
    from kvscope.prompts import Prompt
    from kvscope.tracing.runner import trace_loaded

    model.set_attn_implementation(settings.attn)
    p_prefill, p_decode, plain_tokens = untraced_decode(model, input_ids, settings.max_new_tokens, sync)
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
        "plain_prefill": p_prefill,
        "plain_decode": p_decode,
        "traced_prefill": stamps[0] - t0,
        "traced_decode": stamps[-1] - stamps[0],
        "traced_total": t_end - t0,
        "tokens_equal": ds.tokens.values[0, P:].tolist() == plain_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from kvscope.cli import quiet_libraries
    from kvscope.models import load, resolve
    from kvscope.store import store_info
    from kvscope.tracing.runner import TraceSettings

    quiet_libraries().__enter__()  # for the whole benchmark process
    source = resolve(args.model)
    model, tokenizer = load(source, args.device)
    prompt = prose_prompt(tokenizer, args.prompt_tokens)
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    settings = TraceSettings(
        model=args.model, max_new_tokens=args.new_tokens, device=args.device, attn=args.attn, stop_at_eos=False
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-bench-"))
    rows = {k: [] for k in ("plain_prefill", "plain_decode", "traced_prefill", "traced_decode", "traced_total")}
    info = None
    try:
        for r in range(args.repeats + 1):  # the first pair warms up and is dropped
            out = workdir / f"r{r}.zarr"
            measured = one_pair(model, tokenizer, source, prompt, input_ids, settings, out, sync)
            assert measured.pop("tokens_equal"), "traced tokens differ from untraced"
            if r > 0:
                for key, value in measured.items():
                    rows[key].append(value)
            info = store_info(out)
            print(
                f"repeat {r}{' (warm-up)' if r == 0 else ''}: "
                + ", ".join(f"{k} {v:.2f} s" for k, v in measured.items()),
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

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
        **{f"{k}_median_s": statistics.median(v) for k, v in rows.items()},
        # decode: per-step cost of tracing (the target); end-to-end includes the
        # O(P²) prefill column sums, store creation and consolidation
        "decode_ratio": statistics.median([t / p for t, p in zip(rows["traced_decode"], rows["plain_decode"])]),
        "prefill_ratio": statistics.median([t / p for t, p in zip(rows["traced_prefill"], rows["plain_prefill"])]),
        "end_to_end_ratio": statistics.median(
            [t / (a + b) for t, a, b in zip(rows["traced_total"], rows["plain_prefill"], rows["plain_decode"])]
        ),
        "attn_bytes_per_step_on_disk": stored_per_step,
        "attn_raw_fp16_bytes_per_step": raw_per_step,
        "disk_over_raw_fp16": stored_per_step / raw_per_step,
        "store_total_bytes": info["stored_bytes"],
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(
            f"trace overhead ({report['model']}, {report['device']}, {report['attn']}, "
            f"{report['prompt_tokens']} + {n_steps} tokens, median of {args.repeats}):\n"
            f"  decode   ({n_steps - 1} steps)  untraced {report['plain_decode_median_s']:.2f} s, "
            f"traced {report['traced_decode_median_s']:.2f} s, ratio {report['decode_ratio']:.3f}  (target ≤ 1.10)\n"
            f"  prefill  ({report['prompt_tokens']} tokens)  untraced {report['plain_prefill_median_s']:.2f} s, "
            f"traced {report['traced_prefill_median_s']:.2f} s, ratio {report['prefill_ratio']:.3f}\n"
            f"  end to end            ratio {report['end_to_end_ratio']:.3f}\n"
            f"  attn on disk     {stored_per_step / 1024:.1f} KiB/step vs raw fp16 {raw_per_step / 1024:.1f} KiB/step"
            f" = {report['disk_over_raw_fp16']:.3f}  (target ≤ 0.65, lossless)"
        )


if __name__ == "__main__":
    main()
