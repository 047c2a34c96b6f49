"""What kvscope knows about each of kvpress's press classes, in one table (``TABLE``): the only
place in kvscope, besides the adapter (``kvscope.policies.kvpress_adapter``), that names a
kvpress class. Everything else asks the table through ``traits`` and the helpers below.

    reads        what its hook reads besides the handed cache: ``q, k, v`` (it runs on stand-ins
                 of the layers built from a recording), the layer's ``weights`` (a projection),
                 or the ``model`` itself (its protocol runs forwards, or it loads an asset)
    attentions   it reads the layer's attention weights (``output[1]``)
    rerotates    after it the continuation is numbered from the rows kept (kvpress's pipeline
                 rule); a string names the press's own field that says so
    decodes      it acts on decode forwards too; a string names the press's field that says so
    asset        a learned asset it loads for its model (``kvscope.policies.press_assets``)
    protocol     what it does besides its hook (``kvscope.policies.press_protocol``)
    budget       what β sets on it (``kvscope.policies.kvpress_bridge.fit_budget``)
    given        for a press no ratio sets: its own knob (it runs as given)
    asserted     a field it leaves out of its constructor and asserts is set later
    base         kvpress's base class, not a press

A press class the table does not hold (a press of one's own, by dotted path) takes the row of its
nearest kvpress ancestor, except that it runs on the model (the model's call is always exact):
only presses declared ``q, k, v`` here run on stand-ins. Traits of a press nested in another
(AdaKV wrapping SnapKV, ComposedPress, DecodingPress's base) combine over ``presses_in``: the
press reads what its most demanding part reads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from .kvpress_load import presses_in

# what a press reads, from least to most
QKV, WEIGHTS, MODEL = "q, k, v", "weights", "model"
READS = (QKV, WEIGHTS, MODEL)

# protocols: what a press does besides its hook on the prefill's forward
RECONSTRUCT = "reconstructs the context"  # extra forwards over the prefilled cache, then masks (its hook scores)
RECONSTRUCT_OWN = "reconstructs the context by its own hooks"  # the same, its own scoring forwards
MASKS_AFTER = "masks after the prefill"  # scores in the prefill's hooks, masks after it
RERUN_CONTEXT = "runs the context again"  # the context runs over its prefilled cache, then it compresses
QUESTION_WINDOW = "its window is the question at the prompt's end"  # no forward of its own
FORWARDS = (RECONSTRUCT, RECONSTRUCT_OWN, MASKS_AFTER, RERUN_CONTEXT)  # protocols that run the model
RECONSTRUCTS = (RECONSTRUCT, RECONSTRUCT_OWN)  # the hook does not run on the prefill's forward
MASKS = (RECONSTRUCT, RECONSTRUCT_OWN, MASKS_AFTER)  # masks set after the hooks: every layer is decided

# what β sets (``KNOBS``: the field it sets; ``kvscope.policies.kvpress_bridge.fit_budget``)
RATIO = "ratio"  # compute_n_kept(P, r) = n kept per (layer, kv_head)
LAYER_RATIO = "layer ratio"  # the smallest r whose per-layer budgets sum to L·n
GLOBAL_COUNT = "global count"  # ⌊L·H·P·r⌋ pruned over every layer and head
TARGET_SIZE = "target size"  # the decoding cache's size
TARGET_RATIO = "target ratio"  # the share of what it has seen a decoding press drops
PREFILL_DECODING = "prefill and decoding"  # its decoding press's target, its prefilling press's ratio
CHANNELS = "channels"  # key channels pruned
AS_GIVEN_KNOB = "as given"  # nothing: its own knob (``given``)
KNOBS = {
    RATIO: "compression_ratio",
    LAYER_RATIO: "compression_ratio",
    GLOBAL_COUNT: "compression_ratio",
    TARGET_SIZE: "target_size",
    TARGET_RATIO: "target_compression_ratio",
    PREFILL_DECODING: "decoding_press target_size, prefilling_press compression_ratio",
    CHANNELS: "key_channel_compression_ratio",
}
EXAMPLE = "KnormPress"  # the press kvscope names where one is asked for (Press's default, error messages)


@dataclass(frozen=True)
class Asset:
    """A learned asset a press loads for its model: what it is, where kvpress fetches it (``<model>``:
    the last part of the model's ``name_or_path``), and how a local copy is given instead."""

    what: str
    source: str
    local: str | None = None  # a local copy given with asset=FOLDER: which (``press_assets`` loads it)
    hint: str = ""  # how else a local copy is given

    def where(self, model, model_type: str = "") -> str:
        name = str(getattr(model.config, "name_or_path", "") or "").rstrip("/").split("/")[-1] or "?"
        return self.source.replace("<model>", name).replace("<type>", model_type)


@dataclass(frozen=True)
class AsGiven:
    """A press no ratio sets: its own knob, the default that compresses nothing, what decides instead."""

    knob: str
    default: object
    what: str


@dataclass(frozen=True)
class Asserted:
    """A field a press leaves out of its constructor and asserts is set, and what it is."""

    name: str
    what: str


@dataclass(frozen=True)
class Traits:
    """One row of the table (module docstring)."""

    reads: str = QKV
    attentions: bool = False
    rerotates: bool | str = False
    decodes: bool | str = False
    asset: Asset | None = None
    protocol: str | None = None
    budget: str = RATIO
    given: AsGiven | None = None
    asserted: Asserted | None = None
    base: bool = False

    def holds(self, press, trait: str) -> bool:
        """A flag trait (``rerotates``, ``decodes``) of ``press``: the row's, or the press's own field it names."""
        value = getattr(self, trait)
        return bool(getattr(press, value)) if isinstance(value, str) else value


_ON_MODEL = Traits(reads=MODEL)


def _asset(what: str, source: str, local: str | None = None, hint: str = "") -> Traits:
    return Traits(reads=MODEL, asset=Asset(what, source, local, hint))


TABLE: dict[str, Traits] = {
    "BasePress": Traits(base=True),
    "ScorerPress": Traits(base=True),
    # q, k, v only: they run on stand-ins of the layers offline
    **dict.fromkeys(
        ("KnormPress", "StreamingLLMPress", "SnapKVPress", "TOVAPress", "KeyDiffPress", "ExpectedAttentionPress",
         "AdaKVPress", "BlockPress", "CURPress", "CapPress", "ChunkKVPress", "ChunkPress", "EntropyGatedChunkKVPress",
         "LagKVPress", "MergingPress", "NonCausalAttnPress", "RandomPress"),
        Traits(),
    ),
    "ObservedAttentionPress": Traits(attentions=True),
    "PyramidKVPress": Traits(budget=LAYER_RATIO),
    "ThinKPress": Traits(budget=CHANNELS),
    "KeyRerotationPress": Traits(rerotates=True),
    "FinchPress": Traits(
        rerotates="rerotate_keys",
        protocol=QUESTION_WINDOW,
        asserted=Asserted(
            "window_size", "the question's tokens at the end of the prompt, which kvpress finds by a delimiter token"
        ),
    ),
    "DecodingPress": Traits(decodes=True, budget=TARGET_SIZE),
    "CAMPress": Traits(decodes=True, budget=TARGET_SIZE),
    "CompressionRatioDecodingPress": Traits(decodes=True, budget=TARGET_RATIO),
    "PrefillDecodingPress": Traits(decodes=True, budget=PREFILL_DECODING),
    "DMSPress": Traits(
        decodes="decoding", budget=AS_GIVEN_KNOB, given=AsGiven("threshold", None, "it evicts by a score threshold")
    ),
    "SimLayerKVPress": Traits(
        budget=AS_GIVEN_KNOB,
        given=AsGiven("lazy_threshold", 1.0, "it keeps whole layers or their ends by a threshold"),
    ),
    "PerLayerCompressionPress": Traits(
        budget=AS_GIVEN_KNOB, given=AsGiven("compression_ratios", None, "each layer's ratio is given")
    ),
    "ComposedPress": Traits(
        budget=AS_GIVEN_KNOB, given=AsGiven("presses", None, "its presses compress one after the other")
    ),
    # the layer's weights (a projection): offline on the trace's model
    **dict.fromkeys(("CriticalKVPress", "CriticalAdaKVPress", "LeverageScorePress", "CompactorPress"), Traits(WEIGHTS)),
    # their protocol runs the model
    "KVzipPress": Traits(MODEL, protocol=RECONSTRUCT, budget=GLOBAL_COUNT),
    "KVgradPress": Traits(MODEL, protocol=RECONSTRUCT_OWN, budget=GLOBAL_COUNT),
    "KVComposePress": Traits(MODEL, attentions=True, protocol=RERUN_CONTEXT, budget=GLOBAL_COUNT),
    # a learned asset for the model
    "QFilterPress": _asset("learned Q-filters", "hub nthngdy/<model>_qfilt", local="filters"),
    "KVzapPress": _asset("KVzap surrogate model", "hub nvidia/KVzap-<type>-<model>", local="surrogate"),
    "DuoAttentionPress": replace(
        _asset("attention head patterns", "github.com/mit-han-lab/duo-attention attn_patterns for <model>", "pattern"),
        budget=AS_GIVEN_KNOB,
        given=AsGiven("head_compression_ratio", 0.0, "it turns a share of heads into streaming heads"),
    ),
    "ExpectedAttentionStatsPress": _asset(
        "query statistics", "hub alessiodevoto/exp_att_stats_<model>_…", hint="stats_folder=FOLDER"
    ),
    "FastKVzipPress": replace(
        _asset("Fast-KVzip gates", "hub Jang-Hyun/Fast-KVzip"), protocol=MASKS_AFTER, budget=GLOBAL_COUNT
    ),
    "RestoreKVPress": replace(
        _asset("restore embeddings and adapter", "hub higokri/RestoreKV-<model>"),
        protocol=RECONSTRUCT,
        budget=GLOBAL_COUNT,
    ),
    "LUKVPress": _asset("LU-KV budget curves", "github.com/baidu-baige/LU-KV curve for <model>"),
}


def _of_kvpress(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "kvpress"


@functools.cache
def traits_of(cls: type) -> Traits:
    """The row of a press class: its own, or for a class the table does not hold its nearest
    kvpress ancestor's, run on the model (module docstring)."""
    for klass in cls.__mro__:
        row = TABLE.get(klass.__name__) if _of_kvpress(klass) else None
        if row is not None:
            return row if klass is cls else replace(row, reads=MODEL, base=False)
    return _ON_MODEL


def traits(press) -> Traits:
    """The row of a press object (its own class's, nested presses not combined)."""
    return traits_of(type(press))


def reads(press) -> str:
    """What ``press`` and the presses nested in it read, the most of them (``QKV``, ``WEIGHTS``, ``MODEL``)."""
    return max((traits(p).reads for p in presses_in(press)), key=READS.index)


def attentions(press) -> bool:
    """``press`` or a press nested in it reads the layer's attention weights."""
    return any(traits(p).attentions for p in presses_in(press))


def assets(press) -> list:
    """``[(nested press, Asset)]`` the learned assets ``press`` and its nested presses load."""
    return [(p, traits(p).asset) for p in presses_in(press) if traits(p).asset is not None]


def decodes(press) -> bool:
    """The press acts on decode forwards too (kvpress's pipeline keeps its hooks while decoding)."""
    return traits(press).holds(press, "decodes")


def rerotates(press) -> bool:
    """kvpress's pipeline rule: after this press the continuation is numbered from the rows kept."""
    return traits(press).holds(press, "rerotates")


def protocol(press) -> str | None:
    """What the press does besides its hook on the prefill's forward (None: nothing)."""
    return traits(press).protocol


def runs_the_model(press) -> bool:
    """The press's protocol runs the model beyond the prefill's forward, or finishes after it."""
    return protocol(press) in FORWARDS


def hooked_prefill(press) -> bool:
    """The press's hook runs on the prefill's forward (KVzip's only on its reconstruction forwards)."""
    return protocol(press) not in RECONSTRUCTS


def needs_model(press) -> str | None:
    """Why ``press`` needs the model itself offline (None: recorded q, k, v suffice), from the table."""
    for p in presses_in(press):
        row, name = traits(p), type(p).__name__
        if row.protocol in FORWARDS:
            return f"press {name} runs the model itself ({row.protocol})"
        if row.asset is not None:
            return f"press {name} loads its {row.asset.what} for the model"
        if row.reads == WEIGHTS:
            return f"press {name} reads the attention layer's weights"
        if row.reads == MODEL:
            return f"press {name} is not kvpress's: a press of one's own runs on the model"
    return None


LOCAL = tuple(name for name, row in TABLE.items() if row.asset is not None and row.asset.local)  # asset=FOLDER
