"""Tiny random-weight models for every causal-LM architecture transformers knows.

``FAMILY`` classifies every key of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``:

- ``"decoder"``: a decoder-only text LM (dense, MoE, MLA, sinks, ALiBi, sliding windows, and hybrids
  that mix attention layers with linear-attention / SSM / convolution layers);
- ``"recurrent"``: no attention layer at all;
- ``"encoder-as-decoder"``: an encoder architecture run as a causal LM through ``is_decoder``;
- ``"encoder-decoder"``: a seq2seq model (its ``*ForCausalLM`` is the decoder half);
- ``"multimodal"``: a composite vision/audio + text model registered as a causal LM (its text-only
  sibling, where one exists, is classified on its own);
- ``"unbuildable"``: cannot be built or run here; ``UNBUILDABLE_WHY`` says why.

For every decoder, ``tiny_config`` builds a tiny config: the shared ``BASE`` (the values of
``build_tiny`` in ``tests/conftest.py``) plus that model's ``OVERRIDES``: 2 layers where the
architecture allows, both layer kinds present in hybrids and sliding-window models (with a window of
8, so that windows matter on a ~24-token prompt), 4 experts with 2 per token in MoE models, and small
MLA ranks with a value head size different from the query/key one. Each builds with
``AutoModelForCausalLM.from_config`` in float32 with eager attention, runs a forward with a cache,
returns attentions with ``output_attentions=True`` and generates, in well under 2 s on CPU.

No kvscope import here: the module is usable before kvscope is.
"""

from __future__ import annotations

import functools
from pathlib import Path

FAMILY: dict[str, str] = {
    "afmoe": "decoder",
    "apertus": "decoder",
    "apertus1p5_text": "decoder",
    "arcee": "decoder",
    "aria_text": "decoder",
    "axk1": "decoder",
    "axk2": "decoder",
    "bailing_hybrid": "decoder",
    "bamba": "decoder",
    "bart": "encoder-decoder",
    "beam": "decoder",
    "bert": "encoder-as-decoder",
    "bert-generation": "encoder-as-decoder",  # the BERT encoder as a decoder
    "big_bird": "encoder-as-decoder",  # block-sparse attention; full attention on short inputs
    "bigbird_pegasus": "encoder-decoder",
    "biogpt": "decoder",
    "bitnet": "decoder",
    "blenderbot": "encoder-decoder",
    "blenderbot-small": "encoder-decoder",
    "bloom": "decoder",
    "blt": "unbuildable",  # byte-level latent transformer (see UNBUILDABLE_WHY)
    "camembert": "encoder-as-decoder",
    "codegen": "decoder",
    "cohere": "decoder",
    "cohere2": "decoder",
    "cohere2_moe": "decoder",
    "cohere_compass_text": "decoder",
    "cpmant": "decoder",  # a decoder with a prompt prefix and bucketed relative positions
    "ctrl": "decoder",
    "cwm": "decoder",
    "data2vec-text": "encoder-as-decoder",
    "dbrx": "decoder",
    "deepseek_v2": "decoder",
    "deepseek_v3": "decoder",
    "deepseek_v32": "decoder",
    "deepseek_v4": "decoder",
    "diffllama": "decoder",
    "doge": "decoder",  # dynamic-mask attention
    "dory": "decoder",  # a middle block looped n_recurrent_loops times
    "dots1": "decoder",
    "dots3_note": "multimodal",
    "dots3_note_text": "decoder",
    "electra": "encoder-as-decoder",
    "emu3": "multimodal",  # text + VQ image tokenizer
    "ergo": "decoder",
    "ernie": "encoder-as-decoder",
    "ernie4_5": "decoder",
    "ernie4_5_moe": "decoder",
    "exaone": "decoder",
    "exaone4": "decoder",
    "exaone_moe": "decoder",
    "falcon": "decoder",
    "falcon_h1": "decoder",
    "falcon_mamba": "recurrent",
    "flex_olmo": "decoder",
    "flint": "decoder",
    "fuyu": "multimodal",
    "gemma": "decoder",
    "gemma2": "decoder",
    "gemma3": "multimodal",
    "gemma3_text": "decoder",
    "gemma3n": "multimodal",  # also needs timm (TimmWrapperModel) for its vision tower
    "gemma3n_text": "decoder",
    "gemma4": "multimodal",
    "gemma4_assistant": "unbuildable",  # a speculative-decoding assistant (see UNBUILDABLE_WHY)
    "gemma4_text": "decoder",
    "gemma4_unified": "multimodal",
    "gemma4_unified_assistant": "unbuildable",  # a speculative-decoding assistant (see UNBUILDABLE_WHY)
    "gemma4_unified_text": "decoder",
    "git": "multimodal",  # image-conditioned text decoder
    "glm": "decoder",
    "glm4": "decoder",
    "glm4_moe": "decoder",
    "glm4_moe_lite": "decoder",
    "glm_moe_dsa": "decoder",
    "got_ocr2": "multimodal",
    "gpt-sw3": "decoder",
    "gpt2": "decoder",
    "gpt_bigcode": "decoder",
    "gpt_neo": "decoder",
    "gpt_neox": "decoder",
    "gpt_neox_japanese": "decoder",
    "gpt_oss": "decoder",
    "gptj": "decoder",
    "granite": "decoder",
    "granite_swa": "decoder",
    "granitemoe": "decoder",
    "granitemoe_swa": "decoder",
    "granitemoehybrid": "decoder",
    "granitemoeshared": "decoder",
    "helium": "decoder",
    "hrm_text": "decoder",  # hierarchical reasoning model: two layer stacks run in cycles
    "hunyuan_v1_dense": "decoder",
    "hunyuan_v1_moe": "decoder",
    "hy_v3": "decoder",
    "hy_v4": "decoder",
    "hyperclovax": "decoder",
    "inkling2_loop_text": "decoder",
    "inkling2_text": "decoder",
    "inkling_text": "decoder",
    "internlm3": "decoder",
    "iquestcoder": "decoder",
    "jais2": "decoder",
    "jamba": "decoder",
    "jetmoe": "decoder",  # mixture of attention heads and of MLP experts
    "kimi_linear": "decoder",
    "kolibri1": "decoder",
    "kolibri1_1": "decoder",
    "laguna": "decoder",
    "lara_mini": "decoder",
    "lfm2": "decoder",
    "lfm2_moe": "decoder",
    "lfm3": "decoder",
    "llama": "decoder",
    "llama4": "multimodal",  # the composite (text + vision) config; llama4_text is the decoder
    "llama4_text": "decoder",
    "longcat_flash": "decoder",
    "mamba": "recurrent",
    "mamba2": "recurrent",
    "marian": "encoder-decoder",
    "mbart": "encoder-decoder",
    "megatron-bert": "encoder-as-decoder",
    "mellum": "decoder",
    "mimo_v2_flash": "decoder",
    "minicpm3": "decoder",
    "minicpm5_moe": "decoder",
    "minimax": "decoder",  # lightning (linear) attention layers interleaved with softmax ones
    "minimax_m2": "decoder",
    "minimax_m3_vl_text": "decoder",
    "ministral": "decoder",
    "ministral3": "decoder",
    "mistral": "decoder",
    "mixtral": "decoder",
    "mllama": "multimodal",  # its config is the composite (text + vision) one
    "modernbert-decoder": "decoder",
    "moshi": "decoder",  # MoshiForCausalLM is the text transformer alone (no audio modules)
    "moss_transcribe_diarize": "multimodal",
    "mpt": "decoder",
    "musicgen": "multimodal",  # text-conditioned audio-token decoder (an encoder-decoder config)
    "musicgen_melody": "multimodal",  # text/melody-conditioned audio-token decoder (an encoder-decoder config)
    "mvp": "encoder-decoder",
    "nanochat": "decoder",
    "nemotron": "decoder",
    "nemotron_h": "decoder",
    "olmo": "decoder",
    "olmo2": "decoder",
    "olmo3": "decoder",
    "olmo_hybrid": "decoder",
    "olmoe": "decoder",
    "openai-gpt": "decoder",
    "opt": "decoder",
    "param2moe": "decoder",
    "pegasus": "encoder-decoder",
    "persimmon": "decoder",
    "phi": "decoder",
    "phi3": "decoder",
    "phi4_multimodal": "multimodal",
    "phimoe": "decoder",
    "plbart": "encoder-decoder",
    "prophetnet": "encoder-decoder",
    "qwen2": "decoder",
    "qwen2_moe": "decoder",
    "qwen3": "decoder",
    "qwen3_5": "multimodal",
    "qwen3_5_moe": "multimodal",
    "qwen3_5_moe_text": "decoder",
    "qwen3_5_text": "decoder",
    "qwen3_moe": "decoder",
    "qwen3_next": "decoder",
    "qwen4_exp": "multimodal",
    "qwen4_exp_text": "decoder",
    "recurrent_gemma": "decoder",
    "reformer": "encoder-as-decoder",  # LSH/local attention; its LM head requires is_decoder=True
    "rembert": "encoder-as-decoder",
    "roberta": "encoder-as-decoder",
    "roberta-prelayernorm": "encoder-as-decoder",
    "roc_bert": "encoder-as-decoder",
    "roformer": "encoder-as-decoder",
    "rwkv": "recurrent",
    "sarvam_mla": "decoder",
    "sarvam_moe": "decoder",
    "seed_oss": "decoder",
    "smollm3": "decoder",
    "solar_open": "decoder",
    "stablelm": "decoder",
    "starcoder2": "decoder",
    "trocr": "encoder-decoder",  # the text decoder of a vision encoder-decoder
    "vaultgemma": "decoder",
    "whisper": "encoder-decoder",  # the text decoder of the speech encoder-decoder
    "xglm": "decoder",
    "xlm": "encoder-as-decoder",  # an encoder made causal by config.causal
    "xlm-roberta": "encoder-as-decoder",
    "xlm-roberta-xl": "encoder-as-decoder",
    "xlnet": "encoder-as-decoder",  # a permutation LM: bidirectional attention steered by perm_mask
    "xlstm": "recurrent",
    "xmod": "encoder-as-decoder",
    "youtu": "decoder",
    "zamba": "decoder",  # mamba layers + one attention block shared by several layers
    "zamba2": "decoder",  # mamba layers + attention blocks shared by several layers
    "zaya": "decoder",
}

UNBUILDABLE_WHY: dict[str, str] = {
    "blt": (
        "a byte-level model whose forward with use_cache=True fails in transformers 5.25: its local encoder, "
        "global transformer and local decoder all write their keys/values to the same cache layers"
    ),
    "gemma4_assistant": (
        "a speculative-decoding assistant: its forward requires inputs_embeds and shared_kv_states "
        "from a Gemma 4 target model, every layer reusing the target's keys/values"
    ),
    "gemma4_unified_assistant": (
        "a speculative-decoding assistant: its forward requires inputs_embeds and shared_kv_states "
        "from a Gemma 4 unified target model, every layer reusing the target's keys/values"
    ),
}

# Shared by every decoder; a model's OVERRIDES adjust it (never edit BASE for one model).
BASE: dict = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.3,  # sharp, uneven attention: a harder test than near-uniform rows
)

# A BASE key a model's config must not receive (a read-only property, or a name it rejects).
OMIT = object()
# An override value that ``tiny_config`` replaces with the tokenizer's vocabulary size.
VOCAB = object()

# Multi-head latent attention (DeepSeek-V2 style): small ranks, a value head size (16) unlike the
# query/key one (16 + 8), one KV head per query head.
MLA: dict = dict(
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_key_value_heads=4,
    head_dim=OMIT,  # the config derives it (the rope part of a query/key head)
)

OVERRIDES: dict[str, dict] = {
    "afmoe": dict(
        global_attn_every_n_layers=2,  # layers: sliding, full
        sliding_window=8,
        num_dense_layers=1,  # layer 0 dense, layer 1 MoE
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
    ),
    "apertus": {},
    "apertus1p5_text": {},
    "arcee": {},
    "aria_text": dict(moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1),
    "axk1": dict(
        MLA,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"],
    ),
    "axk2": dict(
        MLA,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"],
        index_topk=8,  # the indexer keeps 8 keys per query: sparsity shows on a 24-token prompt
        index_n_heads=2,
        index_head_dim=16,
    ),
    "bailing_hybrid": dict(
        MLA,
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"],
    ),
    "bamba": dict(
        attn_layer_indices=[1],  # layers: mamba, attention
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=16,
    ),
    "beam": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        mlp_layer_types=["dense", "sparse"],
        num_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
    ),
    "biogpt": {},
    "bitnet": {},
    "bloom": {},
    "codegen": dict(rotary_dim=4, n_inner=128),  # rotary on a quarter of the head, as by default (64 of 256)
    "cohere": {},
    "cohere2": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "cohere2_moe": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "cohere_compass_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        # rope per layer type; the multimodal rope's sections must add up to head_dim / 2
        rope_parameters={
            t: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
            for t in ("sliding_attention", "full_attention")
        },
    ),
    "cpmant": dict(dim_head=16, dim_ff=128),
    "ctrl": dict(dff=128),
    "cwm": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8),
    "dbrx": dict(
        hidden_size=OMIT,  # an alias applied after __post_init__, which copies d_model into ffn_config
        d_model=64,
        num_key_value_heads=OMIT,  # read from attn_config
        # DbrxAttention reads rope_theta (the config class lacks it) and clamps q/k/v with clip_qkv (None fails)
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
    ),
    "deepseek_v2": dict(
        MLA,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
    "deepseek_v3": dict(
        MLA,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
    "deepseek_v32": dict(
        MLA,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        index_topk=8,  # the indexer keeps 8 keys per query: sparsity shows on a 24-token prompt
        index_n_heads=2,
        index_head_dim=16,
    ),
    "deepseek_v4": dict(
        num_hidden_layers=3,  # one layer of each attention kind
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        num_key_value_heads=1,  # one shared key/value head
        sliding_window=8,
        # one compressed entry per 4 (CSA) or 8 (HCA) keys; the CSA indexer keeps 4 of its entries
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_topk=4,
        index_n_heads=2,
        index_head_dim=16,
        q_lora_rank=24,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "diffllama": {},
    "doge": dict(keep_window_size=8),  # dynamic masking keeps 8 keys per query: it shows on 24 tokens
    "dory": dict(
        num_hidden_layers=3,  # input, recurrent (looped twice), output
        n_input_layers=1,
        n_output_layers=1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=8,
    ),
    "dots1": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
    "dots3_note_text": dict(
        MLA,
        layer_types=["indexed_attention", "sliding_attention"],
        sliding_window=8,
        head_dim=24,  # qk_nope_head_dim + qk_rope_head_dim
        # the sliding-window layers' own MLA shapes
        swa_num_attention_heads=4,
        swa_num_key_value_heads=4,
        swa_q_lora_rank=24,
        swa_kv_lora_rank=16,
        swa_head_dim=24,
        swa_qk_nope_head_dim=16,
        swa_v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_experts_intermediate_size=32,
        index_topk=8,  # the indexer keeps 8 keys per query: sparsity shows on a 24-token prompt
        index_n_heads=2,
        index_head_dim=16,
    ),
    "ergo": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        first_dense_intermediate_size=128,
        moe_intermediate_size=32,
        shared_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "ernie4_5": {},
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_intermediate_size=32),
    "exaone": {},
    "exaone4": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "exaone_moe": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "falcon": dict(head_dim=OMIT, ffn_hidden_size=128),  # head_dim is a read-only property
    "falcon_h1": dict(
        mamba_d_ssm=128,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=16,
    ),
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2),
    "flint": dict(
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=8,
        mlp_only_layers=[0],  # layer 1 is MoE
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "gemma": {},
    # as in tests/conftest.py: the query scale of a real head (query_pre_attn_scalar = head_dim), and a
    # logit cap low enough to bite on sharp random weights
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0),
    "gemma3_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        query_pre_attn_scalar=16,  # = head_dim, as in the real models
    ),
    "gemma3n_text": dict(
        num_hidden_layers=4,  # the last two reuse the key/value states of the first two
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB,  # per-layer embeddings of every token id (262144 by default)
        laurel_rank=8,
    ),
    "gemma4_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        global_head_dim=32,  # the full-attention layers' head size (twice the sliding ones', as by default)
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB,  # per-layer embeddings of every token id (262144 by default)
    ),
    "gemma4_unified_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        global_head_dim=32,  # the full-attention layers' head size (twice the sliding ones', as by default)
    ),
    "glm": {},
    "glm4": {},
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "glm4_moe_lite": dict(MLA, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "glm_moe_dsa": dict(
        MLA,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        index_topk=8,  # the indexer keeps 8 keys per query: sparsity shows on a 24-token prompt
        index_n_heads=2,
        index_head_dim=16,
    ),
    "gpt-sw3": dict(n_inner=128),
    "gpt2": dict(n_inner=128),
    "gpt_bigcode": dict(n_inner=128),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),
    "gpt_neox": {},
    "gpt_neox_japanese": {},
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "gptj": dict(rotary_dim=4, n_inner=128),  # rotary on a quarter of the head, as by default (64 of 256)
    "granite": {},
    "granite_swa": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoe_swa": dict(
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"],  # mamba, attention
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
    ),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32),
    "helium": {},
    "hrm_text": dict(
        # num_hidden_layers counts the layers of each of the L and H stacks, which run in cycles:
        # 1 layer x 2 H-cycles x (1 L-step + 1 H-step) = 4 attention layers, each stack's weights used twice
        num_hidden_layers=1,
        H_cycles=2,
        L_cycles=1,
        L_bp_cycles=[1],
    ),
    "hunyuan_v1_dense": {},
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "hy_v3": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "hy_v4": dict(
        MLA,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        index_topk=8,  # the indexer keeps 8 keys per query: sparsity shows on a 24-token prompt
        index_n_heads=2,
        index_head_dim=16,
    ),
    "hyperclovax": {},
    "inkling2_loop_text": dict(
        num_hidden_layers=3,  # layer 1 runs twice: 4 attention layers in all
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
        n_layers_per_attn_res_block=1,  # the loop must start and end on a block boundary
        loop_layer_index_start=1,
        loop_layer_index_end=2,
        loop_num_passes=2,
        loop_gate_rank=8,
        sliding_window=8,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        unpadded_vocab_size=VOCAB,  # the LM head's width (200058 by default)
        intermediate_size=OMIT,  # an alias of moe_intermediate_size here
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
    ),
    "inkling2_text": dict(
        layer_types=["hybrid_sliding", "hybrid"],
        sliding_window=8,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        unpadded_vocab_size=VOCAB,  # the LM head's width (200058 by default)
        intermediate_size=OMIT,  # an alias of moe_intermediate_size here
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
    ),
    "inkling_text": dict(
        layer_types=["hybrid_sliding", "hybrid"],
        sliding_window=8,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
    ),
    "internlm3": {},
    "iquestcoder": {},
    "jais2": {},
    "jamba": dict(
        attn_layer_period=2,  # layers: mamba, attention
        attn_layer_offset=1,
        expert_layer_period=2,  # layer 1 is MoE
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        use_mamba_kernels=False,
    ),
    # mixture of attention heads: num_attention_heads = num_key_value_heads x num_experts_per_tok = 4
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "kimi_linear": dict(
        MLA,
        q_lora_rank=None,  # as in the released model
        layer_types=["linear_attention", "full_attention"],
        linear_num_heads=4,
        linear_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "kolibri1": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "kolibri1_1": dict(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "indexed_attention", "indexed_attention"],
        index_layers=[1],  # layer 1 selects the keys; layer 2 reuses its selection pool
        kv_source_layers=[0, 1, 1],  # and its keys/values
        sliding_window=8,
        # each query sees 1 sink + 4 selected + 2 local keys, out of a pool of 4 blocks of 4
        index_topk=4,
        index_num_sink_tokens=1,
        index_num_local_tokens=2,
        index_pool_size=16,
        index_compression=4,
        index_num_heads=2,
        mlp_only_layers=[0],
        mlp_only_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "laguna": dict(
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=8,
        num_attention_heads_per_layer=[4, 8],  # the head count may differ by layer
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "lara_mini": dict(
        num_hidden_layers=3,  # one layer of each kind
        layer_types=["linear_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"], block_multiple_of=32),
    "lfm2_moe": dict(
        layer_types=["conv", "full_attention"],  # required: there is no default
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "lfm3": dict(
        num_hidden_layers=3,  # one layer of each kind
        layer_types=["conv", "sliding_attention", "full_attention"],
        sliding_window=8,
    ),
    "llama": {},
    "llama4_text": dict(
        no_rope_layers=[1, 0],  # layer 0: chunked attention with rope; layer 1: full attention without
        attention_chunk_size=8,
        intermediate_size_mlp=128,
        moe_layers=[1],
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "longcat_flash": dict(
        MLA,
        head_dim=8,  # the rotary size: qk_rope_head_dim
        # each of its num_hidden_layers / 2 layers holds two attention blocks
        n_routed_experts=4,
        num_experts_per_tok=2,
        zero_expert_num=2,
        moe_intermediate_size=32,
    ),
    "mellum": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "mimo_v2_flash": dict(
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=8,
        head_dim=24,  # query/key heads wider than value heads (192 and 128 by default)
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "minicpm3": dict(MLA),
    "minicpm5_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "minimax": dict(
        layer_types=["linear_attention", "full_attention"],  # lightning (linear) attention, then softmax
        block_size=8,  # lightning attention works in blocks: 3 of them on 24 tokens
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),
    "minimax_m3_vl_text": dict(
        layer_types=["full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse"],
        rotary_dim=8,  # rotary on half of each head, as by default (64 of 128)
        # the sparse layer attends to 2 blocks of 4 keys: its own one and the best other one
        index_block_size=4,
        index_topk_blocks=2,
        index_local_blocks=1,
        index_n_heads=2,  # one per key/value head
        index_head_dim=16,
        intermediate_size=32,  # the experts'
        dense_intermediate_size=128,
        shared_intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "ministral": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "ministral3": {},
    "mistral": dict(sliding_window=8),  # every layer slides
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "modernbert-decoder": dict(local_attention=16),  # a sliding window of 16 // 2 = 8
    "moshi": dict(ffn_dim=256),  # the gated MLP is ffn_dim // 2 wide (its sliding_window is unused: full causal)
    "mpt": dict(expansion_ratio=2),  # an MLP 2 x hidden_size wide
    "nanochat": {},
    "nemotron": {},
    "nemotron_h": dict(
        # num_hidden_layers follows the block list: mamba, MoE, attention, MLP
        layer_types=["linear_attention", "moe", "full_attention", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
        use_mamba_kernels=False,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
    ),
    "olmo": {},
    "olmo2": {},
    "olmo3": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "openai-gpt": {},
    "opt": dict(ffn_dim=128),
    "param2moe": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32),
    "persimmon": {},
    "phi": {},
    "phi3": {},
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2": {},
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "qwen3": {},
    "qwen3_5_moe_text": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "qwen3_5_text": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "qwen4_exp_text": dict(
        layer_types=["linear_attention", "indexed_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        hc_lowrank=8,
        # the indexer keeps a budget of 8 keys per query, scored by blocks of 4
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "recurrent_gemma": dict(
        block_types=["recurrent", "attention"],
        attention_window_size=8,  # its attention layers slide
    ),
    "sarvam_mla": dict(
        MLA,
        q_lora_rank=None,  # as in the released model
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "sarvam_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "seed_oss": {},
    "smollm3": dict(no_rope_layer_interval=2),  # layer 1 has no rope
    "solar_open": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "stablelm": {},
    "starcoder2": {},
    "vaultgemma": dict(sliding_window=8, query_pre_attn_scalar=16),  # = head_dim, as in the real model
    "xglm": dict(ffn_dim=128),
    "youtu": dict(MLA),
    "zamba": dict(
        # mamba, then twice mamba + the shared attention block (its weights are tied across uses: one use fails)
        num_hidden_layers=3,
        layers_block_type=["linear_attention", "hybrid", "hybrid"],
        head_dim=OMIT,  # attention runs on [hidden, embeddings] (2 x hidden_size): 32 per head
        use_mamba_kernels=False,
    ),
    "zamba2": dict(
        layers_block_type=["linear_attention", "hybrid"],  # mamba, then mamba + the shared attention block
        head_dim=OMIT,  # attention runs on [hidden, embeddings] (2 x hidden_size): 32 per head
        mamba_d_state=16,
        chunk_size=16,
        use_mamba_kernels=False,
    ),
    "zaya": dict(
        layer_types=["hybrid_sliding", "hybrid"],
        sliding_window=8,
        num_experts=4,
        num_experts_per_tok=1,  # the only value it supports
        moe_intermediate_size=32,
        router_hidden_size=16,
    ),
}


def decoders() -> list[str]:
    """The sorted "decoder" model types."""
    return sorted(k for k, v in FAMILY.items() if v == "decoder")


def tiny_config(model_type: str, tokenizer, **extra):
    """The tiny config of a "decoder" model type: ``BASE`` + its ``OVERRIDES`` (+ ``extra``, e.g.
    ``alibi=True``), with the tokenizer's vocabulary size and special token ids."""
    from transformers import AutoConfig

    if FAMILY.get(model_type) != "decoder":
        raise ValueError(f"{model_type!r} is {FAMILY.get(model_type, 'unknown')!r}, not a decoder")
    kwargs = dict(
        BASE,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(OVERRIDES[model_type], **extra)
    kwargs = {k: len(tokenizer) if v is VOCAB else v for k, v in kwargs.items() if v is not OMIT}
    return AutoConfig.for_model(model_type, **kwargs)


def build_tiny_model(model_type: str, folder: Path, tokenizer_dir: Path, **extra) -> Path:
    """Save a tiny random-weight ``model_type`` (config keys ``extra`` on top of its tiny config)
    and the tokenizer into ``folder`` (kept if it already holds a config.json) and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    tokenizer = saved_tokenizer(tokenizer_dir)
    config = tiny_config(model_type, tokenizer, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    copy_tokenizer(tokenizer_dir, folder)
    return folder


def saved_tokenizer(tokenizer_dir: Path):
    """The tokenizer of ``tokenizer_dir``, loaded once per process: parsing SmolLM2's 3.5 MB
    tokenizer.json takes a quarter of a second, and every tiny model takes its tokenizer."""
    return _saved(str(Path(tokenizer_dir).resolve()))[0]


def copy_tokenizer(tokenizer_dir: Path, folder: Path) -> None:
    """Into ``folder``: the files ``save_pretrained`` writes for the tokenizer of ``tokenizer_dir``
    (saved once per process, then copied)."""
    import shutil

    for file in _saved(str(Path(tokenizer_dir).resolve()))[1].iterdir():
        shutil.copyfile(file, Path(folder) / file.name)


@functools.cache
def _saved(tokenizer_dir: str):
    """``(tokenizer, folder of its saved files)``, made once per process (removed at exit)."""
    import atexit
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    saved = Path(tempfile.mkdtemp(prefix="tiny-tokenizer-"))
    atexit.register(shutil.rmtree, saved, ignore_errors=True)
    tokenizer.save_pretrained(saved)
    return tokenizer, saved
