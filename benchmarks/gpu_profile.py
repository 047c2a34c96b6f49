"""Where a traced prefill and a traced decode spend their time on a GPU: torch's profiler over
one untraced and one traced run of the same prompt (gpu_check's random-weight model at
Llama-3.1-8B's attention geometry, bf16), the operators ranked by device time and by host time,
and the traced prefill's Python functions by cumulative time.

    python benchmarks/gpu_profile.py --device cuda --tokens 8192 --out gpu_profile.txt
    python benchmarks/gpu_profile.py --device cpu --small           # the script itself
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def profiled(label: str, run, device: str, rows: int) -> str:
    """``run()`` once under torch's profiler; its wall seconds and the top operators as text."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    averages = prof.key_averages()
    text = [f"=== {label}: {seconds * 1e3:.1f} ms wall"]
    if cuda:
        text.append(averages.table(sort_by="self_cuda_time_total", row_limit=rows))
    text.append(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    return "\n".join(text)


def python_profiled(label: str, run, rows: int) -> str:
    """``run()`` once under cProfile: where the host's Python time goes (functions by cumulative time)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(rows)
    return f"=== {label}, host functions by cumulative time\n{stream.getvalue()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rows", type=int, default=18, help="operators shown per table")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.small:
        args.tokens, args.new_tokens, args.layers = 256, 4, 2

    import torch
    from gpu_check import _default_tokenizer, build_model, source_of
    from trace_overhead import prose_prompt, traced_run, untraced_decode
    from transformers import AutoTokenizer

    from kvscope.cli import quiet_libraries
    from kvscope.tracing.runner import TraceSettings

    quiet_libraries().__enter__()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or _default_tokenizer())
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build_model(tokenizer, args.layers, args.device, dtype, args.small)
    prompt = prose_prompt(tokenizer, args.tokens)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    settings = TraceSettings(max_new_tokens=args.new_tokens, device=args.device, stop_at_eos=False)
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-prof-"))
    source = source_of("profile")
    counter = iter(range(100))

    def plain(steps):
        model.set_attn_implementation(settings.attn)
        return lambda: untraced_decode(model, ids, steps, sync)

    def traced(steps, mode):
        chosen = dataclasses.replace(settings, max_new_tokens=steps, attn_output=mode)
        out = workdir / f"t{next(counter)}.zarr"
        return lambda: traced_run(model, tokenizer, source, prompt, chosen, out, sync)

    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    head = (
        f"{name}, torch {torch.__version__}, {args.layers} layers, {ids.shape[1]} prompt / {args.new_tokens} new tokens"
    )
    report = [head]
    try:
        for warm in (plain(1), traced(1, "kernel"), traced(1, "probs")):
            warm()
        report.append(profiled("untraced prefill", plain(1), args.device, args.rows))
        for mode in ("kernel", "probs"):
            report.append(profiled(f"traced prefill ({mode}: one-step trace)", traced(1, mode), args.device, args.rows))
        report.append(python_profiled("traced prefill (probs: one-step trace)", traced(1, "probs"), 3 * args.rows))
        report.append(profiled(f"untraced {args.new_tokens} steps", plain(args.new_tokens), args.device, args.rows))
        report.append(
            profiled(
                f"traced {args.new_tokens} steps (probs)", traced(args.new_tokens, "probs"), args.device, args.rows
            )
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = "\n\n".join(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
