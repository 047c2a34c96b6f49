"""Issue 13, "trust every input": models, prompts, options, store paths and locks that a hostile
but fair user hands kvscope end with one line and exit code 2, reach no network they were not
meant to, and leave every store as it was. The CLI runs through its own ``main`` in this process,
and as a real subprocess wherever the process matters (argv bytes, signals, the environment, a
file's encoding) and once per kind of command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kvscope
from kvscope.errors import KvscopeError
from kvscope.live.validate import validate

from .conftest import ROOT, one_line_error, run_cli, run_main, tree_digest

PROMPT = "Write one sentence about the sea."


def trace_args(model, out, *extra) -> list:
    return ["trace", "--model", model, "--max-new-tokens", "4", "--out", out, "--quiet", *extra]


# -- a failed trace, locks, links -------------------------------------------------------


class Stop(Exception):
    pass


def _stop_at(step: int):
    def progress(p):
        if p.steps_done > step:
            raise Stop

    return progress


def test_failure_before_the_first_commit_leaves_no_store(tmp_path, tiny_models):
    out = tmp_path / "t.zarr"
    kwargs = {"model": str(tiny_models["llama"]), "max_new_tokens": 12, "block_steps": 4, "stop_at_eos": False}
    with pytest.raises(Stop):
        kvscope.trace(PROMPT, out, progress=_stop_at(2), **kwargs)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(Stop):  # after a committed block the store stays, partial, and --resume continues it
        kvscope.trace(PROMPT, out, progress=_stop_at(6), **kwargs)
    assert kvscope.open_trace(out).attrs["steps_committed"] == [4]
    with pytest.raises(KvscopeError, match="holds a partial trace"):
        kvscope.trace(PROMPT, out, **kwargs)
    assert kvscope.trace(PROMPT, out, resume=True, **kwargs).steps == [12]


def test_interrupted_first_block_leaves_no_store_and_a_rerun_works(tmp_path):
    out = tmp_path / "t.zarr"
    cmd = [sys.executable, str(ROOT / "cli.py"), "trace", "--prompt", PROMPT, "--out", str(out), "--quiet",
           "--ignore-eos", "--max-new-tokens", "64", "--block-steps", "64"]  # fmt: skip
    # the child takes SIGINT as a terminal would deliver it, even when this suite runs where it is
    # ignored (a background job inherits SIG_IGN, and Python then never raises KeyboardInterrupt)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.time() + 300
    while not (out / "prefill_tail").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip() == "kvscope: interrupted", err
    assert list(tmp_path.iterdir()) == []
    cmd[cmd.index("--max-new-tokens") + 1] = "2"
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert kvscope.open_trace(out).attrs["status"] == "complete"


@pytest.fixture
def partial_store(tmp_path, tiny_models):
    out = tmp_path / "partial.zarr"
    kwargs = {"model": str(tiny_models["llama"]), "max_new_tokens": 12, "block_steps": 4, "stop_at_eos": False}
    with pytest.raises(Stop):
        kvscope.trace(PROMPT, out, progress=_stop_at(6), **kwargs)
    return out


def test_a_lock_that_is_a_link_is_never_followed(tmp_path, partial_store, tiny_models):
    outside = tmp_path / "precious.txt"
    outside.write_text("not kvscope's to truncate\n")
    lock = partial_store / ".kvscope-lock"
    lock.unlink()
    lock.symlink_to(outside)
    before = tree_digest(partial_store)
    args = ["trace", "--model", tiny_models["llama"], "--prompt", PROMPT, "--max-new-tokens", "12", "--block-steps",
            "4", "--ignore-eos", "--out", partial_store, "--quiet"]  # fmt: skip
    for flag in ("--force", "--resume"):
        one_line_error(run_main(*args, flag), ".kvscope-lock is a symbolic link")
    assert outside.read_text() == "not kvscope's to truncate\n"
    assert lock.is_symlink() and tree_digest(partial_store) == before


def test_out_that_is_a_link_is_never_written_through(tmp_path, partial_store, tiny_models):
    link = tmp_path / "link.zarr"
    link.symlink_to(partial_store)
    before = tree_digest(partial_store)
    proc = run_main(*trace_args(tiny_models["llama"], link, "--prompt", PROMPT, "--force"))
    one_line_error(proc, f"--out {link} is a symbolic link")
    with pytest.raises(KvscopeError, match="is a symbolic link"):
        kvscope.trace(PROMPT, link, model=str(tiny_models["llama"]), max_new_tokens=12, block_steps=4, resume=True)
    assert link.is_symlink() and tree_digest(partial_store) == before


# -- options ----------------------------------------------------------------------------


def test_non_finite_temperature(tmp_path, tiny_models):
    out = tmp_path / "never.zarr"
    proc = run_main(*trace_args(tiny_models["llama"], out, "--prompt", PROMPT, "--temperature", "nan"))
    one_line_error(proc, "--temperature must be a finite number (got nan)")
    assert not out.exists()


def test_flash_attention_is_traced_only_where_capture_needs_no_mask():
    """flash_attention_2 hands capture no mask tensor: a model with sliding-window layers and a
    batch of prompts of different lengths (left padding) are refused in one line, before any
    store exists; equal lengths and global attention pass."""
    from kvscope.model.spec import ModelSpec
    from kvscope.tracing.runner import TraceSettings, check_kernel

    fa2 = TraceSettings(attn="flash_attention_2", batch_size=2)
    spec = ModelSpec(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
    sliding = ModelSpec(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, sliding_window=8,
                        layer_types=("sliding_attention", "full_attention"))  # fmt: skip
    encoded = [[1, 2, 3], [4, 5, 6], [7, 8]]
    check_kernel(fa2, spec, encoded, [[0, 1]])
    check_kernel(TraceSettings(batch_size=2), sliding, encoded, [[1, 2]])  # sdpa sees the mask
    with pytest.raises(KvscopeError, match="samples 1–2 differ in length"):
        check_kernel(fa2, spec, encoded, [[0], [1, 2]])
    with pytest.raises(KvscopeError, match="sliding windows"):
        check_kernel(fa2, sliding, encoded, [[0]])


def test_numbers_of_the_python_api(tmp_path, tiny_models):
    model = str(tiny_models["llama"])
    for value in (float("inf"), float("-inf")):
        with pytest.raises(KvscopeError, match=rf"--temperature must be a finite number \(got {value}\)"):
            kvscope.trace(PROMPT, tmp_path / "a.zarr", model=model, max_new_tokens=2, temperature=value)
    with pytest.raises(KvscopeError, match=r"--max-new-tokens must be an integer \(got inf\)"):
        kvscope.trace(PROMPT, tmp_path / "a.zarr", model=model, max_new_tokens=float("inf"))
    with pytest.raises(KvscopeError, match=r"--sinks must be an integer"):
        kvscope.trace(PROMPT, tmp_path / "a.zarr", model=model, max_new_tokens=2, n_sink=2.5)
    # a tiny temperature is (nearly) greedy: it used to overflow to inf − inf and crash the sampler
    greedy = kvscope.trace(PROMPT, tmp_path / "g.zarr", model=model, max_new_tokens=6, stop_at_eos=False)
    cold = kvscope.trace(
        PROMPT, tmp_path / "c.zarr", model=model, max_new_tokens=6, stop_at_eos=False, temperature=1e-40
    )
    assert cold.texts == greedy.texts
    assert not (tmp_path / "a.zarr").exists()


# -- prompts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content,needle",
    [
        ('{"prompt": "caf\xe9 au lait"}\n'.encode("latin-1"), "is not UTF-8 text: byte 0xe9 at byte offset 15"),
        (b'{"prompt": "fine"}\n\x80\xff\x00\x13', "is not UTF-8 text: byte 0x80 at byte offset 19"),
    ],
    ids=["latin-1", "random-bytes"],
)
def test_prompts_file_that_is_not_utf8(tmp_path, tiny_models, content, needle):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(content)
    out = tmp_path / "never.zarr"
    proc = run_cli(*trace_args(tiny_models["llama"], out, "--prompts", prompts))
    one_line_error(proc, f"prompts file {prompts} {needle}")
    assert not out.exists()


def test_prompt_argument_with_undecodable_bytes(tmp_path, tiny_models):
    out = tmp_path / "never.zarr"
    argument = os.fsdecode(b"caf\xe9 au lait")  # the child's argv holds the raw byte 0xe9
    proc = run_cli(*trace_args(tiny_models["llama"], out, "--prompt", argument))
    one_line_error(proc, "prompt from cli is not UTF-8 text: byte 0xe9 at byte offset 3")
    assert not out.exists()
    with pytest.raises(KvscopeError, match="lone surrogate U\\+D800 at byte offset 2"):
        kvscope.trace("a \ud800", tmp_path / "api.zarr", model=str(tiny_models["llama"]), max_new_tokens=2)


@pytest.mark.slow
def test_one_token_prompt_on_smollm2(tmp_path, smollm2_dir):
    from .test_capture import check_against_eager

    out = tmp_path / "hi.zarr"
    run_cli("trace", "--prompt", "hi", "--max-new-tokens", "4", "--dtype", "float32", "--ignore-eos", "--out", out,
            "--quiet", check=True)  # fmt: skip
    ds = kvscope.open_trace(out)
    assert int(ds.prompt_len[0]) == 1 and ds.attrs["status"] == "complete"
    check_against_eager(ds, smollm2_dir, "kv")


# -- models ---------------------------------------------------------------------------


class SilentHub:
    """A local 'hub' that accepts connections and never answers: counts the requests a run makes."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.connections = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)

    def env(self, offline: bool = False) -> dict:
        port = self.sock.getsockname()[1]
        return {
            "HF_ENDPOINT": f"http://127.0.0.1:{port}",
            "HF_HUB_OFFLINE": "1" if offline else "",
            "HF_HUB_ETAG_TIMEOUT": "1",
        }

    def close(self):
        self.sock.close()
        for conn in self.connections:
            conn.close()


@pytest.fixture
def hub():
    server = SilentHub()
    yield server
    server.close()


def test_gguf_of_random_bytes_and_a_damaged_gguf(tmp_path, smollm2_dir):
    cache = {"KVSCOPE_CACHE": str(tmp_path / "cache")}
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(bytes(range(256)) * 16)
    out = tmp_path / "never.zarr"
    one_line_error(run_cli(*trace_args(noise, out, "--prompt", PROMPT), env=cache), "is not a GGUF file")
    from kvscope.model.loading import SHORT_NAMES, short_name_gguf

    damaged = tmp_path / "damaged.gguf"  # the real file's first 64 KiB: magic and header, cut short
    with open(short_name_gguf(SHORT_NAMES["smollm2-135m"]), "rb") as f:
        damaged.write_bytes(f.read(1 << 16))
    one_line_error(run_cli(*trace_args(damaged, out, "--prompt", PROMPT), env=cache), "cannot read GGUF file")
    assert not out.exists()


def _folder_with_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    text = edit(config)
    (dst / "config.json").write_text(text if isinstance(text, str) else json.dumps(config))
    return dst


AUTO_MAP = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda c: c.update(model_type="frobnicator", auto_map=AUTO_MAP), "needs custom code"),
        (lambda c: c.update(model_type="frobnicator"), "does not know its model_type 'frobnicator'"),
        (lambda c: '{"model_type": "llama", "hidden_', "config.json is not readable JSON"),
    ],
    ids=["auto_map", "unknown-type", "garbled"],
)
def test_model_folder_configs(tmp_path, tiny_models, edit, needle):
    folder = _folder_with_config(tiny_models["llama"], tmp_path / "model", edit)
    out = tmp_path / "never.zarr"
    proc = run_main(*trace_args(folder, out, "--prompt", PROMPT))
    one_line_error(proc, needle)
    if needle == "needs custom code":
        assert "pass --trust-remote-code" in proc.stderr
    assert not out.exists()


def test_config_that_is_not_an_object(tmp_path, tiny_models):
    from kvscope.model.loading import resolve

    folder = _folder_with_config(tiny_models["llama"], tmp_path / "model", lambda c: "[1, 2]")
    with pytest.raises(KvscopeError, match="config.json is not a JSON object"):
        resolve(str(folder))


def test_hub_id_offline_is_refused_without_a_request(tmp_path, hub):
    out = tmp_path / "never.zarr"
    proc = run_cli(*trace_args("org/no-such-model", out, "--prompt", PROMPT), env=hub.env(offline=True))
    one_line_error(proc, "HF_HUB_OFFLINE is set")
    assert hub.connections == [] and not out.exists()


@pytest.mark.parametrize("model", ["org/no-such-model", "modls/tiny"])  # a hub id, a mistyped local path
def test_unreachable_hub_is_one_request_and_one_line(tmp_path, hub, model):
    out = tmp_path / "never.zarr"
    started = time.monotonic()
    proc = run_cli(*trace_args(model, out, "--prompt", PROMPT), env=hub.env())
    one_line_error(proc, "cannot be reached: timed out")
    assert f"model {model!r} is not a local folder" in proc.stderr
    assert len(hub.connections) == 1  # no retries (they took ~50 s and 23 lines)
    assert time.monotonic() - started < 60 and not out.exists()


# -- validate: the model a store names, --live-out -------------------------------------


@pytest.fixture(scope="module")
def qkv_store(tmp_path_factory, tiny_models):
    out = tmp_path_factory.mktemp("inputs") / "full.zarr"
    kvscope.trace(
        PROMPT,
        out,
        model=str(tiny_models["llama"]),
        max_new_tokens=8,
        record_qkv=True,
        block_steps=4,
        stop_at_eos=False,
    )
    return out


def _with_model_name(src: Path, dst: Path, name: str) -> Path:
    """A copy of ``src`` whose attributes name another model (a crafted store)."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / "zarr.json").read_text())
    doc["attributes"]["model"]["name"] = name
    (dst / "zarr.json").write_text(json.dumps(doc))
    return dst


def test_a_model_dtype_the_store_records_is_checked(tmp_path, qkv_store):
    """validate and tune --check load the model in the dtype the store records: a crafted one is
    refused in one line naming the store, before any model loads."""
    crafted = tmp_path / "crafted.zarr"
    shutil.copytree(qkv_store, crafted)
    doc = json.loads((crafted / "zarr.json").read_text())
    doc["attributes"]["settings"]["model_dtype"] = "float7"
    (crafted / "zarr.json").write_text(json.dumps(doc))
    before = tree_digest(crafted)
    needle = f"the model_dtype that {crafted} records must be one of auto, float32, bfloat16, float16 (got 'float7')"
    one_line_error(run_main("validate", crafted, "--policy", "h2o", "--budget", "0.5"), needle)
    one_line_error(run_main("tune", crafted, "--policy", "h2o", "--budget", "0.5", "--check", "prose"), needle)
    assert tree_digest(crafted) == before


def test_validate_never_fetches_the_model_a_store_names(tmp_path, qkv_store, hub):
    crafted = _with_model_name(qkv_store, tmp_path / "crafted.zarr", "org/exfiltrate")
    before = tree_digest(crafted)
    proc = run_cli("validate", crafted, "--policy", "h2o", "--budget", "0.5", env=hub.env())
    one_line_error(proc, "a store's model is looked up locally only; pass --model")
    assert hub.connections == [] and tree_digest(crafted) == before


def test_validate_model_override_is_checked_against_the_recorded_weights(tmp_path, qkv_store, tiny_models, hub):
    crafted = _with_model_name(qkv_store, tmp_path / "crafted.zarr", "org/exfiltrate")
    other = run_main("validate", crafted, "--policy", "h2o", "--budget", "0.5", "--model", tiny_models["qwen2"])
    one_line_error(other, "pass --model with the same weights")
    assert "was traced with" in other.stderr
    same = run_cli(
        "validate", crafted, "--policy", "h2o", "--budget", "0.5", "--model", tiny_models["llama"], "--json",
        env=hub.env(),
    )  # fmt: skip
    assert same.returncode in (0, 1), same.stderr
    assert json.loads(same.stdout)["decisions_compared"] > 0 and hub.connections == []


def test_live_out_never_overwrites_the_input_or_an_existing_store(tmp_path, qkv_store, tiny_models):
    # the store names a model that is nowhere: each refusal comes before any model is looked up
    crafted = _with_model_name(qkv_store, tmp_path / "crafted.zarr", "org/nowhere")
    existing = tmp_path / "existing.zarr"
    shutil.copytree(qkv_store, existing)
    digests = {p: tree_digest(p) for p in (crafted, existing)}
    args = ("validate", crafted, "--policy", "h2o", "--budget", "0.5", "--live-out")
    one_line_error(run_main(*args, crafted, "--force"), "overlaps the input store")
    for live_out in (crafted / "inner.zarr", tmp_path, tmp_path / "alias.zarr"):  # inside it, around it, a link to it
        if live_out.name == "alias.zarr":
            live_out.symlink_to(crafted)
        with pytest.raises(KvscopeError, match="overlaps the input store"):
            validate(crafted, "h2o", 0.5, live_out=live_out, force=True)
    one_line_error(run_main(*args, existing), "exists; pass --force to overwrite it")
    assert {p: tree_digest(p) for p in digests} == digests
    proc = run_main(
        "validate", qkv_store, "--policy", "h2o", "--budget", "0.5", "--live-out", existing, "--force", "--json"
    )
    assert proc.returncode in (0, 1), proc.stderr
    assert "policy" in kvscope.open_trace(existing).attrs  # replaced by the live trace
