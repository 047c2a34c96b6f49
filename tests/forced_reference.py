"""A slow, sequential reference for forced replay on any architecture: one token per forward,
the model's own eager attention function (its module's ``eager_attention_forward``: learned
sinks, softcapping, MLA's heads as the model computes them) with one change — the mask a layer
gets is the policy's tier map of that step, per layer and head, as an additive mask. The policy
is driven exactly as a live cache drives it: the prompt's attention after the prefill, then per
step append, the row each unit's query heads saw (the eager weights, averaged over the unit's
heads), decide.

Eviction only (no quantized values are substituted): it checks forced replay's attention rule and
its closed loop on the architectures the live cache does not serve (sliding windows, learned
sinks, multi-head latent attention, hybrids); the live cache is the reference for quantizers.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import eager_mask

from kvscope.model.spec import ModelSpec
from kvscope.policies.driver import PolicyDriver
from kvscope.tiers import TIER_Q

NAME = "kvscope_test_masked_eager"


class MaskedEager:
    """The attention function: the model's own eager one, with ``masks[layer]`` (additive, ``[1,
    head, q, kv]``) where set; records each layer's weights."""

    def __init__(self):
        self.masks: dict[int, torch.Tensor] = {}
        self.weights: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        layer = int(module.layer_idx)
        mask = self.masks.get(layer, attention_mask)
        out, weights = eager(module, query, key, value, mask, **kwargs)
        self.weights[layer] = weights.detach()
        return out, weights


def load(folder):
    attention = MaskedEager()
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    model.set_attn_implementation(NAME)
    return model, attention


def _kv_group(weights: torch.Tensor, units: int) -> np.ndarray:
    """``[head, q, kv]`` → the kv-group rows ``[unit, q, kv]`` (mean over each unit's query heads)."""
    h = weights.shape[0]
    return weights.float().reshape(units, h // units, *weights.shape[1:]).mean(1).numpy()


def reference(folder, prompt: list[int], continuation: list[int], policy, spec_of, model_spec: ModelSpec, rope=None):
    """Per step KL(full ‖ policy) ``[S]`` and the final tier maps of ``policy`` under the cache spec
    ``spec_of`` (the replay's), decoding ``continuation`` after ``prompt``; ``model_spec``: the
    trace's (its cache units, its attention layers)."""
    model, attention = load(folder)
    units, stored = model_spec.n_kv_heads, model_spec.layer_index
    P, S = len(prompt), len(continuation)
    full = _full_log_probs(model, prompt, continuation)  # [S, vocab]
    state = policy.start(spec_of, rope=rope)
    driver = PolicyDriver(state)
    cache = _full_layers(DynamicCache(config=model.config))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, past_key_values=cache)
    prefill = [_kv_group(attention.weights[layer][0], units) for layer in stored]  # [unit, P, P] each
    colsum = np.stack([w.sum(1) for w in prefill]).astype(np.float64)
    obs = spec_of.tail_rows
    tail = np.stack([w[:, -obs:] if P >= obs else np.pad(w, ((0, 0), (obs - P, 0), (0, 0))) for w in prefill])
    driver.prefill(colsum, tail.astype(np.float32))
    cache = out.past_key_values
    kl = np.zeros(S)
    for t in range(1, S):
        qpos = P - 1 + t
        driver.append(qpos)
        held = state.tiers[..., : qpos + 1] >= TIER_Q  # [layer, unit, kv]
        attention.masks = {layer: _additive(held[i], model) for i, layer in enumerate(stored)}
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[continuation[t - 1]]]), use_cache=True, past_key_values=cache)
        cache = out.past_key_values
        attention.masks = {}
        logp = torch.log_softmax(out.logits[0, -1].float(), -1)
        ref = torch.from_numpy(full[t])
        kl[t] = float((ref.exp() * (ref - logp)).sum())
        row = np.stack([_kv_group(attention.weights[layer][0], units)[:, 0] for layer in stored])  # [layer, unit, kv]
        driver.decide(row if policy.observes else None)
    return kl, state.tiers


def _additive(held: np.ndarray, model) -> torch.Tensor:
    """``held [unit, kv]`` → ``[1, head, 1, kv]``: 0 where shown, the dtype's minimum where hidden."""
    heads = model.config.num_attention_heads
    mask = torch.from_numpy(held).repeat_interleave(heads // held.shape[0], dim=0)
    return torch.where(mask, 0.0, torch.finfo(torch.float32).min)[None, :, None, :]


def _full_layers(cache):
    """Sliding-window layers hold every position (the masks hide what left the window)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            cache.layers[i] = DynamicLayer()
    return cache


def _full_log_probs(model, prompt, continuation) -> np.ndarray:
    """``[S, vocab]``: step ``t``'s log-probabilities under full KV, one forward of the whole sequence."""
    ids = torch.tensor([list(prompt) + list(continuation[:-1])])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, -1).numpy()
