"""The checks of the architecture conformance suite (tests/test_architectures.py), and the table
of docs/architectures.md they produce.

Every decoder-only architecture transformers ships is built tiny from its config (random
weights, peaked attention: :mod:`tests.architectures`) and either traced exactly or refused::

    exact     `kvscope trace --attn eager --heads all --record qkv` (without --record qkv where kvscope cannot
              see the queries and keys) and `--heads kv`: every stored row equals transformers'
              own eager attention (output_attentions) — per query head and averaged over each
              cache unit's heads — the learned sink's share equals 1 − Σ of the eager row, the
              tokens equal transformers' generate, `verify --deep` passes, and replay's full-KV
              bytes are what the cache geometry says (computed here from the config alone)
    refused   `kvscope trace` exits 2 with one line, and nothing is written

The traces run under ``--attn eager``, the reference's kernel: sdpa and eager round differently,
and a random-weight model with peaked attention amplifies that through its layers (Nemotron's
rows under sdpa differ from eager by 4.5e-6 on one CPU, 1.4e-5 on another) — a difference of
two kernels, not of kvscope, which the default kernel's real-model tests cover (SmolLM2).

    python -m tests.conformance [MODEL_TYPE ...]     the table (every decoder by default)
    python -m tests.conformance --write              … written into docs/architectures.md
"""

from __future__ import annotations

import inspect
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architectures.md"
PROMPT = "The quick brown fox jumps over the lazy dog because it was late for dinner."
STEPS = 4
ROWS_TOL = 1e-5  # docs/trace-format.md#capture: float32 rows within 1e-5 of eager output_attentions
BEGIN, END = "<!-- conformance table: python -m tests.conformance --write -->", "<!-- end of conformance table -->"


@dataclass
class Verdict:
    """What kvscope did with one architecture."""

    model_type: str
    architecture: str = ""
    status: str = ""  # exact | refused
    why: str = ""  # the one line of a refusal; what was left out of an exact trace
    geometry: str = ""  # GQA | MLA | hybrid | …, from the store's model config
    rows_max: float = float("nan")  # max |stored − eager| over every compared row
    problems: list[str] = field(default_factory=list)  # checks of an exact trace that failed

    @property
    def ok(self) -> bool:
        return self.status == "refused" or not self.problems

    def row(self) -> str:
        delta = "" if self.status != "exact" else f"{self.rows_max:.1e}"
        note = self.why.replace("|", "/")
        return f"| `{self.model_type}` | {self.architecture} | {self.geometry} | {self.status} | {delta} | {note} |"


def check(model_type: str, workdir: Path, tokenizer_dir: Path) -> Verdict:
    """Build, trace and compare one architecture (module docstring)."""
    from tests.architectures import build_tiny_model
    from tests.conftest import run_main

    folder = build_tiny_model(model_type, workdir / model_type, tokenizer_dir)
    verdict = Verdict(model_type, architecture=_architecture(folder))
    store = workdir / f"{model_type}-all.zarr"
    ran = run_main(*_trace_args(folder, store, "all", qkv=True))
    if ran.returncode == 2 and "--record qkv" in ran.stderr:
        verdict.why = "rows only (" + ran.stderr.strip().split(": ", 2)[-1] + ")"
        ran = run_main(*_trace_args(folder, store, "all", qkv=False))
    if ran.returncode != 0:
        return _refused(verdict, ran, store)
    kv_store = workdir / f"{model_type}-kv.zarr"
    kv_ran = run_main(*_trace_args(folder, kv_store, "kv", qkv=False))
    if kv_ran.returncode != 0:
        verdict.problems.append(f"--heads kv: {kv_ran.stderr.strip()}")
        return verdict
    verdict.status = "exact"
    _compare(verdict, folder, store, kv_store)
    return verdict


def _trace_args(folder: Path, store: Path, heads: str, qkv: bool) -> list:
    args = ["trace", "--prompt", PROMPT, "--model", folder, "--max-new-tokens", STEPS, "--heads", heads]
    args += ["--dtype", "float32", "--obs-window", 8, "--ignore-eos", "--quiet", "--out", store]
    args += ["--attn", "eager"]  # the reference's kernel: a difference is kvscope's, not two kernels' rounding
    return args + (["--record", "qkv"] if qkv else [])


def _architecture(folder: Path) -> str:
    import json

    return (json.loads((folder / "config.json").read_text()).get("architectures") or [""])[0]


def _refused(verdict: Verdict, ran, store: Path) -> Verdict:
    verdict.status = "refused"
    lines = ran.stderr.strip().splitlines()
    verdict.why = lines[-1].removeprefix("kvscope: error: ") if lines else ""
    if ran.returncode != 2 or len(lines) != 1 or not lines[0].startswith("kvscope: error: "):
        verdict.problems.append(f"not a one-line refusal (exit {ran.returncode}): {ran.stderr.strip()[:300]}")
    if store.exists():
        verdict.problems.append("a refused trace left a store behind")
    return verdict


def _compare(verdict: Verdict, folder: Path, store: Path, kv_store: Path) -> None:
    """The checks of an exact trace (module docstring), each failure one problem."""
    import kvscope
    from kvscope.storage.verify import verify

    ds, kv = kvscope.open_trace(store), kvscope.open_trace(kv_store)
    config = ds.attrs["model"]["config"]
    verdict.geometry = geometry_name(config)
    P, n = int(ds.prompt_len[0]), int(ds.n_steps[0])
    tokens = [int(t) for t in ds.tokens.values[0, : P + n]]
    layers = [int(x) for x in ds.layer.values]
    model = eager_model(folder)
    eager, generated = _eager(model, tokens, P, n, layers)
    ref = np.stack([eager[layer] for layer in layers])  # [layer, head, T, T]
    stored = ds.attn.values[0]  # [step, layer, H, pos]
    if "attn_learned_sink" in ds and _sums_to_one(ref, P, n):
        # the model scales its output by the sink after a plain softmax (Granite's sigmoid(lse − s)):
        # its returned rows sum to 1; its effective rows are those × (1 − σ), σ the share the trace
        # stored (checked against the sink logits by verify --deep)
        share = ds.attn_learned_sink.values[0]  # [step, layer, head]
        for t in range(n):
            ref[:, :, P - 1 + t] *= (1 - share[t])[..., None]
        verdict.why = "sink applied after the softmax: eager rows × (1 − σ), σ checked by verify --deep"
    deltas = [_rows_delta(stored, ref, P, n)]
    units = config["n_kv_heads"]
    per_unit = ref.reshape(len(layers), units, -1, *ref.shape[2:]).mean(2)  # [layer, unit, T, T]
    deltas.append(_rows_delta(kv.attn.values[0], per_unit, P, n))
    if "attn_learned_sink" in ds and not _sums_to_one(ref, P, n):
        shares = 1 - np.stack([ref[:, :, P - 1 + t, : P + t].sum(-1) for t in range(n)])  # [step, layer, head]
        deltas.append(float(np.abs(ds.attn_learned_sink.values[0, :n] - shares).max()))
    verdict.rows_max = max(deltas)
    if verdict.rows_max > ROWS_TOL:
        verdict.problems.append(f"rows differ from eager by {verdict.rows_max:.2e}")
    if generated != tokens:
        verdict.problems.append(f"tokens {tokens[P:]} ≠ generate's {generated[P:]}")
    if ds.attrs["record_qkv"]:
        report = verify(store, deep=True)
        if not report.ok:
            verdict.problems.append(f"verify --deep: {report.problems[0].line()}")
    _check_bytes(verdict, model, store, layers, P + n)


def eager_model(folder: Path):
    """The model saved in ``folder``, float32, under transformers' eager attention (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def _eager(model, tokens: list[int], P: int, n: int, layers: list[int]):
    """``({model layer: [head, T, T]}, generated tokens)`` of transformers' own eager attention,
    decoding as ``generate`` does: the prompt's rows from its forward, then each decode step's row
    from a forward of its one token on the cache (keys the cache no longer holds — a sliding
    window's — placed at their positions, 0 elsewhere). ``layers``: the attention layers, in case
    the model returns theirs only. ``model``: :func:`eager_model`."""
    import torch

    n_layers = model.config.get_text_config().num_hidden_layers
    T = P + n
    rows = {layer: None for layer in layers}
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens[:P]]), position_ids=torch.arange(P)[None],
                    output_attentions=True, use_cache=True)  # fmt: skip
        steps = [out]
        for t in range(1, n):
            out = model(input_ids=torch.tensor([[tokens[P - 1 + t]]]), position_ids=torch.tensor([[P - 1 + t]]),
                        **{cache_name: _cache_of(out)}, output_attentions=True, use_cache=True)  # fmt: skip
            steps.append(out)
        generated = model.generate(torch.tensor([tokens[:P]]), max_new_tokens=n, do_sample=False)[0].tolist()
    for t, step in enumerate(steps):
        weights = list(step.attentions)
        if len(weights) == n_layers:
            by_layer = {i: w for i, w in enumerate(weights) if w is not None}
        else:  # the attention layers' only (some hybrids)
            by_layer = dict(zip(layers, [w for w in weights if w is not None], strict=True))
        for layer in layers:
            w = by_layer[layer][0].float().numpy()  # [head, q, kv]
            if rows[layer] is None:
                rows[layer] = np.zeros((w.shape[0], T, T), dtype=np.float32)
            if t == 0:  # the prompt: every row over its keys
                rows[layer][:, :P, : w.shape[2]] = w
            else:  # one row over the keys the cache holds: the newest w.shape[2] positions
                q = P - 1 + t
                rows[layer][:, q, q + 1 - w.shape[2] : q + 1] = w[:, 0]
    return rows, generated[:T]


def _cache_of(out):
    """The cache a forward returned (``cache``, or the older ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _sums_to_one(ref: np.ndarray, P: int, n: int) -> bool:
    """The eager decode rows ``ref [layer, H, T, T]`` each sum to 1 (no sink's share taken out)."""
    sums = np.stack([ref[:, :, P - 1 + t, : P + t].sum(-1) for t in range(n)])
    return bool(np.abs(sums - 1).max() < 1e-5)


def _rows_delta(stored: np.ndarray, ref: np.ndarray, P: int, n: int) -> float:
    """max |stored − ref| over the decode rows ``stored [step, layer, H, pos]`` (``ref [layer, H, T, T]``)."""
    worst = 0.0
    for t in range(n):
        q = P - 1 + t
        worst = max(worst, float(np.abs(stored[t, :, :, : q + 1] - ref[:, :, q, : q + 1]).max()))
    return worst


def expected_full_bytes(model, layers: list[int], length: int, itemsize: int = 2) -> float:
    """What the model caches at full precision for ``length`` tokens, read off transformers' own
    cache after a forward (not kvscope's spec): per attention layer, K and V of its cache layer per
    token — or, under MLA, the latent of ``kv_lora_rank + qk_rope_head_dim`` values the model would
    cache (transformers caches the decompressed heads) — × ``min(length, window)`` tokens on a
    sliding-window cache layer. ``model``: :func:`eager_model`."""
    import torch

    cfg = model.config.get_text_config()
    with torch.no_grad():
        cache = _cache_of(model(input_ids=torch.ones((1, 4), dtype=torch.long), use_cache=True))
    total = 0
    for layer in layers:
        cached = cache.layers[layer]
        k, v = cached.keys, cached.values  # [1, kv_head, 4, D]
        per_token = k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]
        if getattr(cfg, "kv_lora_rank", None):
            per_token = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        window = getattr(cached, "sliding_window", None)
        total += (min(length, window) if window else length) * per_token
    return float(total * itemsize)


def _check_bytes(verdict: Verdict, model, store: Path, layers: list[int], length: int) -> None:
    import kvscope

    result = kvscope.replay(store, ["full", "streaming"], [0.5], errors=False, processes=0, threads=1)
    want = expected_full_bytes(model, layers, length)
    got = float(result["full_bytes"].values[0])
    if got != want:
        verdict.problems.append(f"replay's full-KV bytes {got:.0f} ≠ the geometry's {want:.0f}")
    used = float(np.nanmax(result["bytes_used"].sel(policy="streaming").values))
    if used > 0.5 * want * (1 + 1e-6):
        verdict.problems.append(f"streaming at β = 0.5 held {used:.0f} bytes of {want:.0f}")


def geometry_name(config: dict) -> str:
    """The cache geometry of a store's model config, in words."""
    parts = []
    if config.get("kv_latent_dim"):
        parts.append("MLA")
    elif config["n_kv_heads"] == config["n_heads"]:
        parts.append("MHA")
    else:
        parts.append("MQA" if config["n_kv_heads"] == 1 else "GQA")
    if config.get("attention_layers"):
        parts.append("hybrid")
    windows = config.get("layer_windows") or ()
    if any(w is not None for w in windows) or (
        not windows
        and (
            any(t == "sliding_attention" for t in config.get("layer_types") or ())
            or (config.get("sliding_window") and not config.get("layer_types"))
        )
    ):
        parts.append("sliding")
    if any(s is not None for s in config.get("learned_sinks") or ()):
        parts.append("learned sinks")
    if config.get("capture") == "output_attentions":
        parts.append("own attention modules")
    return ", ".join(parts)


def documented() -> dict[str, tuple[str, str]]:
    """model_type → (status, notes) as docs/architectures.md's table says."""
    text = DOC.read_text() if DOC.is_file() else ""
    table = text.split(BEGIN, 1)[-1].split(END, 1)[0] if BEGIN in text else ""
    pattern = r"^\| `([^`]+)` \|[^|]*\|[^|]*\| (exact|refused) \|[^|]*\| (.*) \|$"
    return {m.group(1): (m.group(2), m.group(3).strip()) for m in re.finditer(pattern, table, re.MULTILINE)}


def conformance_test(part: int, parts: int):
    """The test of every ``parts``-th decoder from ``part`` on (the suite's files split the
    architectures between the test workers): each is exact or refused as the table says, and an
    exact one passes every check."""
    import pytest

    from tests.architectures import decoders

    @pytest.mark.parametrize("model_type", decoders()[part::parts])
    def test_architecture(model_type, tmp_path, smollm2_dir):
        verdict = check(model_type, tmp_path, smollm2_dir)
        assert not verdict.problems, (verdict.row(), verdict.problems)
        want = documented().get(model_type)
        assert (verdict.status, verdict.why.replace("|", "/")) == want, (
            f"docs/architectures.md says {want}; regenerate it: python -m tests.conformance --write"
        )

    return test_architecture


def table(verdicts: list[Verdict]) -> str:
    head = "| model_type | class | cache geometry | verdict | max \\|Δ\\| | notes |\n|---|---|---|---|---|---|\n"
    return head + "\n".join(v.row() for v in verdicts) + "\n"


def tokenizer_dir() -> Path:
    """SmolLM2's folder: its tokenizer is every tiny model's."""
    from kvscope.model.loading import resolve

    return Path(resolve("smollm2-135m").load_path)


def main(argv: list[str]) -> int:
    from tests.architectures import decoders

    write = "--write" in argv
    types = [a for a in argv if not a.startswith("--")] or decoders()
    with tempfile.TemporaryDirectory() as tmp:
        verdicts = []
        for model_type in types:
            verdict = check(model_type, Path(tmp), tokenizer_dir())
            verdicts.append(verdict)
            print(verdict.row(), *(f"  PROBLEM {p}" for p in verdict.problems), sep="\n", flush=True)
    if write:
        text = DOC.read_text()
        before, rest = text.split(BEGIN, 1)
        DOC.write_text(before + BEGIN + "\n" + table(verdicts) + END + rest.split(END, 1)[1])
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
