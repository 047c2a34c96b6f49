"""Presses that load a learned asset for their model (``post_init_from_model``), and where it
comes from: the Hugging Face hub where it is reachable, else a local copy given as
``press:NAME:asset=FOLDER``. Where neither is there the press is refused in one line naming the
press, the asset and where kvpress fetches it.

    press                          asset                       kvpress fetches it from           a local copy
    QFilterPress                   Q-filters [layer, kv_head, D]  hub nthngdy/<model>_qfilt      QFilters.save_pretrained folder
    KVzapPress                     KVzap surrogate model       hub nvidia/KVzap-<type>-<model>   KVzapModel.save_pretrained folder
    DuoAttentionPress              head patterns               github mit-han-lab/duo-attention  config.json (sink_size, recent_size)
                                                                                                  + full_attention_heads.tsv [layer, kv_head]
    ExpectedAttentionStatsPress    query statistics            hub alessiodevoto/exp_att_stats_… its own stats_folder=…
    FastKVzipPress                 gates                       hub Jang-Hyun/Fast-KVzip          —
    RestoreKVPress                 restore embeddings, adapter hub higokri/RestoreKV-<model>     —
    LUKVPress                      budget curves               github baidu-baige/LU-KV          —

``<model>`` is the last part of the model's ``name_or_path``, as kvpress forms it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import KvscopeError, first_line


@dataclass(frozen=True)
class Asset:
    what: str
    source: str  # where kvpress fetches it, with <model> for the model's name

    def where(self, model) -> str:
        name = str(getattr(model.config, "name_or_path", "") or "").rstrip("/").split("/")[-1] or "?"
        return self.source.replace("<model>", name)


ASSETS = {
    "QFilterPress": Asset("learned Q-filters", "hub nthngdy/<model>_qfilt"),
    "KVzapPress": Asset("KVzap surrogate model", "hub nvidia/KVzap-<type>-<model>"),
    "DuoAttentionPress": Asset(
        "attention head patterns", "github.com/mit-han-lab/duo-attention attn_patterns for <model>"
    ),
    "ExpectedAttentionStatsPress": Asset("query statistics", "hub alessiodevoto/exp_att_stats_<model>_…"),
    "FastKVzipPress": Asset("Fast-KVzip gates", "hub Jang-Hyun/Fast-KVzip"),
    "RestoreKVPress": Asset("restore embeddings and adapter", "hub higokri/RestoreKV-<model>"),
    "LUKVPress": Asset("LU-KV budget curves", "github.com/baidu-baige/LU-KV curve for <model>"),
}
LOCAL = ("QFilterPress", "KVzapPress", "DuoAttentionPress")  # a local copy is given with asset=FOLDER


def prepare_assets(press, model, asset: str | None = None) -> None:
    """``press.post_init_from_model(model)``, each nested press's asset first taken from ``asset``
    (a local folder) where given; a press whose asset cannot be loaded is refused in one line."""
    from .kvpress_load import presses_in

    needing = [p for p in presses_in(press) if type(p).__name__ in ASSETS]
    if asset is not None:
        local = [p for p in needing if type(p).__name__ in LOCAL]
        if not local:
            raise KvscopeError(f"press {type(press).__name__} takes no local asset (asset= serves {', '.join(LOCAL)})")
        for p in local:
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
        p = needing[0]
        name = type(p).__name__
        spec = ASSETS[name]
        source = spec.where(model).replace("<type>", str(getattr(p, "model_type", "")))
        hint = (
            "; give a local copy with asset=FOLDER"
            if name in LOCAL
            else "; give a local copy with stats_folder=FOLDER"
            if name == "ExpectedAttentionStatsPress"
            else ""
        )
        raise KvscopeError(
            f"press {name} needs its {spec.what} from {source}, which cannot be loaded here "
            f"({first_line(error, named=True)}){hint}"
        ) from None
    finally:
        if asset is not None and any(type(p).__name__ == "DuoAttentionPress" for p in needing):
            from kvpress.presses import duo_attention_press

            duo_attention_press.cache.pop(model.config.name_or_path, None)  # read by this press only


def _install_local(press, model, folder: Path) -> None:
    """Put the asset in ``folder`` where the press's own ``post_init_from_model`` finds it (or,
    for QFilterPress, which always fetches, in its place)."""
    name = type(press).__name__
    if not folder.is_dir():
        raise KvscopeError(f"press {name}: asset {folder} is not a folder")
    try:
        if name == "QFilterPress":
            from kvpress.presses.qfilter_press import QFilters

            filters = QFilters.from_pretrained(str(folder)).q_filters.detach().to(model.dtype)
            _check_shape(name, folder, tuple(filters.shape), (_layers(model), _kv_heads(model), _head_dim(model)))
            press.q_filters = filters
            press.post_init_from_model = _loaded  # this object's own: kvpress's would fetch them again
        elif name == "KVzapPress":
            from kvpress.presses.kvzap_press import KVzapModel

            press.kvzap_model = KVzapModel.from_pretrained(str(folder))
            press.kvzap_model_name = ASSETS[name].where(model).replace("<type>", press.model_type).removeprefix("hub ")
        elif name == "DuoAttentionPress":
            import json

            import numpy as np
            from kvpress.presses import duo_attention_press

            config = json.loads((folder / "config.json").read_text())
            scores = np.clip(
                np.loadtxt(folder / "full_attention_heads.tsv", dtype=float, delimiter="\t", ndmin=2), 0, 1
            )
            _check_shape(name, folder, scores.shape, (_layers(model), _kv_heads(model)))
            # kvpress caches the pattern by the model's name: its own post_init_from_model then reads this one
            duo_attention_press.cache[model.config.name_or_path] = (
                int(config["sink_size"]), int(config["recent_size"]), scores,
            )  # fmt: skip
    except KvscopeError:
        raise
    except Exception as error:  # noqa: BLE001 - a folder that holds something else
        raise KvscopeError(f"press {name}: asset {folder} cannot be read ({first_line(error, named=True)})") from None


def _loaded(model) -> None:
    """The press's asset is in place already."""


def _check_shape(name: str, folder: Path, got: tuple, want: tuple) -> None:
    if got != want:
        raise KvscopeError(f"press {name}: asset {folder} has shape {list(got)}, the model needs {list(want)}")


def _layers(model) -> int:
    return int(model.config.num_hidden_layers)


def _kv_heads(model) -> int:
    return int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads)


def _head_dim(model) -> int:
    return int(getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads)
