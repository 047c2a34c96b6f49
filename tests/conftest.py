"""Shared fixtures: the real SmolLM2, tiny random-weight models saved as real HF folders,
and a helper that runs the CLI in a subprocess exactly as a user would."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the environment every test sees (one compute thread per xdist worker, no hub) is set in the root conftest.py

# Tiny configs for speed; the tokenizer is SmolLM2's (real), so prompts are real text.
TINY_CONFIGS = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", num_attention_heads=6, num_key_value_heads=2),
    "mistral_sliding": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    "gemma2": dict(
        model_type="gemma2",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
    ),
    "llama_short": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48),
}


def run_cli(*args, timeout=600, check=False, env=None):
    """Run ``kvscope ARGS`` in a process of its own from the checkout; returns CompletedProcess
    (text). The process is forked from this worker's fork server (tests/forkserver.py), or, with
    ``env`` (variables a library may read at import) or ``KVSCOPE_TEST_FORKSERVER=0``, a fresh
    ``python cli.py ARGS``."""
    from tests import forkserver

    full_env = {**os.environ, **(env or {})}
    served = env is None and forkserver.enabled()
    command = [str(forkserver.client())] if served else [sys.executable, str(ROOT / "cli.py")]
    proc = subprocess.run(
        [*command, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"kvscope {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def script_python() -> str:
    """What runs ``python SCRIPT ARGS`` (analyses/ scripts) in the tests: this worker's fork server
    (tests/forkserver.py), or the interpreter itself with ``KVSCOPE_TEST_FORKSERVER=0``."""
    from tests import forkserver

    return str(forkserver.client("python")) if forkserver.enabled() else sys.executable


@dataclass
class Ran:
    """What :func:`run_main` saw: the shape of a CompletedProcess."""

    returncode: int
    stdout: str
    stderr: str


def run_main(*args) -> Ran:
    """``kvscope ARGS`` through the CLI's own ``main`` in this process: the same code a subprocess
    runs, without starting Python and torch again (tests that run many commands use it; each of
    them also runs a few as real subprocesses)."""
    from kvscope.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's own exits
            code = exc.code if isinstance(exc.code, int) else 1
    return Ran(code, out.getvalue(), err.getvalue())


def one_line_error(proc, needle: str) -> None:
    """A CLI run that refused its input: exit 2 and one line ``kvscope: error: …`` holding ``needle``."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvscope: error: ")
    assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


def tree_digest(path: Path) -> str:
    """sha256 over the names and contents of every file under ``path`` (a store left untouched keeps it)."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(autouse=True)
def _environment_kept():
    """No test leaves the process environment changed: dask's LocalCluster sets
    OMP/MKL/OPENBLAS_NUM_THREADS=1 in it, which every later subprocess (a CLI run, a shard)
    would inherit — another thread count, other float results."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from kvscope.model.loading import resolve

    return Path(resolve("smollm2-135m").load_path)


def shared_store(tmp_path_factory, name: str, build) -> Path:
    """The store ``name``, built once for the whole run by ``build(path)`` and shared by the test
    workers (each worker's session fixtures would otherwise trace it again); read-only to tests."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if base.name.startswith("popen-gw") else base) / "shared-stores"
    folder.mkdir(exist_ok=True)
    out = folder / name
    with FileLock(str(out) + ".lock"):
        if not out.exists():
            partial = folder / f".{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            build(partial)
            partial.rename(out)
    return out


@pytest.fixture(scope="session")
def qkv_trace(tmp_path_factory, smollm2_dir) -> Path:
    """A real SmolLM2 trace with q/k/v: one prose prompt of ~400 tokens, 64 steps (replay, allocation)."""
    import pydoc_data.topics as topics

    import kvscope

    text = topics.topics["assignment"][:1500]
    return shared_store(tmp_path_factory, "prose-qkv.zarr", lambda out: kvscope.trace(
        text, out, max_new_tokens=64, stop_at_eos=False, block_steps=16, record_qkv=True
    ))  # fmt: skip


@pytest.fixture(scope="session")
def prompts_qkv_trace(tmp_path_factory, smollm2_dir) -> Path:
    """A real SmolLM2 trace with q/k/v of three prose prompts (~170 tokens each), 40 steps: what
    needs several samples (intervals over prompts) at a small cost (the notebooks)."""
    import pydoc_data.topics as topics

    import kvscope

    texts = [topics.topics[name][:700] for name in ("assignment", "if", "while")]
    return shared_store(tmp_path_factory, "prompts-qkv.zarr", lambda out: kvscope.trace(
        texts, out, max_new_tokens=40, stop_at_eos=False, block_steps=16, record_qkv=True
    ))  # fmt: skip


@pytest.fixture(scope="session")
def small_qkv_trace(tmp_path_factory, smollm2_dir) -> Path:
    """A real SmolLM2 trace with q/k/v from the command line: one 300-token prose prompt, 16
    steps (validate and tune's live checks decode it again)."""
    return shared_store(tmp_path_factory, "small-qkv.zarr", lambda out: run_cli(
        "trace", "--workload", "prose", "--context", "300", "--samples", "1", "--max-new-tokens", "16",
        "--record", "qkv", "--out", out, "--quiet", check=True,
    ))  # fmt: skip


def build_tiny(kind: str, folder: Path, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.architectures import copy_tokenizer, saved_tokenizer

    if (folder / "config.json").is_file():
        return folder
    tokenizer = saved_tokenizer(tokenizer_dir)
    spec = dict(TINY_CONFIGS[kind])
    model_type = spec.pop("model_type")
    spec.setdefault("max_position_embeddings", 512)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        initializer_range=0.3,  # sharp, uneven attention: a harder test than near-uniform rows
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **spec,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    copy_tokenizer(tokenizer_dir, folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_dir):
    """kind -> folder of a tiny random-weight model (built once per session)."""
    base = tmp_path_factory.mktemp("tiny-models")
    return {kind: build_tiny(kind, base / kind, smollm2_dir) for kind in TINY_CONFIGS}


TINY_GQA_STEPS = 3  # decode steps of ``tiny_gqa_trace``


@pytest.fixture(scope="session")
def tiny_gqa_trace(tiny_models, tmp_path_factory):
    """The tiny GQA Llama prepared for live caches, its prompt's ids and a float32 q/k/v trace of a
    ~100-token prose prompt, ``TINY_GQA_STEPS`` steps: ``(model, ids, trace)``, shared by the press
    tests (tests/test_press_coverage.py, tests/test_press_model.py)."""
    from pydoc_data import topics

    import kvscope
    from kvscope.live import prepare
    from kvscope.model.loading import load, resolve

    folder = str(tiny_models["llama"])
    model, _ = load(resolve(folder))
    prepare(model)
    out = tmp_path_factory.mktemp("tiny-gqa") / "tiny.zarr"
    kvscope.trace(topics.topics["assignment"][:420], out, model=folder, max_new_tokens=TINY_GQA_STEPS,
                  stop_at_eos=False, record_qkv=True, dtype="float32")  # fmt: skip
    ds = kvscope.open_trace(out)
    return model, [int(t) for t in ds["tokens"].values[0, : int(ds.kvscope.prompt_len[0])]], out
