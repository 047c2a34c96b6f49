"""Presses that load a learned asset for their model (``post_init_from_model``), and where it
comes from: the Hugging Face hub (or a repository) where it is reachable, else a local copy given as
``press:NAME:asset=FOLDER``. Where neither is there the press is refused in one line naming the
press, the asset and where kvpress fetches it. Which presses load which asset, and from where, is
the traits table's ``asset`` (``kvscope.policies.press_traits``); a local copy is one of

    filters     a ``QFilters.save_pretrained`` folder: Q-filters ``[layer, kv_head, D]``
    surrogate   a ``KVzapModel.save_pretrained`` folder
    pattern     ``config.json`` (sink_size, recent_size) + ``full_attention_heads.tsv [layer, kv_head]``

``<model>`` is the last part of the model's ``name_or_path``, as kvpress forms it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import KvscopeError, first_line
from . import kvpress_adapter as adapter
from .press_traits import LOCAL, assets, traits


def prepare_assets(press, model, asset: str | None = None) -> None:
    """``press.post_init_from_model(model)``, each nested press's asset first taken from ``asset``
    (a local folder) where given; a press whose asset cannot be loaded is refused in one line."""
    needing = assets(press)
    if asset is not None:
        local = [(p, a) for p, a in needing if a.local]
        if not local:
            raise KvscopeError(f"press {type(press).__name__} takes no local asset (asset= serves {', '.join(LOCAL)})")
        for p, _ in local:
            _install_local(p, model, Path(asset))
    try:
        press.post_init_from_model(model)
    except KvscopeError:
        raise
    except Exception as error:  # noqa: BLE001 - a hub or a URL that cannot be reached, an asset that is not there
        if not needing:
            raise KvscopeError(
                f"press {type(press).__name__} cannot be set up for this model ({first_line(error, named=True)})"
            ) from None
        p, spec = needing[0]
        source = spec.where(model, str(getattr(p, "model_type", "")))
        hint = "asset=FOLDER" if spec.local else spec.hint
        raise KvscopeError(
            f"press {type(p).__name__} needs its {spec.what} from {source}, which cannot be loaded here "
            f"({first_line(error, named=True)}){f'; give a local copy with {hint}' if hint else ''}"
        ) from None
    finally:
        if asset is not None and any(a.local == "pattern" for _, a in needing):
            adapter.forget_duo_pattern(model)  # read by this press only


def _install_local(press, model, folder: Path) -> None:
    """Put the asset in ``folder`` where the press's own ``post_init_from_model`` finds it (or,
    for QFilterPress, which always fetches, in its place)."""
    name = type(press).__name__
    if not folder.is_dir():
        raise KvscopeError(f"press {name}: asset {folder} is not a folder")
    try:
        _LOADERS[traits(press).asset.local](press, model, folder)
    except KvscopeError:
        raise
    except Exception as error:  # noqa: BLE001 - a folder that holds something else
        raise KvscopeError(f"press {name}: asset {folder} cannot be read ({first_line(error, named=True)})") from None


def _filters(press, model, folder: Path) -> None:
    filters = adapter.install_qfilters(press, str(folder), model.dtype)
    _check_shape(press, folder, tuple(filters.shape), (_layers(model), _kv_heads(model), _head_dim(model)))


def _surrogate(press, model, folder: Path) -> None:
    name = traits(press).asset.where(model, press.model_type).removeprefix("hub ")
    adapter.install_kvzap(press, str(folder), name)


def _head_pattern(press, model, folder: Path) -> None:
    import json

    import numpy as np

    config = json.loads((folder / "config.json").read_text())
    scores = np.clip(np.loadtxt(folder / "full_attention_heads.tsv", dtype=float, delimiter="\t", ndmin=2), 0, 1)
    _check_shape(press, folder, scores.shape, (_layers(model), _kv_heads(model)))
    adapter.install_duo_pattern(model, int(config["sink_size"]), int(config["recent_size"]), scores)


_LOADERS = {"filters": _filters, "surrogate": _surrogate, "pattern": _head_pattern}


def _check_shape(press, folder: Path, got: tuple, want: tuple) -> None:
    if got != want:
        name = type(press).__name__
        raise KvscopeError(f"press {name}: asset {folder} has shape {list(got)}, the model needs {list(want)}")


def _layers(model) -> int:
    return int(model.config.num_hidden_layers)


def _kv_heads(model) -> int:
    return int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads)


def _head_dim(model) -> int:
    return int(getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads)
