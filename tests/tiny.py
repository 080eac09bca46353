"""Tiny random checkpoints and a tiny byte-level BPE tokenizer, built locally (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedTokenizerFast,
)

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching schedules one model step at a time.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve r\u00e9sum\u00e9, "
    "\u00fcber, \u00e5ngstr\u00f6m.",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3068\u4e2d\u6587\u53e5\u5b50\u3002 "
    "\U0001f600\U0001f680\U0001f30d",
    "def add(a, b):\n    return a + b\n",
] * 20

ARCHS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None
    ),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False),
}


# Gemma 3n E2B / E4B's layer on AltUp's streams (three here, the active one not the first):
# Laurel beside attention, the gaussian top-k on the first two layers' MLP gates, MLP widths
# per layer (one not whole vectors), the last two layers reading the first two's caches,
# per-layer inputs from a table shorter than the vocabulary (later tokens read its row 0);
# soft-capped logits
GEMMA3N_TEXT = dict(
    head_dim=16, num_hidden_layers=4, intermediate_size=[128, 100, 128, 100], sliding_window=6,
    num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2,
    activation_sparsity_pattern=[0.95, 0.6, 0.0, 0.0], altup_num_inputs=3, altup_active_idx=1,
    laurel_rank=8, hidden_size_per_layer_input=8, vocab_size_per_layer_input=300,
    final_logit_softcapping=30.0, tie_word_embeddings=True,
    rope_parameters=dict(
        sliding_attention=dict(rope_type="default", rope_theta=100.0),
        full_attention=dict(rope_type="default", rope_theta=10000.0),
    ),
)  # fmt: skip


# The families beyond Llama's four (model/families.py), each with the mechanisms it brings set
# small enough that the tests' prompts (up to 70 tokens) run past every window.
FAMILIES = {
    "mistral-window": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=7
    ),
    "llama-bias": dict(  # attention_bias: q/k/v and o_proj biases (InternLM3's with bias)
        architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True,
    ),
    "ministral": dict(  # Ministral-8B: sliding on the layers layer_types names
        architectures=["MinistralForCausalLM"], model_type="ministral", sliding_window=7,
        layer_types=["sliding_attention", "full_attention"], head_dim=16,
    ),
    "ministral3": dict(  # Ministral 3: yarn, queries scaled past original_max (not reached)
        architectures=["Ministral3ForCausalLM"], model_type="ministral3", head_dim=16,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=128, beta_fast=32.0,
                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                             llama_4_scaling_beta=0.1),
    ),
    "qwen2-window": dict(  # slides on layers from max_window_layers on: layer 1 of 2
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True,
        sliding_window=9, max_window_layers=1, tie_word_embeddings=True,
    ),
    "gemma": dict(
        architectures=["GemmaForCausalLM"], model_type="gemma", head_dim=16,
        hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
    ),
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16,
        query_pre_attn_scalar=24, sliding_window=6, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
    ),
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16,
        query_pre_attn_scalar=16, sliding_window=8, rope_local_base_freq=100.0,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
    ),
    "gemma3-groups": dict(  # KV groups of two layers (model/kv_groups.py): the global layers
        # 3 and 6, the sliding 0-1, 2-4 and 5 (its group's second slot empty)
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16,
        query_pre_attn_scalar=16, sliding_window=5, rope_local_base_freq=100.0,
        num_hidden_layers=7, tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2
        + ["full_attention"],
    ),
    "gemma4": dict(  # Gemma 4 E2B / E4B's layer: its full layers' wider heads and fewer KV
        # heads with a quarter of each turned ("proportional" RoPE), weightless value norms,
        # unscaled scores; the last two layers reading the first two's caches, their MLPs
        # twice as wide; per-layer inputs; a scalar per layer; soft-capped logits
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=False,
        num_hidden_layers=4, sliding_window=6, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=384,
        final_logit_softcapping=30.0, tie_word_embeddings=True,
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=100.0),
            full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                rope_theta=10000.0),
        ),
    ),
    "gemma4-moe": dict(  # Gemma 4 26B-A4B's: experts beside the MLP, the full layers' values
        # their keys' projection (attention_k_eq_v), no per-layer inputs or shared caches
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=6, layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=24, tie_word_embeddings=True,
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=100.0),
            full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                rope_theta=10000.0),
        ),
    ),
    "gemma3n": dict(architectures=["Gemma3nForCausalLM"], model_type="gemma3n_text",
                    **GEMMA3N_TEXT),
    "phi3": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=11,
        original_max_position_embeddings=512,
    ),
    "phi3-longrope": dict(  # Phi-3.5 / Phi-4-mini's RoPE, within its short factors' range
        architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=None,
        original_max_position_embeddings=128,
        rope_scaling=dict(rope_type="longrope", long_factor=[5.0] * 8,
                          short_factor=[1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]),
    ),
    "phi4-mini": dict(  # longrope on three quarters of each head, as Phi-4-mini
        architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=None,
        original_max_position_embeddings=128, partial_rotary_factor=0.75,
        rope_scaling=dict(rope_type="longrope", long_factor=[5.0] * 6,
                          short_factor=[1.0, 1.5, 2.0, 2.5, 3.0, 3.5]),
    ),
    "phi3-partial": dict(  # rotary on half of each head (the fused q and k rows reordered)
        architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=None,
        original_max_position_embeddings=512, partial_rotary_factor=0.5,
    ),
    "glm": dict(  # interleaved rotary pairs on half of each head; q/k/v bias; fused gate_up
        architectures=["GlmForCausalLM"], model_type="glm", head_dim=16, attention_bias=True,
    ),
    "glm4": dict(  # as GLM, with four norms
        architectures=["Glm4ForCausalLM"], model_type="glm4", head_dim=16, attention_bias=True,
    ),
    "seed_oss": dict(  # q/k/v and o_proj biases
        architectures=["SeedOssForCausalLM"], model_type="seed_oss", head_dim=16,
        attention_bias=True, attention_out_bias=True,
    ),
    "ernie4_5": dict(  # interleaved rotary pairs over the whole head
        architectures=["Ernie4_5ForCausalLM"], model_type="ernie4_5", head_dim=16,
    ),
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2"),
    "olmo3": dict(  # OLMo 2's layer; a sliding layer, then a full one with a yarn-scaled RoPE
        architectures=["Olmo3ForCausalLM"], model_type="olmo3", sliding_window=7,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="yarn", rope_theta=50000.0, factor=4.0,
                                original_max_position_embeddings=128),
        ),
    ),
    "exaone4": dict(  # output norms, per-head q/k norms, a sliding layer with RoPE then a
        # global one without
        architectures=["Exaone4ForCausalLM"], model_type="exaone4", head_dim=16,
        sliding_window=7, layer_types=["sliding_attention", "full_attention"],
    ),
    "granite": dict(
        architectures=["GraniteForCausalLM"], model_type="granite", attention_multiplier=0.2,
        embedding_multiplier=6.0, residual_multiplier=0.4, logits_scaling=3.0,
    ),
    "smollm3": dict(
        architectures=["SmolLM3ForCausalLM"], model_type="smollm3", no_rope_layers=[1, 0],
        use_sliding_window=False,
    ),
    # Mixtures of experts (model/moe.py): few small experts, so that a step's rows route to
    # overlapping and disjoint ones; a dense layer next to a mixture where the family has them.
    "mixtral": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
        num_experts_per_tok=2, sliding_window=None,
    ),
    "qwen2_moe": dict(  # layer 1 dense (mlp_only_layers); top-2 unnormalised; shared expert
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, mlp_only_layers=[1], use_sliding_window=False,
    ),
    "qwen3_moe": dict(  # layer 0 dense (decoder_sparse_step 2); top-3 renormalised
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=2, use_sliding_window=False,
    ),
    "granitemoe": dict(  # Granite's multipliers; stacked experts, top-2 of 4 by float32 logits
        architectures=["GraniteMoeForCausalLM"], model_type="granitemoe", num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, attention_multiplier=0.2,
        embedding_multiplier=6.0, residual_multiplier=0.4, logits_scaling=3.0,
    ),
    "glm4_moe": dict(  # GLM-4.5: half of each head turned (rotate-half), q/k/v biases, q/k
        # norms; layer 0 dense, then 8 experts (top-2 of the 2 best of 4 groups, sigmoid scores
        # plus a bias) and a shared expert
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", head_dim=16,
        attention_bias=True, use_qk_norm=True, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
        n_shared_experts=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
    ),
    "deepseek_v2": dict(  # DeepSeek-V2-Lite's shape: multi-head latent attention with a
        # plain q_proj, RoPE on adjacent pairs (complex numbers), yarn with mscale_all_dim (the
        # scores' scale); layer 0 dense, then 8 experts (softmax top-2, scaled) and 2 shared
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=2, routed_scaling_factor=1.5,
        topk_method="greedy",
        rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=128,
            beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
        ),
    ),
    "deepseek_v2-groups": dict(  # DeepSeek-V2's group-limited router: the top-2 among the
        # experts of the 2 groups (of 4) whose best expert scores highest; a q_lora_rank
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=24,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        first_k_dense_replace=0, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.0,
        topk_method="group_limited_greedy",
    ),
    "deepseek_v3": dict(  # DeepSeek-V3's shape: q_lora_rank (q_a_proj, its norm,
        # q_b_proj), interleaved RoPE; layer 0 dense, then GLM-4.5's grouped sigmoid router
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=24,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5,
        rope_interleave=True,
    ),
    "glm4_moe_lite": dict(  # GLM-4.7-Flash: DeepSeek-V3's layers, rotate-half RoPE (no
        # interleave), mlp_layer_types
        architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=1.8,
        rope_interleave=False, mlp_layer_types=["sparse", "dense"],
    ),
    "ernie4_5_moe": dict(  # ERNIE 4.5 MoE: interleaved rotary pairs; layers 1 of 2 a mixture
        # of 6 experts (top-2 by softmax plus a bias) beside a shared expert, layer 0 dense
        architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe", moe_num_experts=6,
        moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1,
        tie_word_embeddings=True,
    ),
    "arcee": dict(  # AFM-4.5B: Llama's layer with an ungated relu(x)^2 MLP, yarn RoPE
        architectures=["ArceeForCausalLM"], model_type="arcee", rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=128),
    ),
    "granitemoehybrid": dict(  # Granite 4.0 without Mamba2 layers: Granite's multipliers, its
        # MLP the shared_mlp (input_linear gate then up)
        architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid",
        layer_types=["attention", "attention"], num_local_experts=0,
        shared_intermediate_size=48, position_embedding_type="rope", attention_multiplier=0.2,
        embedding_multiplier=6.0, residual_multiplier=0.4, logits_scaling=3.0,
    ),
    "olmoe": dict(  # OLMo's q/k norms over all heads; every layer 6 experts, top-2
        architectures=["OlmoeForCausalLM"], model_type="olmoe", num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=False,
    ),
    "gpt_oss": dict(  # sinks, biases, a sliding layer then a full one, yarn RoPE; a SwiGLU
        # limit low enough that the clamps bite
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.5,
        rope_parameters=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=64,
                             rope_theta=10000.0),
    ),
    # Multimodal checkpoints served text-only: the language model inside (text_config) is
    # one of the families; a tiny vision tower and projector beside it are not read.
    "gemma3-vlm": dict(
        model_type="gemma3", mm_tokens_per_image=4,
        text_config=dict(
            model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
            rope_local_base_freq=100.0, layer_types=["sliding_attention", "full_attention"],
        ),
        vision_config=dict(model_type="siglip_vision_model", image_size=28, patch_size=14),
    ),
    "gemma4-vlm": dict(  # Gemma 4's releases: its language model's every part read under
        # the multimodal checkpoint's names (shared caches, per-layer inputs, experts)
        model_type="gemma4", audio_config=None,
        text_config=dict(
            model_type="gemma4_text", head_dim=16, global_head_dim=32,
            num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=4,
            sliding_window=6, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=384,
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24,
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
                full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                    rope_theta=10000.0),
            ),
        ),
        vision_config=dict(model_type="gemma4_vision", patch_size=14, head_dim=16),
    ),
    # gemma-3n-E2B / -E4B as released: no vision config given (transformers' default: its
    # tower is timm's, never built here, see Gemma3nRelease)
    "gemma3n-vlm": dict(
        model_type="gemma3n", text_config=dict(model_type="gemma3n_text", **GEMMA3N_TEXT)
    ),
    "mistral3-vlm": dict(
        model_type="mistral3", tie_word_embeddings=False,
        text_config=dict(model_type="mistral", sliding_window=None, tie_word_embeddings=False),
        vision_config=dict(model_type="pixtral", image_size=28, patch_size=14, head_dim=16),
    ),
    "llava": dict(
        model_type="llava",
        text_config=dict(model_type="llama"),
        vision_config=dict(
            model_type="clip_vision_model", image_size=28, patch_size=14, projection_dim=32
        ),
    ),
    "qwen2_5-vl": dict(  # q/k/v bias; multimodal RoPE sections (one position on text)
        model_type="qwen2_5_vl",
        text_config=dict(
            model_type="qwen2_5_vl_text", use_sliding_window=False,
            rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3]),
        ),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            fullatt_block_indexes=[0],
        ),
    ),
    "qwen2-vl": dict(
        model_type="qwen2_vl",
        text_config=dict(
            model_type="qwen2_vl_text", use_sliding_window=False,
            rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3]),
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
    ),
    "qwen3-vl": dict(  # q/k norms; interleaved multimodal RoPE
        model_type="qwen3_vl",
        text_config=dict(
            model_type="qwen3_vl_text", head_dim=16,
            rope_scaling=dict(rope_type="default", mrope_section=[2, 3, 3], mrope_interleaved=True),
        ),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            deepstack_visual_indexes=[0],
        ),
    ),
    "qwen3-vl-moe": dict(  # Qwen3-VL-30B-A3B's language model: stacked experts, top-2 of 4
        model_type="qwen3_vl_moe",
        text_config=dict(
            model_type="qwen3_vl_moe_text", head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, decoder_sparse_step=1,
            rope_scaling=dict(rope_type="default", mrope_section=[2, 3, 3], mrope_interleaved=True),
        ),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            deepstack_visual_indexes=[0],
        ),
    ),
}  # fmt: skip
# Hybrids (model/recurrent.py): gated delta nets beside attention; no prefix caching and no
# speculation, so not in the FAMILIES battery (tests/equivalence/test_hybrid.py). Qwen3.5's
# layers 0-2 delta nets (2 key heads each serving 2 value heads), layer 3 attention with a
# quarter of its head turned by RoPE, q/k norms and an output gate.
_QWEN3_5_TEXT = dict(
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8,
)  # fmt: skip
HYBRIDS = {
    "qwen3_5": dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", **_QWEN3_5_TEXT
    ),
    "qwen3_5_moe": dict(  # a mixture of 4 experts (top-2) and a shared one on every layer
        architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        **_QWEN3_5_TEXT,
    ),
    "lfm2": dict(  # LFM2: short convolutions on layers 0, 1 and 3, attention on layer 2
        architectures=["Lfm2ForCausalLM"], model_type="lfm2", layer_types=["conv", "conv",
        "full_attention", "conv"], intermediate_size=192, block_multiple_of=32, norm_eps=1e-5,
    ),
    "lfm2_moe": dict(  # LFM2-MoE: layer 0's MLP dense, then 4 experts (top-2) by sigmoid scores
        architectures=["Lfm2MoeForCausalLM"], model_type="lfm2_moe", layer_types=["conv", "conv",
        "full_attention", "conv"], num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, use_expert_bias=True, routed_scaling_factor=1.5, norm_eps=1e-5,
    ),
    "qwen3_next": dict(  # Qwen3.5-MoE's layers, its delta nets' projections interleaved per key
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=2, **_QWEN3_5_TEXT,
    ),
    "granite4-h": dict(  # Granite 4.0-H-Tiny's shape: Mamba2 layers 0, 1 and 3 (8 heads of 16
        # in 2 groups, a state of 16), attention on layer 2 without RoPE, Granite's multipliers;
        # every MLP 4 experts (top-2) and the ungated shared_mlp
        architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid",
        layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=48, position_embedding_type="nope",
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2,
        attention_multiplier=0.2, embedding_multiplier=6.0, residual_multiplier=0.4,
        logits_scaling=3.0,
    ),
    "bamba": dict(  # Bamba: Mamba2 layers 0, 1 and 3 (8 heads of 16 in 2 groups), attention on
        # layer 2 turning half of each head; Llama's MLP
        architectures=["BambaForCausalLM"], model_type="bamba", attn_layer_indices=[2],
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2,
    ),
    "nemotron_h": dict(  # Nemotron-H's blocks "M-*MM-": a Mamba2 block and its MLP, attention
        # (no RoPE) and two Mamba2 blocks without one, a last one with its MLP; relu(x)^2 MLPs
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h",
        layer_types=["linear_attention", "mlp", "full_attention", "linear_attention",
                     "linear_attention", "mlp"],
        head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
        conv_kernel=4, layer_norm_epsilon=1e-5, time_step_min=0.001,
    ),
    "nemotron_h-moe": dict(  # Nemotron 3 Nano's blocks "M*EME": mixtures of 8 ungated experts
        # (top-2 of the 2 best of 4 groups, by sigmoid scores plus a bias) and a shared expert
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h",
        layer_types=["linear_attention", "full_attention", "moe", "linear_attention", "moe",
                     "linear_attention"],
        head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
        conv_kernel=4, layer_norm_epsilon=1e-5, time_step_min=0.001, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
    "qwen3_5-vlm": dict(  # Qwen3.5's releases: the language model inside a VLM
        model_type="qwen3_5",
        text_config=dict(model_type="qwen3_5_text", **_QWEN3_5_TEXT),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64),
    ),
}  # fmt: skip
# A tiny vision tower's sizes (the multimodal FAMILIES').
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def tiny_config(arch: str, vocab_size: int, **overrides):
    kwargs = dict(
        ARCHS[arch] if arch in ARCHS else FAMILIES[arch] if arch in FAMILIES else HYBRIDS[arch],
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":  # explicit head_dim != hidden / heads, and llama3 rope scaling
        kwargs.update(
            head_dim=32,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        )
    if arch == "qwen3":
        kwargs.update(head_dim=16, tie_word_embeddings=True)
    if arch == "qwen2":
        kwargs.update(tie_word_embeddings=True)
    if "kv_lora_rank" in kwargs:  # latent attention: every head reads the one latent
        kwargs.update(num_key_value_heads=kwargs["num_attention_heads"])
    for key in ("num_hidden_layers", "intermediate_size"):  # a family's own count, widths
        if key in FAMILIES.get(arch, {}):
            kwargs[key] = FAMILIES[arch][key]
    if arch in HYBRIDS:  # three delta nets, then attention
        kwargs.update(num_hidden_layers=len(kwargs.get("layer_types") or range(4)))
    kwargs.update(overrides)
    model_type = kwargs.pop("model_type")
    if "text_config" in kwargs:  # a multimodal checkpoint: the sizes are its language model's
        outer = {
            k: kwargs.pop(k)
            for k in ("text_config", "vision_config", "mm_tokens_per_image")
            if k in kwargs
        }
        outer["text_config"] = {**kwargs, **outer["text_config"]}
        if "vision_config" in outer:
            outer["vision_config"] = {**TINY_VISION, **outer["vision_config"]}
        for key in ("tie_word_embeddings", "eos_token_id", "pad_token_id"):
            outer[key] = outer["text_config"][key]
        return AutoConfig.for_model(model_type, **outer)
    return AutoConfig.for_model(model_type, **kwargs)


class Gemma3nRelease:
    """Gemma3nForConditionalGeneration (gemma-3n-E2B, -E4B as released) as a tiny checkpoint:
    its vision tower is timm's, not installed here, so transformers cannot build the whole
    model. Its language model (Gemma3nForCausalLM, its lm_head tied to the embedding as the
    release's) is saved under the release's names beside stand-ins for the towers' and their
    embedders' tensors, and transformers' Gemma3nForCausalLM reads it back from them (its
    model.language_model. as model.): the reference."""

    @staticmethod
    def from_config(config, dtype):
        return AutoModelForCausalLM.from_config(_tied_text(config), dtype=dtype)

    @staticmethod
    def from_pretrained(path, **kwargs):
        config = _tied_text(AutoConfig.from_pretrained(path))
        return AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)

    @staticmethod
    def save(model, config, path: Path) -> None:
        from safetensors.torch import save_file

        state = {
            name.replace("model.", "model.language_model.", 1): tensor.contiguous()
            for name, tensor in model.state_dict().items()
            if name != "lm_head.weight"
        }
        for tower in ("vision_tower.timm_model", "audio_tower", "embed_vision", "embed_audio"):
            state[f"model.{tower}.stand_in.weight"] = torch.ones(4, 4, dtype=torch.float64)
        path.mkdir(parents=True, exist_ok=True)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        config.architectures = ["Gemma3nForConditionalGeneration"]
        config.save_pretrained(path)


def _tied_text(config):
    text = config.text_config
    text.tie_word_embeddings = True
    return text


def auto_class(config):
    """transformers' class for a tiny config: a causal LM, or an image-text-to-text model for
    a multimodal one (Gemma 3's is both); Gemma 3n's release: Gemma3nRelease."""
    if getattr(config, "model_type", None) == "gemma3n":
        return Gemma3nRelease
    if hasattr(config, "text_config"):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def make_tiny_checkpoint(
    path: Path, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """Saves a float64 random checkpoint with tokenizer to `path` and returns it."""
    tokenizer = build_tokenizer()
    vocab_size = overrides.pop("vocab_size", len(tokenizer))  # more: a padded vocabulary
    config = tiny_config(arch, vocab_size, **overrides)
    torch.manual_seed(seed)
    kind = auto_class(config)
    model = kind.from_config(config, dtype=torch.float64)
    if arch in FAMILIES or arch in HYBRIDS:  # norms away from 1 (Gemma's 0): each one counts
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith("correct_output_scale"):  # Gemma 3n's: 0
                    param.add_(0.2 * torch.randn_like(param))
                mamba = ".mamba." in name or ".mixer." in name  # Granite's, Nemotron-H's
                if mamba and name.rpartition(".")[2] in ("A_log", "D", "dt_bias"):
                    param.add_(0.3 * torch.randn_like(param))  # per head: each head's own
            for name, buffer in model.named_buffers():  # LFM2-MoE's: it chooses the experts
                if name.endswith(("expert_bias", "e_score_correction_bias")):  # buffers, or
                    buffer.copy_(0.1 * torch.randn_like(buffer))
            for name, param in model.named_parameters():  # ERNIE 4.5's, a frozen parameter
                if name.endswith("e_score_correction_bias"):
                    param.copy_(0.1 * torch.randn_like(param))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if kind is Gemma3nRelease:
        Gemma3nRelease.save(model, config, path)
    else:
        model.save_pretrained(path, **kwargs)
    tokenizer.save_pretrained(path)
    return path


def make_scripted_checkpoint(
    path: Path,
    successor: dict[int, int],
    specials: tuple[str, ...] = (),
    words: tuple[str, ...] = (),
    **overrides,
) -> Path:
    """A model whose greedy next token after token x is successor[x], whatever the context.

    One-hot embeddings (hidden size = vocab size), a layer whose attention and MLP output
    zero, and an LM head that maps x to successor[x]: the logit of successor[x] is
    sqrt(vocab) and every other logit is 0. Lets engine tests script exact token sequences.
    specials: more special tokens (ids from 384 on), as a family's markers are; words: more
    ordinary tokens after those (a word as one token); overrides: more config settings
    (max_position_embeddings, say).
    """
    tokenizer = scripted_tokenizer(specials, words)
    vocab = len(tokenizer)
    config = tiny_config(
        "llama",
        vocab,
        hidden_size=vocab,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=vocab // 4,
        intermediate_size=32,
        rope_scaling=None,
        **overrides,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.zero_() if "norm" not in name else param.fill_(1.0)
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, dtype=torch.float64))
        for token, nxt in successor.items():
            model.lm_head.weight[nxt, token] = 1.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def scripted_tokenizer(specials: tuple[str, ...] = (), words: tuple[str, ...] = ()):
    """The tiny tokenizer with more special tokens, then more ordinary ones."""
    tokenizer = build_tokenizer()
    if specials:
        tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    if words:
        tokenizer.add_tokens(list(words))
    return tokenizer


# Marker tokens that reasoning / tool-call formats make special (Mistral's [THINK], harmony's
# channels); 8 more tokens keep a scripted model's heads even (392 = 4 heads x 98).
MARKER_SPECIALS = ("[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|channel|>")
MARKER_SPECIALS += ("<|message|>", "<|end|>")


def thinking_script() -> dict[int, int]:
    """For make_scripted_checkpoint(path, thinking_script(), MARKER_SPECIALS): after a newline
    the model writes [THINK] o k [/THINK] P a r i s <|im_end|>, each token once (so each has one
    next), the markers as special tokens."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKER_SPECIALS)})
    think, end_think = tokenizer.convert_tokens_to_ids(list(MARKER_SPECIALS[:2]))

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    (newline,) = ids("\n")
    order = [newline, think, *ids("o"), *ids("k"), end_think]
    order += [*(i for c in "Paris" for i in ids(c)), tokenizer.eos_token_id]
    assert len(set(order)) == len(order)
    return dict(zip(order[:-1], order[1:], strict=True))


def endless_thinking_script() -> dict[int, int]:
    """As thinking_script, but the model thinks o k o k ... and never writes [/THINK] itself;
    given [/THINK] (a thinking budget forces it), it answers P a r i s <|im_end|>."""
    script = thinking_script()
    tokenizer = build_tokenizer()
    (o,) = tokenizer.encode("o", add_special_tokens=False)
    (k,) = tokenizer.encode("k", add_special_tokens=False)
    return script | {k: o}


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """The byte-level token of each UTF-8 byte of `text` (multi-byte characters split)."""
    table = _gpt2_byte_chars()
    return [tokenizer.convert_tokens_to_ids(table[b]) for b in text.encode("utf-8")]


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def slow_schema(tag: str = "field", num_fields: int = 3000) -> dict:
    """A JSON schema that takes ~0.5 s to compile here (4000 such properties are over
    llguidance's grammar size limit); `tag` names its properties, so that schemas with other
    tags miss the grammar cache."""
    field = {
        "anyOf": [
            {"type": "string", "pattern": "[a-z]{3,9}[0-9]+"},
            {"type": "integer", "minimum": -5, "maximum": 123456},
            {"type": "array", "items": {"type": "number"}},
        ]
    }
    props = {f"{tag}_{i}": field for i in range(num_fields)}
    return {"type": "object", "properties": props, "required": list(props)}


# GPT-OSS's harmony: its markers special tokens, as in its tokenizer, and its channel and role
# names one token each, so that a scripted model writes each once (400 = 4 heads x 100).
HARMONY_SPECIALS = MARKER_SPECIALS + ("<|start|>", "<|return|>", "<|call|>", "<|constrain|>")
HARMONY_WORDS = ("analysis", "final", "assistant", "commentary")


def harmony_thinking_script() -> dict[int, int]:
    """For make_scripted_checkpoint(path, harmony_thinking_script(), HARMONY_SPECIALS,
    HARMONY_WORDS): after a newline the model opens harmony's analysis channel and thinks
    o k o k ... without end (<|channel|>analysis<|message|>okok...); after the header of any
    other channel (<|message|>) it writes o k o k ... there too."""
    tokenizer = scripted_tokenizer(HARMONY_SPECIALS, HARMONY_WORDS)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    (newline,) = ids("\n")
    order = [newline, *ids("<|channel|>analysis<|message|>"), *ids("o"), *ids("k")]
    assert len(order) == len(set(order)) == 6
    return dict(zip(order[:-1], order[1:], strict=True)) | {order[-1]: order[-2]}


def reply_pieces(
    raw: str, markers: tuple[str, ...] = (), specials: tuple[str, ...] = (), size: int = 4
) -> list[str]:
    """raw cut into pieces, each different from the others and from "\\n", so that a scripted
    model writes them in a row, one token each: a marker (of markers or specials) is a piece
    the first time it comes, the text between markers is cut every `size` characters, and a
    piece that came before is lengthened (by a character, or a whole marker) until it is new,
    or, at raw's end or a special marker's first, joined to the piece before."""
    atoms: list[str] = []  # raw's markers and its other characters, in order
    at = 0
    while at < len(raw):
        found = [marker for marker in markers + specials if raw.startswith(marker, at)]
        atoms.append(max(found, key=len) if found else raw[at])
        at += len(atoms[-1])
    pieces: list[str] = []
    used = {"\n"}  # the newline starts the script

    def fresh(atom: str) -> bool:  # a special marker still to be its own token
        return atom in specials and atom not in used

    start = 0
    while start < len(atoms):
        end = start + 1
        while end - start < size and end < len(atoms) and len(atoms[start]) == len(atoms[end]) == 1:
            end += 1
        while "".join(atoms[start:end]) in used and end < len(atoms) and not fresh(atoms[end]):
            end += 1
        piece = "".join(atoms[start:end])
        if piece in used:
            piece = pieces.pop() + piece
        assert piece not in used, piece
        used.add(piece)
        pieces.append(piece)
        start = end
    return pieces


def make_reply_checkpoint(
    path: Path, raw: str, markers: tuple[str, ...] = (), specials: tuple[str, ...] = ()
) -> Path:
    """A scripted checkpoint that, after a newline, writes exactly `raw`, then <|im_end|>, in
    the pieces reply_pieces cuts it in: one token each, special ones for the family's markers
    that its tokenizer makes special (specials: each one such a token the first time it
    comes), ordinary ones (words) for the rest, and unused words so that the vocabulary is a
    multiple of 8 (4 heads of an even size)."""
    pieces = reply_pieces(raw, markers, specials)
    assert all(special in pieces for special in specials if special in raw)
    words = tuple(piece for piece in pieces if piece not in specials)
    size = len(scripted_tokenizer(specials, words))
    words += tuple(f"<unused{i}>" for i in range(-size % 8))
    tokenizer = scripted_tokenizer(specials, words)
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    order = [newline, *tokenizer.convert_tokens_to_ids(pieces), tokenizer.eos_token_id]
    assert len(set(order)) == len(order) and len(tokenizer) % 8 == 0
    assert tokenizer.decode(order[1:-1]) == raw
    successor = dict(zip(order[:-1], order[1:], strict=True))
    return make_scripted_checkpoint(path, successor, specials, words, max_position_embeddings=2048)


# BERT-family encoders (conveyor/model/bert.py): kind -> (architecture, config fields, pooling
# a sentence-transformers modules.json states or None). "bert" is an embedder as
# sentence-transformers saves one (mean pooling, no "bert." prefix); "bert-cross" a
# cross-encoder (ms-marco-MiniLM's shape: token types, the pooler, one label); the RoBERTa ones
# number positions from padding_idx + 1, "xlm-roberta-cross" a bge-reranker's shape.
ENCODERS = {
    "bert": ("BertModel", "bert", "mean"),
    "bert-cross": ("BertForSequenceClassification", "bert", None),
    "xlm-roberta": ("XLMRobertaModel", "xlm-roberta", None),
    "xlm-roberta-cross": ("XLMRobertaForSequenceClassification", "xlm-roberta", None),
    # ModernBERT (model/modernbert.py) with BERT's tokenizer: local layers seeing 4 tokens on
    # either side, so that the tests' texts pass their window; biases on in the embedder, the
    # cross-encoder pooling the mean
    "modernbert": ("ModernBertModel", "modernbert", "mean"),
    "modernbert-cross": ("ModernBertForSequenceClassification", "modernbert", None),
}


def make_tiny_encoder(path: Path, kind: str = "bert", seed: int = 0, **overrides) -> Path:
    """A float64 random BERT-family checkpoint with its tokenizer (BERT's WordPiece with [CLS]
    and [SEP], or RoBERTa's byte-level BPE with <s> and </s>) saved to `path`."""
    import json

    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer
    from transformers import (
        AutoModel,
        AutoModelForSequenceClassification,
        BertTokenizer,
        RobertaTokenizer,
    )

    architecture, model_type, pooling = ENCODERS[kind]
    path.mkdir(parents=True, exist_ok=True)
    if model_type in ("bert", "modernbert"):
        words = BertWordPieceTokenizer(lowercase=True)
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        words.train_from_iterator(CORPUS, vocab_size=300, special_tokens=specials)
        tokenizer = BertTokenizer(vocab=words.get_vocab())
        fields = dict(type_vocab_size=2, pad_token_id=0, offset=0)
    else:
        pieces = ByteLevelBPETokenizer()
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        pieces.train_from_iterator(CORPUS, vocab_size=400, special_tokens=specials)
        pieces.save_model(str(path))  # merges.txt: the merges in their order
        lines = (path / "merges.txt").read_text().splitlines()[1:]
        merges = [tuple(line.split()) for line in lines if line]
        tokenizer = RobertaTokenizer(vocab=pieces.get_vocab(), merges=merges)
        # RoBERTa numbers positions from padding_idx + 1: 128 positions take 130 rows
        fields = dict(type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, offset=2)
    fields.update(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128 + fields.pop("offset"),
        layer_norm_eps=1e-12, initializer_range=0.2, architectures=[architecture],
    )  # fmt: skip
    if model_type == "modernbert":
        modern = dict(
            local_attention=8, global_attn_every_n_layers=2, num_hidden_layers=3,
            norm_eps=1e-5, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3,
            global_rope_theta=1000.0, local_rope_theta=100.0, intermediate_size=96,
        )  # fmt: skip
        if architecture == "ModernBertModel":
            modern.update(attention_bias=True, mlp_bias=True, norm_bias=True)
        else:
            modern.update(classifier_pooling="mean", classifier_bias=True)
        fields = {k: v for k, v in fields.items() if k not in ("type_vocab_size",)} | modern
        fields.pop("layer_norm_eps", None)
    if architecture.endswith("ForSequenceClassification"):
        fields["num_labels"] = 1
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if "num_labels" in fields else AutoModel
    model = auto.from_config(config, dtype=torch.float64)
    with torch.no_grad():  # norms away from their initial (1, 0): each one counts
        for name, param in model.named_parameters():
            if "norm" in name.lower():
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if pooling is not None:  # as sentence-transformers saves a model
        kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
        modules = [
            {"idx": i, "name": str(i), "path": where, "type": f"sentence_transformers.models.{k}"}
            for i, (where, k) in enumerate(kinds)
        ]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir(exist_ok=True)
        modes = {
            "word_embedding_dimension": fields["hidden_size"],
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False,
        }
        (path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    return path
