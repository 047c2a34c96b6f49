"""What transformers, torch, the disk and the JSON parser refuse ends in one line ``kvscope:
error: …`` naming the file and the cause, exit code 2, no traceback, no store changed: a model
config transformers' validation rejects (its reason quoted), truncated safetensors, a pickle
torch's weights-only load refuses (never run; the line says how to convert it), a disk that
fills up during ``trace`` (the committed steps kept for ``--resume``) and ``replay`` (the
result removed), metadata nested 50,000 levels deep.

The full disk is a small tmpfs mounted for the test where this machine allows it (root, as on
CI); elsewhere tests/diskfull.py fails zarr's file writes with ENOSPC instead (``small_disk``).
``KVSCOPE_TEST_DISKFULL=inject`` takes that way on any machine."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvscope

from .conftest import ROOT, one_line_error, run_cli, run_main, tree_digest
from .test_trace_shard import assert_same_store

PROMPT = "Write one sentence about the sea."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def trace_args(model, out, *extra) -> list:
    return ["trace", "--model", model, "--prompt", PROMPT, "--max-new-tokens", "4", "--out", out, "--quiet", *extra]


# -- model folders ------------------------------------------------------------------------


def config_only(tiny: Path, folder: Path, **changes) -> Path:
    """A model folder of ``tiny``'s tokenizer and its config with ``changes`` (no weights: the
    config is refused before any are looked for)."""
    folder.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, folder / name)
    config = json.loads((tiny / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_a_config_transformers_rejects_is_one_line_with_its_reason(tmp_path, tiny_models):
    tiny, out = tiny_models["llama"], tmp_path / "never.zarr"
    heads = config_only(tiny, tmp_path / "heads", num_attention_heads=5, num_key_value_heads=5)
    proc = run_cli(*trace_args(heads, out))
    one_line_error(
        proc,
        f"transformers refuses the model config {heads / 'config.json'}: "
        "The hidden size (64) is not a multiple of the number of attention heads (5).",
    )
    gemma4 = config_only(
        tiny, tmp_path / "gemma4", model_type="gemma4_text", architectures=["Gemma4ForCausalLM"],
        per_layer_config={"5": {"head_dim": 32}},
    )  # fmt: skip
    one_line_error(
        run_main(*trace_args(gemma4, out)),
        f"{gemma4 / 'config.json'}: `per_layer_config` keys must be integer layer indices in the range [0, 2); got [5].",
    )
    typed = config_only(tiny, tmp_path / "typed", num_attention_heads="four")
    one_line_error(
        run_main(*trace_args(typed, out)),
        "TypeError: Field 'num_attention_heads' expected int, got str (value: 'four')",
    )
    # the tokenizer alone (a workload's prompts are cut to a length in tokens) checks the config too
    workload = ("--workload", "prose", "--samples", "1", "--context", "200", "--max-new-tokens", "8")
    proc = run_main("trace", "--model", heads, *workload, "--out", out, "--quiet")
    one_line_error(proc, "The hidden size (64) is not a multiple of the number of attention heads (5).")
    assert not out.exists()


def test_truncated_weights_are_named(tmp_path, tiny_models):
    import torch
    from safetensors.torch import load_file

    tiny, out = tiny_models["llama"], tmp_path / "never.zarr"
    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    proc = run_cli(*trace_args(folder, out))
    one_line_error(proc, f"model weights {weights} are truncated or damaged: Error while deserializing header")
    pickled = tmp_path / "pickled"  # a pytorch_model.bin (a zip file torch.save wrote) cut short
    shutil.copytree(tiny, pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(tiny / "model.safetensors"), pickled / "pytorch_model.bin")
    with open(pickled / "pytorch_model.bin", "r+b") as f:
        f.truncate(4096)
    one_line_error(
        run_main(*trace_args(pickled, out)),
        f"model weights {pickled / 'pytorch_model.bin'} are truncated or damaged: PytorchStreamReader failed",
    )
    assert not out.exists()


class Payload:
    """What a hostile pickle holds: code its unpickler runs on load (here: it makes a folder)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def test_a_pickle_is_never_run_and_the_line_says_how_to_convert_it(tmp_path, tiny_models):
    import torch
    from safetensors.torch import load_file

    tiny, folder, out, marker = tiny_models["llama"], tmp_path / "pickled", tmp_path / "t.zarr", tmp_path / "code-ran"
    shutil.copytree(tiny, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(tiny / "model.safetensors")
    torch.save({**weights, "payload": Payload(marker)}, folder / "pytorch_model.bin")
    proc = run_cli(*trace_args(folder, out))
    pickle = folder / "pytorch_model.bin"
    one_line_error(proc, f"model weights {pickle} are a pickle that torch's weights-only load refuses")
    assert re.search(
        r"refuses \([^()]*GLOBAL os\.makedirs[^()]*\); loading it otherwise would run the code", proc.stderr
    )
    assert "convert it to safetensors once" in proc.stderr
    assert not marker.exists() and not out.exists()
    # the conversion the line gives, run as given by a user who trusts the file (it runs the payload)
    command = re.search(r'python -c "(.+?)" — and move', proc.stderr).group(1)
    exec(command, {})  # noqa: S102 - what python -c runs, without starting torch again
    assert marker.is_dir()
    pickle.rename(tmp_path / pickle.name)
    converted = load_file(folder / "model.safetensors")
    assert converted.keys() == weights.keys() and all(torch.equal(converted[k], weights[k]) for k in weights)
    assert run_main(*trace_args(folder, out)).returncode == 0


# -- a full disk ----------------------------------------------------------------------------


class SmallDisk:
    """A folder ``path`` with little room: a tmpfs of ``size`` bytes mounted there, or — where no
    tmpfs can be mounted — a folder where tests/diskfull.py fails zarr's writes after ``files``
    files (each CLI run then goes through it). ``fill`` takes room, ``free`` gives it back."""

    def __init__(self, path: Path, size: int, files: int):
        self.path, self.files, self.filler = path, files, path / "filler"
        path.mkdir()
        inject = os.environ.get("KVSCOPE_TEST_DISKFULL") == "inject"
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
        self.mounted = (
            not inject and os.geteuid() == 0 and subprocess.run(mount, check=False, capture_output=True).returncode == 0
        )
        self.full = False

    def fill(self, size: int) -> None:
        self.full = True
        if self.mounted:
            self.filler.write_bytes(b"\0" * size)

    def free(self) -> None:
        self.full = False
        self.filler.unlink(missing_ok=True)

    def run(self, *args, env=None):
        """``kvscope ARGS`` in a subprocess, on this disk as it is now."""
        if self.mounted or not self.full:
            return run_cli(*args, env=env)
        cmd = [sys.executable, "-m", "tests.diskfull", str(self.files), str(self.path), *map(str, args)]
        return subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, **(env or {})}
        )

    def contents(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if p != self.filler)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.path)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    disks = []

    def make(size: int, files: int) -> SmallDisk:
        disks.append(SmallDisk(tmp_path / f"disk{len(disks)}", size, files))
        return disks[-1]

    yield make
    for disk in disks:
        disk.close()


def needed_bytes(line: str) -> float:
    """The bytes a no-space line says are needed ("it needs about 272.0 KB")."""
    number, unit = re.search(r"it needs about ([\d.]+) (B|KB|MB|GB)", line).groups()
    return float(number) * 1024 ** ("B", "KB", "MB", "GB").index(unit)


def disk_usage(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def test_a_full_disk_during_trace_keeps_the_committed_steps_for_resume(tmp_path, tiny_models, small_disk):
    """64 steps in blocks of 4 take 272 KB of a tmpfs (a page per chunk): with 200 KB free the
    disk fills halfway. The store stays partial with the blocks committed before, every one of
    them whole (verify), and ``--resume`` once there is space ends in the store an uninterrupted
    trace writes, bit for bit."""
    model = tiny_models["llama"]
    reference = tmp_path / "reference.zarr"
    kvscope.trace(PROMPT, reference, model=str(model), max_new_tokens=64, block_steps=4, stop_at_eos=False)
    disk = small_disk(400 * 1024, files=100)
    disk.fill(200 * 1024)
    out = disk.path / "t.zarr"
    args = ("trace", "--model", model, "--prompt", PROMPT, "--max-new-tokens", "64", "--block-steps", "4",
            "--ignore-eos", "--out", out, "--quiet")  # fmt: skip
    proc = disk.run(*args)
    one_line_error(proc, f"no space left on device writing the trace store {out}: it needs about")
    assert re.search(
        r"; its \d+ committed steps are kept: free space, then run the same command with --resume$", proc.stderr.strip()
    )
    partial = kvscope.open_trace(out)
    committed = partial.attrs["steps_committed"][0]
    assert partial.attrs["status"] == "partial" and 0 < committed < 64 and committed % 4 == 0
    assert run_main("verify", out).returncode == 0
    disk.free()
    assert run_main(*args, "--resume").returncode == 0
    assert_same_store(reference, out)
    assert disk_usage(out) <= needed_bytes(proc.stderr)


def test_a_full_disk_during_replay_leaves_no_result(tmp_path, small_trace, small_disk):
    disk = small_disk(1024 * 1024, files=4)  # the result takes about 430 KB there
    disk.fill(924 * 1024)
    args = ("replay", small_trace, "--policies", "h2o,snapkv", "--budgets", "0.3,0.5", "--quiet")
    out = disk.path / "r.zarr"
    full = disk.run(*args, "--out", out)
    one_line_error(full, f"no space left on device writing the replay result {out}: it needs about")
    assert full.stderr.strip().endswith("; the partial result is removed")
    assert disk.contents() == []
    disk.fill(1016 * 1024)  # no --out: the tiers alone stream to a temporary folder
    proc = disk.run(*args, env={"TMPDIR": str(disk.path)})
    one_line_error(proc, f"writing the replayed tiers in the temporary folder {disk.path}: it needs about")
    assert proc.stderr.strip().endswith("set TMPDIR to a folder with space") and disk.contents() == []
    disk.free()
    assert run_main(*args, "--out", out).returncode == 0
    assert kvscope.open_result(out).sizes["policy"] == 2
    assert disk_usage(out) <= needed_bytes(full.stderr)


# -- metadata nested too deep ---------------------------------------------------------------

DEEP = "[" * 50_000 + "]" * 50_000


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory, tiny_models) -> Path:
    out = tmp_path_factory.mktemp("refusals") / "t.zarr"
    kvscope.trace(PROMPT, out, model=str(tiny_models["llama"]), max_new_tokens=16, block_steps=4, stop_at_eos=False)
    return out


def deepened(src: Path, dst: Path, member: str = "") -> Path:
    """A copy of the store ``src`` whose ``member/zarr.json`` nests a list 50,000 levels deep."""
    shutil.copytree(src, dst)
    meta = dst / member / "zarr.json"
    meta.write_text('{"deep": ' + DEEP + ", " + meta.read_text().lstrip()[1:])
    return dst


def test_metadata_nested_too_deep_is_refused_naming_the_file(tmp_path, small_trace, tiny_models):
    deep = deepened(small_trace, tmp_path / "deep.zarr")
    before = tree_digest(deep)
    needle = f"{deep / 'zarr.json'} nests its JSON too deep to be read"
    one_line_error(run_cli("info", deep), needle)
    for args in (("verify", deep), ("analyze", "fmm", deep), ("replay", deep, "--policies", "h2o", "--budgets", "0.5"),
                 trace_args(tiny_models["llama"], deep, "--resume")):  # fmt: skip
        one_line_error(run_main(*args), needle)
    array = deepened(small_trace, tmp_path / "array.zarr", "attn")
    one_line_error(run_main("info", array), f"{array / 'attn' / 'zarr.json'} nests its JSON too deep to be read")
    assert tree_digest(deep) == before
    result = tmp_path / "r.zarr"
    kvscope.replay(small_trace, ["h2o"], [0.5], n_boot=10, out=result)
    deep_result = deepened(result, tmp_path / "deep-result.zarr")
    one_line_error(run_main("compare", deep_result), f"{deep_result / 'zarr.json'} nests its JSON too deep to be read")


def test_a_model_config_or_prompts_file_nested_too_deep(tmp_path, tiny_models):
    folder = config_only(tiny_models["llama"], tmp_path / "model")
    (folder / "config.json").write_text(DEEP)
    one_line_error(
        run_main(*trace_args(folder, tmp_path / "never.zarr")),
        f"model config {folder / 'config.json'} is not readable JSON",
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + DEEP + "\n")
    args = (
        "trace",
        "--model",
        tiny_models["llama"],
        "--prompts",
        prompts,
        "--max-new-tokens",
        "4",
        "--out",
        tmp_path / "never.zarr",
    )
    one_line_error(run_main(*args), f"{prompts}:2: not a JSON object")
    assert not (tmp_path / "never.zarr").exists()
