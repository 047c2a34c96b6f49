"""The families of docs/architectures.md, each through the readers a researcher uses: learned sinks
(gpt-oss), multi-head latent attention (DeepSeek-V2), a hybrid (Qwen3-Next), models that attend
in their own modules (BLOOM) and a position bias in the mask (Falcon's ALiBi) — traced as the
model computes, read by verify, the analyses and replay, and refused in one line where kvscope
cannot serve them. The conformance table itself runs in tests/test_conformance_*.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvscope
from kvscope.storage.verify import verify

from .architectures import build_tiny_model, decoders
from .conformance import documented
from .conftest import one_line_error, run_main

PROMPT = "The quick brown fox jumps over the lazy dog because it was late for dinner at home tonight."


@pytest.fixture(scope="module")
def arch(tmp_path_factory, smollm2_dir):
    """model_type → the folder of its tiny model (built once per module)."""
    base = tmp_path_factory.mktemp("architectures")
    built: dict[str, Path] = {}

    def get(model_type: str, **extra) -> Path:
        key = model_type + "".join(f"-{k}={v}" for k, v in sorted(extra.items()))
        if key not in built:
            built[key] = build_tiny_model(model_type, base / key, smollm2_dir, **extra)
        return built[key]

    return get


def _trace(folder: Path, out: Path, *extra) -> None:
    ran = run_main(
        "trace", "--prompt", PROMPT, "--model", folder, "--max-new-tokens", 12, "--ignore-eos", "--quiet",
        "--out", out, *extra,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr


@pytest.fixture(scope="module")
def sinks_store(arch, tmp_path_factory) -> Path:
    """gpt-oss with sink logits large enough to take a real share of every row (random ones
    next to peaked random attention take ~1e-5)."""
    import torch
    from transformers import AutoModelForCausalLM

    base = tmp_path_factory.mktemp("gpt-oss")
    model = AutoModelForCausalLM.from_pretrained(arch("gpt_oss"))
    for module in model.modules():
        if getattr(module, "sinks", None) is not None:
            module.sinks.data = torch.linspace(4.0, 12.0, module.sinks.numel())
    model.save_pretrained(base / "model")
    for src in arch("gpt_oss").iterdir():  # the tokenizer's files
        if not (base / "model" / src.name).exists():
            (base / "model" / src.name).write_bytes(src.read_bytes())
    out = base / "t.zarr"
    _trace(base / "model", out, "--record", "qkv", "--block-steps", 4)
    return out


@pytest.fixture(scope="module")
def mla_store(arch, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deepseek") / "t.zarr"
    _trace(arch("deepseek_v2"), out, "--record", "qkv", "--block-steps", 4)
    return out


def test_the_table_lists_every_decoder():
    """docs/architectures.md's table holds every decoder-only architecture, exact or refused."""
    assert sorted(documented()) == decoders()


def test_learned_sinks_are_kept_and_every_reader_understands_them(sinks_store):
    ds = kvscope.open_trace(sinks_store)
    assert "attn_learned_sink" in ds and ds.attrs["model"]["config"]["learned_sinks"]
    P, n = int(ds.prompt_len[0]), int(ds.n_steps[0])
    rows = ds.attn.values[0].astype(np.float64)  # [step, layer, kv_head, pos]
    sums = np.nansum(rows, -1)
    share = ds.attn_learned_sink.values[0]
    assert share[:n].mean() > 0.05 and share[:n].max() > 0.2  # the sinks take a real share of the rows
    np.testing.assert_allclose(sums[:n] + share[:n], 1.0, atol=2e-3)  # fp16 rows: their tolerance
    assert verify(sinks_store, deep=True).ok
    for command in (["analyze", "fmm"], ["analyze", "peaks"], ["analyze", "lir"], ["analyze", "concentration"]):
        ran = run_main(*command, sinks_store, "--json")
        assert ran.returncode == 0, (command, ran.stderr)
    result = kvscope.replay(sinks_store, ["h2o", "qevict"], [0.5], horizon=4, processes=0, threads=1)
    assert np.isfinite(result["output_rel_l2"].values).any() and np.isfinite(result["fmm"].values).any()
    exact = kvscope.replay(sinks_store, ["h2o"], [0.5], observe="exact", horizon=4, processes=0, threads=1)
    assert np.isfinite(exact["fmm"].values).any()
    assert P > 0


def test_a_learned_sink_share_that_does_not_fit_its_row_is_named(tmp_path, sinks_store):
    """A share that no longer makes its row sum to 1 − σ: verify names the rows' chunk, and a
    reader refuses in one line."""
    import shutil

    import zarr

    damaged = tmp_path / "d.zarr"
    shutil.copytree(sinks_store, damaged)
    group = zarr.open_group(str(damaged), mode="r+")
    share = group["attn_learned_sink"]
    share[0, :4] = np.clip(share[0, :4] + 0.2, 0, 1)
    report = verify(damaged)
    assert not report.ok and "less their learned sink's share" in report.problems[0].line()
    one_line_error(run_main("analyze", "fmm", damaged), "learned sink")


def test_mla_is_one_cache_unit_per_layer(mla_store):
    """DeepSeek-V2: kv-group rows average every head (one latent per layer); k and v are each head's
    own, v over its own size; replay evicts per (layer, token) and counts the latent's bytes."""
    ds = kvscope.open_trace(mla_store)
    config = ds.attrs["model"]["config"]
    assert ds.sizes["kv_head"] == 1 and config["kv_latent_dim"] == 16 + 8
    assert ds.k.dims == ("sample", "layer", "head", "pos", "dim") and ds.v.dims[-1] == "vdim"
    assert ds.sizes["dim"] == 24 and ds.sizes["vdim"] == 16
    assert verify(mla_store, deep=True).ok
    result = kvscope.replay(mla_store, ["h2o", "snapkv"], [0.5], horizon=4, processes=0, threads=1)
    assert result.sizes["kv_head"] == 1 and np.isfinite(result["output_rel_l2"].values).any()
    P, n = int(ds.prompt_len[0]), int(ds.n_steps[0])
    assert float(result["full_bytes"].values[0]) == ds.sizes["layer"] * (P + n) * 24 * 2
    exact = kvscope.replay(mla_store, ["h2o"], [0.5], observe="exact", horizon=4, processes=0, threads=1)
    assert np.isfinite(exact["fmm"].values).any()  # rows recomputed from every head's own q and k, per unit
    from_qk = run_main("analyze", "fmm", mla_store, "--from-qk", "--horizon", 4, "--json")
    assert from_qk.returncode == 0, from_qk.stderr
    one_line_error(run_main("replay", mla_store, "--policies", "kivi", "--budgets", "0.5"), "latent of 24 values")
    info = run_main("info", mla_store)
    assert "one latent of 24 values per token and layer (MLA)" in info.stdout


def test_a_hybrid_stores_its_attention_layers_under_the_models_indices(arch, tmp_path):
    folder = arch("qwen3_next")
    out = tmp_path / "t.zarr"
    _trace(folder, out)
    ds = kvscope.open_trace(out)
    kinds = json.loads((folder / "config.json").read_text())["layer_types"]
    attending = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    assert ds.layer.values.tolist() == attending and len(attending) < len(kinds)
    ran = run_main("analyze", "fmm", out, "--layers", attending[-1], "--json")
    assert ran.returncode == 0, ran.stderr
    result = kvscope.replay(out, ["h2o"], [0.5], horizon=4, processes=0, threads=1)
    assert result["layer"].values.tolist() == attending
    one_line_error(
        run_main("trace", "--prompt", PROMPT, "--model", folder, "--max-new-tokens", 4, "--policy", "h2o", "--budget", 0.5, "--out",
                 tmp_path / "live.zarr"),
        "caches other state",
    )  # fmt: skip
    assert not (tmp_path / "live.zarr").exists()


def test_a_model_that_attends_in_its_own_modules_is_recorded_from_its_attentions(arch, tmp_path):
    folder = arch("bloom")
    out = tmp_path / "t.zarr"
    one_line_error(
        run_main(
            "trace", "--prompt", PROMPT, "--model", folder, "--max-new-tokens", 4, "--record", "qkv", "--out", out
        ),
        "cannot see its queries and keys",
    )
    assert not out.exists()
    _trace(folder, out)
    ds = kvscope.open_trace(out)
    assert ds.attrs["attn_kernel"] == "eager" and ds.attrs["model"]["config"]["capture"] == "output_attentions"
    assert "rows from output_attentions" in run_main("info", out).stdout


def test_falcon_alibi_rows_hold_the_bias_and_qk_are_refused(arch, tmp_path):
    """Falcon with ALiBi adds the bias to the mask it hands the attention function: the rows hold
    it (equal to eager), rows recomputed from q/k would not — so --record qkv is refused."""
    from .conformance import Verdict, _compare

    folder = arch("falcon", alibi=True)
    out = tmp_path / "t.zarr"
    one_line_error(
        run_main(
            "trace", "--prompt", PROMPT, "--model", folder, "--max-new-tokens", 4, "--record", "qkv", "--out", out
        ),
        "ALiBi",
    )
    assert not out.exists()
    kv = tmp_path / "kv.zarr"
    for store, heads in ((out, "all"), (kv, "kv")):
        _trace(folder, store, "--heads", heads, "--dtype", "float32")
    verdict = Verdict("falcon", status="exact")
    _compare(verdict, folder, out, kv)
    assert not verdict.problems, verdict.problems


def test_a_model_without_attention_is_refused(tmp_path, smollm2_dir):
    """A pure state-space model (Mamba) has no attention for kvscope to record: one line, no store."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = AutoConfig.for_model("mamba", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2)
    torch.manual_seed(0)
    folder = tmp_path / "mamba"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "t.zarr"
    one_line_error(run_main("trace", "--prompt", PROMPT, "--model", folder, "--max-new-tokens", 4, "--out", out),
                   "cannot see it")  # fmt: skip
    assert not out.exists()
