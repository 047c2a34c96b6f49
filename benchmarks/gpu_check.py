"""GPU check: capture = eager on the accelerator, and the cost of tracing at full depth and long context.

Made for a CUDA machine — ``benchmarks/gpu_check.sh`` runs it there as one command within ten
minutes — and runnable anywhere at a tiny size (``--quick``) to check the script itself. The model
is built in memory with random weights at Llama-3.1-8B's geometry (32 query / 8 KV heads,
head_dim 128, hidden 4096, MLP 14,336; ``--layers`` of them) and SmolLM2's tokenizer, so no weights
travel: what is measured — capture correctness and the cost of tracing — depends on the shapes and
kernels, not on trained weights.

The report names the commit (``--commit``, else git, else ``.gpu/commit`` written by
gpu_prepare.sh), the device and the versions, and is written to ``--out`` after every section, so a
run cut short keeps what finished; a section that would begin past ``--budget-s`` is recorded as
skipped, and a configuration stops repeating once the budget is spent (one measured repeat kept).

1. ``capture_vs_eager``: a float32 model (2 layers), a 512-token prose prompt + 16 steps traced
   with every head stored; each stored row, prefill column sum and tail row against the model's
   own eager ``output_attentions`` (max |capture − eager|), for sdpa and flash_attention_2 where
   installed, under both layer-output modes.
2. ``capture_bf16``: the bf16 model's capture (logits in bf16 accumulated in float32 where the
   device can: ``logits``) against float64 recomputed from the queries and keys it recorded
   (``--record qkv`` in float32, which holds bf16 values exactly): rows, column sums, tail rows.
3. ``same_output``: the bf16 model's last logits over a prefill and 3 steps, plain sdpa against
   the same with explicit position ids and under kvscope's registered sdpa with a recorder active.
4. ``overhead``: per configuration (layers × prompt tokens: 4 and 32 layers; 1K, 8K and 32K
   tokens), ``--new-tokens`` steps (256): an untraced decode and a trace under each layer-output
   mode (``kernel``, ``probs``), interleaved, ``--repeats`` measured repeats after a warm-up:
   medians of prefill, decode and end-to-end seconds and their ratios traced / untraced (the
   prefill's from adjacent one-step pairs, as trace_overhead.py), peak GPU memory of each run and
   its ratio, the writer's back-pressure (the decode loop's waits for a queued block) and the
   wait for the rows' copies off the device, and whether the traced tokens are the untraced ones
   (``untraced_repeatable``: two untraced decodes agree at all).
5. ``replay``: the 4-layer 1K trace recorded with q/k/v, 8 policies × 2 budgets, against one
   untraced decode of the same prompt and steps.

    python benchmarks/gpu_check.py --device cuda --out gpu_check.json
    python benchmarks/gpu_check.py --device cpu --quick          # the script itself, tiny and fast
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

POLICIES = ["full", "streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", "oracle"]
MODES = ("kernel", "probs")
GEOMETRY = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 14336}  # fmt: skip
SMALL = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 512,
}
# the configurations in the order they run (the ones the targets name first), and the
# seconds of budget a configuration must find left to begin
PLAN = [(4, 1024), (4, 8192), (32, 8192), (32, 1024), (32, 32768), (4, 32768)]
NEEDS_S = {4: 30.0, 32: 90.0}


def build_model(tokenizer, layers: int, device: str, dtype, small: bool):
    """A random-weight Llama at the chosen geometry, on ``device`` in ``dtype`` (seeded), made in
    that dtype (an 8B model is never held in float32 on the way)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), num_hidden_layers=layers, max_position_embeddings=131072, rope_theta=500000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **(SMALL if small else GEOMETRY),
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
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

    model = build_model(tokenizer, 2, args.device, torch.float32, args.small)
    prompt = prose_prompt(tokenizer, 128 if args.small else 512)
    kernels = ["sdpa"] + (["flash_attention_2"] if _has_flash(args.device) else [])
    out = {}
    for kernel, output in [(k, "kernel") for k in kernels] + [(k, "probs") for k in kernels]:
        name = kernel if output == "kernel" else f"{kernel}+probs"
        store = workdir / f"capture-{name}.zarr"
        settings = TraceSettings(max_new_tokens=16, heads="all", dtype="float32", device=args.device, attn=kernel,
                                 attn_output=output, model_dtype="float32", stop_at_eos=False)  # fmt: skip
        trace_loaded(
            model, tokenizer, source_of("capture-check"), [Prompt(prompt, "pydoc_data")], out=store, settings=settings
        )
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
        shutil.rmtree(store, ignore_errors=True)
    return out


def check_capture_bf16(tokenizer, args, workdir: Path) -> dict:
    """The bf16 model's capture against float64 recomputed from the q/k it recorded (float32
    storage holds bf16 values exactly): max |Δ| of decode rows, prefill column sums (relative) and
    tail rows; ``logits``: how capture multiplied them on this device."""
    import numpy as np
    import torch
    from trace_overhead import prose_prompt

    import kvscope
    from kvscope.model.prompts import Prompt
    from kvscope.tracing.runner import TraceSettings, trace_loaded

    dtype = _model_dtype(args.device)
    model = build_model(tokenizer, 2, args.device, dtype, args.small)
    prompt = prose_prompt(tokenizer, 128 if args.small else 1024)
    store = workdir / "capture-bf16.zarr"
    settings = TraceSettings(max_new_tokens=16, heads="all", dtype="float32", device=args.device, record_qkv=True,
                             stop_at_eos=False)  # fmt: skip
    trace_loaded(
        model, tokenizer, source_of("capture-bf16"), [Prompt(prompt, "pydoc_data")], out=store, settings=settings
    )
    ds = kvscope.open_trace(store)
    P, n, obs = int(ds.prompt_len[0]), int(ds.n_steps[0]), int(ds.attrs["obs_window"])
    T = P + n - 1  # the positions whose queries and keys were recorded
    q = torch.from_numpy(ds.q.values[0, :T]).to(args.device, torch.float64)  # [T, layer, head, D]
    k = torch.from_numpy(ds.k.values[0, :, :, :T]).to(args.device, torch.float64)  # [layer, kv_head, T, D]
    attn, colsum, tail = ds.attn.values[0], ds.prefill_colsum.values[0], ds.prefill_tail.values[0]
    scaling = q.shape[-1] ** -0.5
    worst = {"rows_max_abs": 0.0, "colsum_max_rel": 0.0, "tail_max_abs": 0.0}
    hide = torch.ones(T, T, dtype=torch.bool, device=args.device).triu(1)
    for layer in range(q.shape[1]):
        Q = q[:, layer].transpose(0, 1)  # [head, T, D]
        K = k[layer].repeat_interleave(Q.shape[0] // k.shape[1], dim=0)  # [head, T, D]
        a = torch.softmax((Q @ K.transpose(-1, -2) * scaling).masked_fill(hide, float("-inf")), -1).cpu().numpy()
        for t in range(n):
            row = attn[t, layer, :, : P + t] - a[:, P - 1 + t, : P + t]
            worst["rows_max_abs"] = max(worst["rows_max_abs"], float(np.abs(row).max()))
        exact = a[:, :P, :P].sum(1)
        rel = np.abs(colsum[layer, :, :P] - exact) / exact
        worst["colsum_max_rel"] = max(worst["colsum_max_rel"], float(rel.max()))
        diff = tail[layer, :, :, :P] - a[:, P - obs : P, :P]  # NaN beyond each row's query: left out
        worst["tail_max_abs"] = max(worst["tail_max_abs"], float(np.nanmax(np.abs(diff))))
    shutil.rmtree(store, ignore_errors=True)
    return {**worst, "logits": _logits(args.device, dtype), "model_dtype": str(dtype).removeprefix("torch."), "prompt_tokens": P,
            "steps": n}  # fmt: skip


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
            for _ in range(4):
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


def _model_dtype(device: str):
    import torch

    return torch.bfloat16 if device.startswith("cuda") else torch.float32


class Peak:
    """Peak GPU memory (GiB) of what runs inside (0 off CUDA)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.gib = 0.0

    def __enter__(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.gib = torch.cuda.max_memory_allocated() / 2**30


def overhead(model, tokenizer, args, prompt_tokens: int, repeats: int, deadline: float, workdir: Path) -> dict:
    """One configuration: untraced vs traced under each mode, interleaved (module docstring, 4.)."""
    import torch
    from trace_overhead import prefill_pairs, prose_prompt, summarize, traced_run, untraced_decode

    from kvscope.tracing.runner import TraceSettings

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    prompt = prose_prompt(tokenizer, prompt_tokens)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(args.device)
    settings = TraceSettings(max_new_tokens=args.new_tokens, device=args.device, stop_at_eos=False)
    source = source_of("overhead")
    runs, peaks, warm_tokens = [], [], None
    for r in range(repeats + 1):  # r = 0: the warm-up, dropped
        model.set_attn_implementation(settings.attn)
        with Peak(args.device) as peak:
            prefill, decode, tokens = untraced_decode(model, ids, settings.max_new_tokens, sync)
        measured = {"plain": {"prefill": prefill, "decode": decode, "tokens": tokens}}
        gib = {"plain": peak.gib}
        for mode in MODES:
            out = workdir / f"r{r}-{mode}.zarr"
            with Peak(args.device) as peak:
                measured[mode] = traced_run(
                    model, tokenizer, source, prompt, dataclasses.replace(settings, attn_output=mode), out, sync
                )
            gib[mode] = peak.gib
            shutil.rmtree(out, ignore_errors=True)
        _progress(f"{model.config.num_hidden_layers} layers, {ids.shape[1]} tokens, repeat {r}", measured)
        if r == 0:
            warm_tokens = tokens
            continue
        runs.append(measured)
        peaks.append(gib)
        if time.perf_counter() > deadline:
            break
    pairs = prefill_pairs(model, tokenizer, source, prompt, ids, settings, MODES, len(runs), sync)
    model.set_attn_implementation(settings.attn)
    report = {
        "layers": model.config.num_hidden_layers,
        "prompt_tokens": int(ids.shape[1]),
        "new_tokens": settings.max_new_tokens,
        "repeats": len(runs),
        "untraced_repeatable": warm_tokens == runs[-1]["plain"]["tokens"],
        "plain_peak_gib": statistics.median(g["plain"] for g in peaks),
        **summarize(runs, MODES, pairs),
    }
    for mode in MODES:
        report[mode]["peak_gib"] = statistics.median(g[mode] for g in peaks)
        report[mode]["peak_ratio"] = (
            statistics.median(g[mode] / g["plain"] for g in peaks) if peaks[0]["plain"] else None
        )
    return report


def _progress(label: str, measured: dict) -> None:
    parts = [f"{mode} {run['prefill']:.3f} + {run['decode']:.3f} s" for mode, run in measured.items()]
    print(f"  {label}: (prefill + decode) {', '.join(parts)}", file=sys.stderr, flush=True)


def replay_check(model, tokenizer, args, workdir: Path, prompt_tokens: int, decode_s: float) -> dict:
    """A trace with q/k/v replayed: 8 policies × 2 budgets, timed against one untraced decode."""
    from trace_overhead import prose_prompt

    import kvscope
    from kvscope.model.prompts import Prompt
    from kvscope.tracing.runner import TraceSettings, trace_loaded

    store = workdir / "replay.zarr"
    settings = TraceSettings(max_new_tokens=args.new_tokens, device=args.device, stop_at_eos=False, record_qkv=True)
    prompt = prose_prompt(tokenizer, prompt_tokens)
    trace_loaded(model, tokenizer, source_of("replay"), [Prompt(prompt, "pydoc_data")], out=store, settings=settings)
    t0 = time.perf_counter()
    result = kvscope.replay(store, POLICIES, [0.2, 0.5], n_boot=100)
    seconds = time.perf_counter() - t0
    fmm = {
        str(p): round(float(result["fmm_mean"].sel(policy=p, budget=0.2, allocation="uniform")), 4)
        for p in result["policy"].values
    }
    shutil.rmtree(store, ignore_errors=True)
    return {
        "layers": model.config.num_hidden_layers,
        "prompt_tokens": prompt_tokens,
        "new_tokens": args.new_tokens,
        "seconds": seconds,
        "runs": len(POLICIES) * 2,
        "one_decode_s": decode_s,
        "over_one_decode": seconds / decode_s,
        "fmm_at_0.2": fmm,
    }


class Run:
    """The report and its sections: each written to ``out`` once done; one that would begin with
    less than its need of the budget left is recorded as skipped."""

    def __init__(self, report: dict, out: Path | None, deadline: float):
        self.report, self.out, self.deadline = report, out, deadline
        self.started = time.perf_counter()

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def section(self, key: str, need_s: float, compute, *args, append: bool = False):
        """``compute(*args)`` as section ``key`` (appended to a list with ``append``)."""
        t0 = time.perf_counter()
        if self.left() < need_s:
            value = {"skipped": f"{self.left():.0f} s of the budget left, {need_s:.0f} s needed"}
        else:
            value = compute(*args)
            if isinstance(value, dict):
                value["section_s"] = round(time.perf_counter() - t0, 1)
        if append:
            self.report.setdefault(key, []).append(value)
        else:
            self.report[key] = value
        self.save()
        print(f"[{time.perf_counter() - self.started:6.1f} s] {key}: {json.dumps(_finite(value))}", file=sys.stderr,
              flush=True)  # fmt: skip
        return value

    def save(self) -> None:
        self.report["seconds"] = round(time.perf_counter() - self.started, 1)
        if self.out is not None:
            tmp = self.out.with_name(self.out.name + ".partial")
            tmp.write_text(json.dumps(_finite(self.report), indent=1))
            os.replace(tmp, self.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", default="4,32", help="decoder layers of the random models")
    ap.add_argument("--tokens", default="1024,8192,32768", help="prompt lengths of the overhead runs")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="measured repeats per configuration (2 at 32K tokens)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="seconds after which no section begins")
    ap.add_argument("--quick", "--small", action="store_true", help="a tiny geometry and short prompts (the script)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the default model's)")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git, else .gpu/commit)")
    ap.add_argument("--out", default=None, help="write the report as JSON here, after every section")
    args = ap.parse_args()
    args.small = args.quick
    layers = [int(n) for n in args.layers.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    plan = [(n, t) for n, t in PLAN if n in layers and t in tokens]
    plan += [(n, t) for n in layers for t in tokens if (n, t) not in plan]
    if args.quick:  # the same sections on a tiny model
        plan, args.new_tokens, args.repeats, args.budget_s = [(1, 64), (1, 128), (2, 64)], 8, 1, math.inf

    from transformers import AutoTokenizer

    from kvscope.cli import quiet_libraries

    quiet_libraries().__enter__()
    warnings.filterwarnings("ignore", message="Consolidated metadata")  # zarr's note on every store (script only)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or _default_tokenizer())
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-gpu-"))
    run = Run(_header(args, plan), Path(args.out) if args.out else None, time.perf_counter() + args.budget_s)
    run.save()
    dtype = _model_dtype(args.device)
    try:
        run.section("capture_vs_eager", 0, check_capture, tokenizer, args, workdir)
        run.section("capture_bf16", 0, check_capture_bf16, tokenizer, args, workdir)
        models = Models(tokenizer, args, dtype)
        first = plan[0]
        for n_layers, n_tokens in plan:
            model = models.get(n_layers)
            if "same_output" not in run.report:
                lengths = sorted({t for n, t in plan if n == n_layers})[:2]
                run.section(
                    "same_output", 0, lambda m, ts: [same_output(m, tokenizer, args, t) for t in ts], model, lengths
                )
            repeats = args.repeats if n_tokens < 32768 else min(args.repeats, 2)
            need = NEEDS_S.get(n_layers, 90.0) * (2 if n_tokens >= 32768 else 1)
            row = run.section(
                "overhead",
                need,
                overhead,
                model,
                tokenizer,
                args,
                n_tokens,
                repeats,
                run.deadline,
                workdir,
                append=True,
            )
            row.update(layers=n_layers, prompt_tokens=row.get("prompt_tokens", n_tokens))
        yardstick = run.report["overhead"][0]  # one untraced decode of the first configuration
        if "plain_decode_median_s" in yardstick:
            decode_s = yardstick["plain_prefill_median_s"] + yardstick["plain_decode_median_s"]
            model = models.get(first[0])
            run.section("replay", 30.0, replay_check, model, tokenizer, args, workdir, first[1], decode_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        run.save()
        print(json.dumps(_finite(run.report), indent=1))


def _header(args, plan) -> dict:
    import numpy
    import torch
    import transformers
    import zarr

    cuda = args.device.startswith("cuda")
    dtype = _model_dtype(args.device)
    return {
        "commit": args.commit or _commit(),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "zarr": zarr.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "model_dtype": str(dtype).removeprefix("torch."),
        "capture_logits": _logits(args.device, dtype),
        "geometry": SMALL if args.small else GEOMETRY,
        "plan": [{"layers": n, "prompt_tokens": t} for n, t in plan],
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "budget_s": args.budget_s,
    }


def _logits(device: str, dtype) -> str:
    """How capture multiplies queries and keys of ``dtype`` on ``device``."""
    import torch

    from kvscope.model import attention

    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float32:
        return "float32"
    if attention.accumulates_in_float32(torch.device(device), dtype):
        return f"{name}, accumulated in float32"
    return f"{name} upcast to float32"


def _commit() -> str:
    """This checkout's commit (``-dirty`` when the tree differs), else what gpu_prepare.sh wrote."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()  # fmt: skip
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        written = ROOT / ".gpu" / "commit"
        return written.read_text().strip() if written.is_file() else "unknown"


class Models:
    """The random model of the layers asked for, one on the device at a time."""

    def __init__(self, tokenizer, args, dtype):
        self.tokenizer, self.args, self.dtype = tokenizer, args, dtype
        self.layers, self.model = None, None

    def get(self, layers: int):
        if layers != self.layers:
            import gc

            import torch

            self.model = None
            gc.collect()
            if self.args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            self.model = build_model(self.tokenizer, layers, self.args.device, self.dtype, self.args.small)
            self.layers = layers
        return self.model


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


if __name__ == "__main__":
    main()
