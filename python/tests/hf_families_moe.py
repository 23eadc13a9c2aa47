"""The MoE families of `shardwise to-hf` with their own attention or expert layout: deepseek_v3 (MLA,
first dense layers, shared experts, sigmoid router with expert bias), glm4_moe (partial rope, qkv
bias, q/k norm, the same MoE as deepseek_v3) and gpt_oss (attention sinks, alternating sliding window,
biased experts written fused 3-D by transformers).

Each family is a small transformers config (transformers' own config class) and the megatron-core
0.19.2 GPTModel that config describes, built on CPU with the local (no Transformer Engine) spec. The
layout is the one Megatron-Bridge builds for these models (deepseek/common.py, glm45_bridge.py,
gpt_oss_bridge.py); every mapping fact is proven by the logits of the converted model.
"""

from __future__ import annotations

import functools

import torch

# ``hf_families`` registers FAMILY_ARGS into its registry when it is imported, so this module imports
# nothing of it at import time.


def hf_config(family: str):
    """The small HF config of ``family``; 3 layers, the first dense where the family has dense layers."""
    import transformers

    from hf_families import HF_VOCAB

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    common = dict(vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "deepseek_v3":
        # rms_norm_eps 1e-6, DeepSeek-V3's own: transformers' q_a_layernorm and kv_a_layernorm always
        # use 1e-6 whatever the config says, Megatron one layernorm_epsilon for every norm.
        # Grouped routing: 8 experts in 4 groups, 2 groups kept, top-4 (2 per group: Megatron sums the
        # top topk/group_topk scores of a group, transformers the top 2).
        return transformers.DeepseekV3Config(
            **{**common, "rms_norm_eps": 1e-6}, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=24,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True,
            rope_parameters=rope, num_mtp_layers=0, attention_bias=False)
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=1.5, norm_topk_prob=True, first_k_dense_replace=1, use_qk_norm=True,
            attention_bias=True, rope_parameters={**rope, "partial_rotary_factor": 0.5}, num_mtp_layers=0)
    if family == "gpt_oss":
        # Layer 0 slides (window 4 < the 12 tokens), layer 1 attends fully, layer 2 slides.
        return transformers.GptOssConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=4, swiglu_limit=7.0, attention_bias=True,
            rope_parameters=rope, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    raise ValueError(family)


def transformer_config_kwargs(family: str, cfg) -> dict:
    """The megatron-core TransformerConfig fields of ``family`` (sizes from the HF config)."""
    import torch.nn.functional as F

    kw = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
        num_moe_experts=getattr(cfg, "n_routed_experts", None) or cfg.num_local_experts,
        moe_router_topk=cfg.num_experts_per_tok, moe_ffn_hidden_size=getattr(cfg, "moe_intermediate_size", None)
        or cfg.intermediate_size, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
    )
    if family in ("deepseek_v3", "glm4_moe"):
        kw.update(
            ffn_hidden_size=cfg.intermediate_size, activation_func=F.silu, add_bias_linear=False,
            moe_layer_freq=[0] * cfg.first_k_dense_replace + [1] * (cfg.num_hidden_layers - cfg.first_k_dense_replace),
            moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=cfg.routed_scaling_factor, moe_router_num_groups=cfg.n_group,
            moe_router_group_topk=cfg.topk_group, moe_router_dtype="fp32",
        )
    if family == "deepseek_v3":
        kw.update(
            multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_nope_head_dim, qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
            kv_channels=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, num_query_groups=cfg.num_attention_heads,
            rope_type="rope", rotary_scaling_factor=1.0, qk_layernorm=True,
        )
    if family == "glm4_moe":
        kw.update(num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, add_qkv_bias=True,
                  qk_layernorm=True)
    if family == "gpt_oss":
        from megatron.core.activations import quick_gelu

        kw.update(
            num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
            add_bias_linear=True, add_qkv_bias=True, activation_func=quick_gelu, glu_linear_offset=1.0,
            activation_func_clamp_value=cfg.swiglu_limit, bias_activation_fusion=False, softmax_type="learnable",
            window_size=(cfg.sliding_window - 1, 0), window_attn_skip_freq=2, moe_router_score_function="softmax",
            moe_router_pre_softmax=False, moe_router_dtype="fp32",
        )
    return kw


def cpu_patches() -> None:
    """What megatron-core 0.19.2 needs to run these models forward on CPU without Transformer Engine.

    - Sliding-window attention builds its mask with ``device="cuda"`` (``transformer.utils``); the
      local softmax imports that function by name, so a CPU copy replaces it there.
    (MLA's core attention: see ``_mla_core_attention``.)
    """
    from megatron.core.fusions import fused_softmax

    def sliding_window_causal_mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = sliding_window_causal_mask


def _mla_core_attention():
    """megatron-core 0.19.2's local MLA spec passes ``k_channels``/``v_channels`` to
    DotProductAttention, which takes neither (only TEDotProductAttention does): this subclass takes
    them and sizes its output by ``v_channels`` (MLA's v_head_dim differs from its q/k head size)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # Attention.__init__ builds one without, MLA rebuilds it with
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def build(family: str, cfg):
    """The megatron-core GPTModel of ``family`` shaped like ``cfg``, on CPU in the current parallel
    state, in eval mode, with non-trivial norm weights, biases, attention sinks and expert biases (a
    swapped or dropped tensor changes the logits); and the Megatron-LM args a training run stores."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from hf_families import VOCAB_MEGATRON

    kw = transformer_config_kwargs(family, cfg)
    config_cls = MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig
    tc = config_cls(
        **kw, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(), expert_tensor_parallel_size=1,
        sequence_parallel=False,
    )
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    if tc.multi_latent_attention:
        core = _mla_core_attention()
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = core
    rotary_percent = cfg.rope_parameters.get("partial_rotary_factor", 1.0)
    torch.manual_seed(1234)
    model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=VOCAB_MEGATRON, max_sequence_length=64,
                     position_embedding_type="rope", rotary_base=int(cfg.rope_parameters["rope_theta"]),
                     rotary_percent=rotary_percent, share_embeddings_and_output_weights=False, parallel_output=False)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("softmax_offset") or name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    # The Megatron-LM arguments a training run stores (names of megatron/training/arguments.py;
    # most are TransformerConfig fields of the same name).
    same = ["num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
            "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "moe_shared_expert_intermediate_size",
            "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
            "moe_router_num_groups", "moe_router_group_topk", "multi_latent_attention", "q_lora_rank",
            "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm", "add_bias_linear",
            "add_qkv_bias", "softmax_type", "window_size", "window_attn_skip_freq", "glu_linear_offset",
            "activation_func_clamp_value"]
    args = {k: getattr(tc, k) for k in same if hasattr(tc, k)}
    args.update(group_query_attention=tc.num_query_groups != tc.num_attention_heads, swiglu=True,
                num_experts=tc.num_moe_experts, padded_vocab_size=VOCAB_MEGATRON,
                untie_embeddings_and_output_weights=True, rotary_percent=rotary_percent,
                rotary_base=int(cfg.rope_parameters["rope_theta"]),
                tensor_model_parallel_size=tc.tensor_model_parallel_size, norm_epsilon=tc.layernorm_epsilon)
    return model.eval(), args


# name -> the fields of its ``hf_families.Family`` (all MoE: the resharded layout is TP=2 x EP=2).
FAMILY_ARGS = {
    name: dict(hf_config=functools.partial(hf_config, name), build=functools.partial(build, name), moe=True,
               cpu_patches=(cpu_patches,))
    for name in ("deepseek_v3", "glm4_moe", "gpt_oss")
}
