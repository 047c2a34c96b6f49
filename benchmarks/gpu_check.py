"""GPU check: capture = eager on the accelerator, trace overhead at 1K and 8K tokens, a replay.

Made for a CUDA machine (benchmarks/gpu_check.sh runs it there in a few minutes), and
runnable anywhere at a small size (``--device cpu --small``) to check the script itself. The
model is built in memory with random weights at Llama-3.1-8B's attention geometry (32 query /
8 KV heads, head_dim 128, hidden 4096; ``--layers`` of them) and SmolLM2's tokenizer, so no
weights travel: what is measured — capture correctness and the cost of tracing — depends on the
shapes and kernels, not on trained weights.

1. correctness: a float32 model on the device, a 512-token prose prompt + 16 steps traced with
   every head stored; each stored row, prefill column sum and tail row against the model's own
   eager ``output_attentions`` (max |capture − eager|), for sdpa and flash_attention_2 where
   installed.
2. overhead: the bf16 model, prompts of ``--tokens`` (1,024 and 8,192), 64 new tokens, traced
   (kv rows, fp16) under both layer-output modes (``--attn-output kernel`` and ``probs``) vs a
   plain untraced decode, medians of ``--repeats`` interleaved repeats.
3. replay: the 1,024-token trace recorded with q/k/v, 8 policies × 2 budgets, against one decode.
4. same output: the bf16 model's last logits over a prefill and 3 steps, plain sdpa against the
   same with explicit position ids and under kvscope's registered sdpa with a recorder active.

    python benchmarks/gpu_check.py --device cuda --out gpu_check.json
    python benchmarks/gpu_check.py --device cpu --small          # the script itself, small and fast
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

POLICIES = ["full", "streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", "oracle"]
GEOMETRY = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 14336}  # fmt: skip
SMALL = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 512,
}


def build_model(tokenizer, layers: int, device: str, dtype, small: bool):
    """A random-weight Llama at the chosen geometry, on ``device`` in ``dtype`` (seeded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), num_hidden_layers=layers, max_position_embeddings=32768, rope_theta=500000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **(SMALL if small else GEOMETRY),
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: decode every step
    return model


def source_of(label: str):
    from kvscope.model.loading import ModelSource

    return ModelSource(spec=label, kind="folder", load_path="", origin=f"{label} (random weights, seed 0)")


def check_capture(tokenizer, args, workdir: Path) -> dict:
    """Max |capture − eager| over rows, column sums and tail rows, per attention kernel and
    per layer-output mode (``sdpa+probs``: the outputs from the recorded probabilities)."""
    import numpy as np
    import torch
    from trace_overhead import prose_prompt

    import kvscope
    from kvscope.model.prompts import Prompt
    from kvscope.tracing.runner import TraceSettings, trace_loaded

    model = build_model(tokenizer, min(args.layers, 2), args.device, torch.float32, args.small)
    prompt = prose_prompt(tokenizer, 128 if args.small else 512)
    kernels = ["sdpa"] + (["flash_attention_2"] if _has_flash(args.device) else [])
    out = {}
    for kernel, output in [(k, "kernel") for k in kernels] + [(k, "probs") for k in kernels]:
        name = kernel if output == "kernel" else f"{kernel}+probs"
        store = workdir / f"capture-{name}.zarr"
        settings = TraceSettings(max_new_tokens=16, heads="all", dtype="float32", device=args.device, attn=kernel,
                                 attn_output=output, model_dtype="float32", stop_at_eos=False)  # fmt: skip
        trace_loaded(model, tokenizer, source_of("capture-check"), [Prompt(prompt, "pydoc_data")], store, settings)
        ds = kvscope.open_trace(store)
        p, n = int(ds.prompt_len[0]), int(ds.n_steps[0])
        tokens = ds.tokens.values[0, : p + n - 1].tolist()
        model.set_attn_implementation("eager")
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([tokens], device=args.device), output_attentions=True, use_cache=False)
        ref = torch.stack(ref.attentions, 1)[0].float().cpu().numpy()  # [layer, head, T, T]
        attn = ds.attn.values[0]  # [step, layer, head, pos]
        worst = max(float(np.abs(attn[t, :, :, : p + t] - ref[:, :, p - 1 + t, : p + t]).max()) for t in range(n))
        colsum = float(np.abs(ds.prefill_colsum.values[0][:, :, :p] - ref[:, :, :p, :p].sum(2)).max())
        out[name] = {"rows_max_abs": worst, "colsum_max_abs": colsum, "steps": n, "prompt_tokens": p}
    return out


def same_output(model, tokenizer, args, prompt_tokens: int) -> dict:
    """Does tracing change what the model computes? The last logits of a prefill and 3 greedy
    steps, bf16 on the device: plain ``sdpa`` without and with explicit position ids (as a trace
    passes them), and under kvscope's registered ``sdpa`` with a recorder active
    (``--attn-output kernel``); max |Δ| of each against the plain run and whether tokens agree."""
    import torch
    from trace_overhead import prose_prompt
    from transformers import DynamicCache

    from kvscope.model.spec import cache_keyword, returned_cache
    from kvscope.tracing.capture import AttentionRecorder, ForwardContext, implementation_name, register

    register()
    ids = tokenizer(prose_prompt(tokenizer, prompt_tokens), return_tensors="pt")["input_ids"].to(args.device)
    cfg, keyword = model.config, cache_keyword(model)

    def run(capture: bool, positions: bool):
        model.set_attn_implementation(implementation_name("sdpa") if capture else "sdpa")
        recorder = AttentionRecorder(n_layers=cfg.num_hidden_layers, n_stored_heads=cfg.num_key_value_heads)
        cache, logits, tokens = DynamicCache(config=cfg), [], []
        with torch.no_grad(), recorder.active():
            x, seq = ids, ids.shape[1]
            for t in range(4):
                recorder.enabled = capture
                recorder.begin(ForwardContext(seq_len=seq, pad=torch.zeros(1, dtype=torch.long, device=args.device)))
                pos = (
                    {"position_ids": torch.arange(seq - x.shape[1], seq, device=args.device)[None]} if positions else {}
                )
                out = model(input_ids=x, use_cache=True, logits_to_keep=1, **pos, **{keyword: cache})
                cache = returned_cache(out)
                logits.append(out.logits[:, -1].float())
                x = out.logits[:, -1:].argmax(-1)
                tokens.append(int(x))
                seq += 1
        return torch.cat(logits), tokens

    plain, plain_tokens = run(False, False)
    report = {"prompt_tokens": int(ids.shape[1])}
    for name, capture, positions in [("position_ids", False, True), ("kvscope_sdpa", True, True)]:
        logits, tokens = run(capture, positions)
        report[name] = {"max_abs": float((logits - plain).abs().max()), "tokens_equal": tokens == plain_tokens}
    model.set_attn_implementation("sdpa")
    return report


def _has_flash(device: str) -> bool:
    import importlib.util

    return device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None


def overhead(model, tokenizer, args, prompt_tokens: int) -> dict:
    """Traced vs untraced decode of one prompt, both layer-output modes (trace_overhead's
    interleaved repeats: medians of each traced run over the plain run of its repeat; the
    prefill over as many adjacent prefill pairs)."""
    import torch
    from trace_overhead import prefill_pairs, prose_prompt, run_repeats, summarize, untraced_decode

    from kvscope.tracing.runner import TraceSettings

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    prompt = prose_prompt(tokenizer, prompt_tokens)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(args.device)
    settings = TraceSettings(max_new_tokens=args.new_tokens, device=args.device, stop_at_eos=False)
    outputs = ("kernel", "probs")
    source = source_of("overhead")
    measured, _ = run_repeats(model, tokenizer, source, prompt, ids, settings, outputs, args.repeats, sync)
    pairs = prefill_pairs(model, tokenizer, source, prompt, ids, settings, outputs, args.repeats, sync)
    model.set_attn_implementation(settings.attn)
    # the control for tokens_equal_untraced: do two untraced decodes of the prompt agree at all?
    repeatable = untraced_decode(model, ids, settings.max_new_tokens, sync)[2] == measured[-1]["plain"]["tokens"]
    return {
        "prompt_tokens": int(ids.shape[1]),
        "untraced_repeatable": repeatable,
        **summarize(measured, outputs, pairs),
    }


def replay_check(model, tokenizer, args, workdir: Path, decode_s: float) -> dict:
    """A 1K trace with q/k/v replayed: 8 policies × 2 budgets, timed against one decode."""
    from trace_overhead import prose_prompt

    import kvscope
    from kvscope.model.prompts import Prompt
    from kvscope.tracing.runner import TraceSettings, trace_loaded

    store = workdir / "replay.zarr"
    settings = TraceSettings(max_new_tokens=args.new_tokens, device=args.device, stop_at_eos=False, record_qkv=True)
    prompt = prose_prompt(tokenizer, args.tokens[0])
    trace_loaded(model, tokenizer, source_of("replay"), [Prompt(prompt, "pydoc_data")], store, settings)
    t0 = time.perf_counter()
    result = kvscope.replay(store, POLICIES, [0.2, 0.5], n_boot=100)
    seconds = time.perf_counter() - t0
    fmm = {
        str(p): round(float(result["fmm_mean"].sel(policy=p, budget=0.2, allocation="uniform")), 4)
        for p in result["policy"].values
    }
    return {"seconds": seconds, "runs": len(POLICIES) * 2, "over_one_decode": seconds / decode_s, "fmm_at_0.2": fmm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the random model")
    ap.add_argument("--tokens", default="1024,8192", help="prompt lengths of the overhead runs")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a small geometry and short prompts (checks the script)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the default model's)")
    ap.add_argument("--out", default=None, help="write the report as JSON here too")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.small:
        args.tokens, args.new_tokens, args.layers = [128, 256], min(args.new_tokens, 8), min(args.layers, 2)

    import torch
    from transformers import AutoTokenizer

    from kvscope.cli import quiet_libraries

    quiet_libraries().__enter__()
    warnings.filterwarnings("ignore", message="Consolidated metadata")  # zarr's note on every store (script only)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or _default_tokenizer())
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-gpu-"))
    started = time.perf_counter()
    report = {"device": args.device, "device_name": _device_name(args.device), "torch": torch.__version__,
              "layers": args.layers, "geometry": SMALL if args.small else GEOMETRY}  # fmt: skip
    try:
        report["capture_vs_eager"] = check_capture(tokenizer, args, workdir)
        _say(report, "capture_vs_eager", started)
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model = build_model(tokenizer, args.layers, args.device, dtype, args.small)
        report["same_output"] = [same_output(model, tokenizer, args, n) for n in args.tokens]
        _say(report, "same_output", started)
        report["overhead"] = [overhead(model, tokenizer, args, n) for n in args.tokens]
        _say(report, "overhead", started)
        first = report["overhead"][0]
        report["replay"] = replay_check(
            model, tokenizer, args, workdir, first["plain_prefill_median_s"] + first["plain_decode_median_s"]
        )
        _say(report, "replay", started)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        report["seconds"] = time.perf_counter() - started
        text = json.dumps(_finite(report), indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text)


def _finite(x):
    """NaN and infinities → None (strict JSON); FMM is NaN when no horizon ends inside the trace."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _default_tokenizer() -> str:
    from kvscope.model.loading import resolve

    return resolve("smollm2-135m").load_path


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or platform.machine()


def _say(report: dict, key: str, started: float) -> None:
    print(
        f"[{time.perf_counter() - started:6.1f} s] {key}: {json.dumps(_finite(report[key]))}",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    main()
