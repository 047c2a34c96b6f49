"""Press routing for forced replay: how each policy's state is started and driven, as a live cache
drives it — a prompt-time kvpress press decides from its hook on the model's own prefill
(``PrefillCapture``), a press that acts while decoding runs on stand-ins fed each forward's own
q/k/v, every other policy on what its cache served (or on nothing the decode computes)."""

from __future__ import annotations

import numpy as np


def decoding_press(policy) -> bool:
    """A kvpress press that acts while decoding (it reads each decode forward's q/k/v)."""
    from ...policies.press_traits import decodes

    return policy.reads_queries and decodes(policy.make_press())


def prompt_press(policy) -> bool:
    """A kvpress press that decides once, from its hook on the prompt's prefill (``PrefillCapture``)."""
    return policy.reads_queries and not decoding_press(policy)


def reads_prompt(policy, allocation) -> bool:
    """The run reads the prompt's attention (its policy, or the allocation's scores)."""
    return policy.observes or policy.observes_prefill or (allocation is not None and allocation.reads == "scores")


def reads_decodes(state) -> bool:
    """The state reads each decode forward's q/k/v (a decoding press on stand-ins)."""
    return getattr(state, "runner", None) is not None and state.decodes


def loop_of(policy, state) -> str:
    """How a policy's forced decode runs: ``closed`` (its maps follow what its cache served),
    ``one round`` (they do not depend on the decode) or ``open`` (the clairvoyant oracle: its
    look-ahead is the recorded full-KV future)."""
    if policy.clairvoyant:
        return "open"
    return "closed" if policy.observes or reads_decodes(state) else "one round"


def start_state(policy, cache_spec, *, model_spec, rope, capture):
    """The policy's state for a forced decode under ``cache_spec``: a prompt-time press on
    ``capture()`` (the sample's ``PrefillCapture``, made only for such a press); a decoding press on
    zeroed stand-ins ``keys``, ``values [layer, kv_head, P + S, D]``, ``queries [P + S, layer, head, D]``
    that the forced decode fills in as it computes them; any other policy from the cache spec alone."""
    if not policy.reads_queries:
        return policy.start(cache_spec, rope=rope)
    if not decoding_press(policy):
        return policy.start(cache_spec, rope=rope, model=model_spec, capture=capture())
    import torch

    n, m = cache_spec.final_len, model_spec
    keys = torch.zeros((m.n_layers, m.n_kv_heads, n, m.head_dim))  # [layer, kv_head, pos, D]
    values = torch.zeros((m.n_layers, m.n_kv_heads, n, m.v_dim))  # [layer, kv_head, pos, Dv]
    queries = np.zeros((n, m.n_layers, m.n_heads, m.head_dim), dtype=np.float32)  # [qpos, layer, head, D]
    return policy.start(cache_spec, k=keys, v=values, rope=rope, q=queries, model=model_spec)
