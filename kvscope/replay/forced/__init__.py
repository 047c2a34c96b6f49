"""Forced replay: the model's own output under each policy's cache, offline (docs/concepts.md#forced-replay).

For a sample with prompt ``0..P−1`` and continuation ``y_0 … y_{S−1}`` (the trace's tokens), the
forced decode under a policy is one forward of the continuation over the prompt's prefill cache in
which query ``t`` (position ``P − 1 + t``) sees, per layer and cache unit, what the policy's tier
map ``T_t`` holds after it appended position ``P − 1 + t``::

    FP          the key/value as this forward computes it
    Q           the values the policy's write-once ledger quantized (the quantizer of
                docs/concepts.md#quantizer, applied to this forward's own K/V of the position, from
                the step the ledger quantized it on: after a decision at step t, from query t + 1)
    EVICTED     masked

    kl_t   = KL(softmax z*_t ‖ softmax z_t)          nats (z*: the same forward under full KV)
    nll_t  = −log softmax(z_t)[y_t]
    top1_t = [argmax z_t = argmax z*_t]
    hit_t  = [argmax z_t = y_t]                     (the first maximal index, as the greedy decode)
    rank_t = #{v : log softmax(z_t)[v] > log softmax(z_t)[y_t]}

Step 0 is the prefill's last row: every policy compresses after the prefill, so ``z_0 = z*_0``.
Where the continuation is a task's gold answer ``a_0 … a_{m−1}`` (``trace --dataset``), greedy
decoding under the cache emits it first iff every answer step is a hit (``answer_exact``:
docs/concepts.md#task-accuracy, ``kvscope.replay.result``). The argmax is taken over the
log-softmax in float32, the live decode's over the logits: the same index unless two logits round
to an exact tie (``ForcedRun._score``).

Closed loop. A policy that decides from what its cache served (``observes``: H2O, QEvict) or reads
each decode forward's tensors (kvpress's DecodingPress) changes its tier maps with the rows the
forward produces. The steps go in chunks of ``chunk``; in each, round 0 drives the policy on the
recorded full-KV rows restricted to its cache and renormalized (ordinary replay's ``observe=renorm``),
the chunk's forward runs under those maps, and round ``r + 1`` drives it again (from its state at
the chunk's start) on the rows the queries of round ``r`` really saw. When a round's tier maps (and
quantized groups) equal the previous round's, that forward is the live closed-loop forced decode
exactly — by causality a round makes one more step exact, so a chunk of ``c`` steps converges in at
most ``c + 1`` rounds. A chunk still changing after ``max_rounds`` keeps its last round and the
sample is marked not converged. A press that reads each decode forward's tensors runs step by step
(``ForcedRun._step``): step ``t``'s map is decided by the steps before it, so one forward of ``t``
is exact, and the press then decides on the q/k/v that forward computed — in chunks, each round
would make only one or two more of its steps exact. Policies whose maps do not depend on the decode (prompt-time
policies and presses, StreamingLLM, KIVI, LogQuant) need one round; the clairvoyant oracle's maps
come from the recorded future (open loop) and are labelled so.

Attention is the rule of ``kvscope.model.attention`` (fp32 logits and softmax, ``out = a·V`` in
the value's dtype, learned sinks and softcapping as the layer has them), through transformers'
``AttentionInterface`` (``kvscope.tracing.capture.attention_override``); the model classes are
not changed. Memory: a chunk's tier maps ``[chunk, layer, unit, P + S]`` and rows, never an
``[S, S]`` mask.

The package, one module per responsibility, each importing only modules listed before it:

    model       the trace's model, loaded once (``kvscope.replay.presses.TraceModel``) and checked
    quantized   the values a ledger's quantizations serve (``QuantLog``, ``ServedQuantized``)
    kernel      the attention of a chunk under its tier maps (``ChunkAttention``)
    routing     how a policy's state is started and driven (a press's prefill capture or stand-ins)
    loop        one run's closed loop, chunk by chunk in rounds (``ForcedRun``)
    prefill     a context's prefill, shared by the samples of its questions (``ContextPrefill``)
    sample      a sample's full-KV reference over its context's prefill (``SampleForcing``)
    tasks       a replay's forced decodes as tasks, one per context, here or on a cluster (``forced_replay``)
"""

from __future__ import annotations

from .loop import ForcedRun
from .model import ForcedModel, load_model
from .prefill import ContextPrefill, Prefill
from .sample import Reference, SampleForcing
from .tasks import ForcedOutputs, check_forced, forced_replay

__all__ = [
    "ContextPrefill",
    "ForcedModel",
    "ForcedOutputs",
    "ForcedRun",
    "Prefill",
    "Reference",
    "SampleForcing",
    "check_forced",
    "forced_replay",
    "load_model",
]
