"""The MoE families of `shardwise to-hf` with their own attention or expert layout: deepseek_v3 (MLA,
first dense layers, shared experts, sigmoid router with expert bias), glm4_moe (partial rope, qkv
bias, q/k norm, the same MoE as deepseek_v3), gpt_oss (attention sinks, alternating sliding window,
biased experts written fused 3-D by transformers), deepseek_v32 and glm_moe_dsa (deepseek_v3 with
DeepSeek sparse attention: MLA whose attention keeps the top-k tokens a lightning indexer scores;
glm_moe_dsa shares one layer's top-k with the next, and rotates its indexer's rope dims interleaved)
and minimax_m2 (q/k RMSNorm over all heads at once, sigmoid router with expert bias, partial rope).

Each family is a small transformers config (transformers' own config class) and the megatron-core
0.19.2 model that config describes, built on CPU with the local (no Transformer Engine) modules. The
layout is the one Megatron-Bridge builds for these models (deepseek/common.py, glm45_bridge.py,
gpt_oss_bridge.py, glm/glm5_bridge.py, minimax_m2/layer_specs.py); every mapping fact is proven by the
logits of the converted model. ``build`` makes a GPTModel; ``hf_families_hybrid`` makes the HybridModel
of the same family from the same layer specs.
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
            # q_lora_rank 32: q_b_proj's input is then a multiple of NVFP4's 16-value group (--quantize
            # nvfp4 of this MLA family, test_hf_families).
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=32,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True,
            rope_parameters=rope, num_mtp_layers=1, attention_bias=False)
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=1.5, norm_topk_prob=True, first_k_dense_replace=1, use_qk_norm=True,
            attention_bias=True, rope_parameters={**rope, "partial_rotary_factor": 0.5}, num_mtp_layers=1)
    if family == "gpt_oss":
        # Layer 0 slides (window 4 < the 12 tokens), layer 1 attends fully, layer 2 slides.
        return transformers.GptOssConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=4, swiglu_limit=7.0, attention_bias=True,
            rope_parameters=rope, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if family == "qwen3":
        return transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                        rope_parameters=rope)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, num_key_value_heads=2, intermediate_size=96, rope_parameters=rope)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                          num_local_experts=4, num_experts_per_tok=2, rope_parameters=rope)
    if family in ("deepseek_v32", "glm_moe_dsa"):
        # deepseek_v3's sizes, plus an indexer of 4 heads of 16 keeping the top 4 of the 12 tokens
        # (so the indexer decides which tokens each query attends to; 3 of them are rope dims).
        kw = dict(**{**common, "rms_norm_eps": 1e-6}, num_key_value_heads=4, intermediate_size=96,
                  moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                  n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                  q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                  rope_parameters=rope, attention_bias=False, index_topk=4, index_head_dim=16, index_n_heads=4)
        # One MTP layer, as DeepSeek-V3.2's and GLM-5's releases declare it (transformers' configs
        # have no such field; save_pretrained keeps it).
        kw.update(num_nextn_predict_layers=1)
        if family == "deepseek_v32":
            return transformers.DeepseekV32Config(**kw)
        # Layer 2 reuses layer 1's top-k (indexer_types full, full, shared: transformers' schedule
        # from index_topk_freq 2 and index_skip_topk_offset 2); the MTP layer runs its own.
        return transformers.GlmMoeDsaConfig(**kw, index_topk_freq=2, index_skip_topk_offset=2)
    if family == "minimax_m2":
        return transformers.MiniMaxM2Config(
            **{**common, "rms_norm_eps": 1e-6}, bos_token_id=None, eos_token_id=None, num_key_value_heads=2,
            head_dim=16, intermediate_size=32,
            num_local_experts=4, num_experts_per_tok=2, rope_parameters={**rope, "partial_rotary_factor": 0.5})
    raise ValueError(family)


DENSE_FAMILIES = ("qwen3", "qwen2")
MLA_FAMILIES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")


def dsa_topk_schedule(cfg, layer_numbers) -> dict:
    """Megatron's DSA top-k sharing (``dsa_indexer_topk_freq``, ``dsa_indexer_skip_topk_offset``)
    that reproduces ``cfg``'s ``indexer_types`` on the DSA layers numbered ``layer_numbers`` (1-based,
    one per HF layer: 1, 2, 3 in a GPTModel, 1, 3, 5 in a HybridModel with an MLP layer after each).
    Megatron runs the indexer on layer n iff max(n - max(offset, 1), 0) % freq == 0
    (``dsa.is_dsa_skip_topk_layer``), and a skipping layer reuses layer ``source_dsa_compute_layer``'s
    top-k, which must be the previous DSA layer (as transformers reuses the previous layer's); the
    smallest freq and offset that give the config's pattern."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        is_dsa_skip_topk_layer,
        source_dsa_compute_layer,
    )

    want = [t == "full" for t in getattr(cfg, "indexer_types", None) or ["full"] * len(layer_numbers)]
    if all(want):
        return dict(dsa_indexer_topk_freq=1, dsa_indexer_skip_topk_offset=0)
    source = [max(m for m, full in zip(layer_numbers[:i], want) if full) if not w else n
              for i, (n, w) in enumerate(zip(layer_numbers, want))]
    for freq in range(2, 4 * len(want) + 1):
        for offset in range(0, 2 * len(want) + 2):
            if [not is_dsa_skip_topk_layer(n, offset, freq) for n in layer_numbers] == want and [
                    source_dsa_compute_layer(n, offset, freq) for n in layer_numbers] == source:
                return dict(dsa_indexer_topk_freq=freq, dsa_indexer_skip_topk_offset=offset)
    raise ValueError(f"no Megatron top-k schedule gives {cfg.indexer_types} on layers {layer_numbers}")


def transformer_config_kwargs(family: str, cfg) -> dict:
    """The megatron-core TransformerConfig fields of ``family`` (sizes from the HF config)."""
    import torch.nn.functional as F

    kw = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
    )
    if family not in DENSE_FAMILIES:
        kw.update(
            num_moe_experts=getattr(cfg, "n_routed_experts", None) or cfg.num_local_experts,
            moe_router_topk=cfg.num_experts_per_tok, moe_ffn_hidden_size=getattr(cfg, "moe_intermediate_size", None)
            or cfg.intermediate_size, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        )
    if family in ("qwen3", "qwen2", "mixtral"):
        kw.update(num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.hidden_size // cfg.num_attention_heads,
                  ffn_hidden_size=cfg.intermediate_size, activation_func=F.silu, add_bias_linear=False,
                  qk_layernorm=family == "qwen3", add_qkv_bias=family == "qwen2")
    if family == "mixtral":
        kw.update(moe_router_pre_softmax=False)  # softmax over the top-k logits = transformers' renormalised top-k
    if family in ("deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa"):
        # One MTP layer (DeepSeek-V3's, GLM-4.5's, DeepSeek-V3.2's and GLM-5's releases have one): an
        # MoE layer after the last.
        kw.update(mtp_num_layers=getattr(cfg, "num_nextn_predict_layers", 0) or None)
    if family in ("deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa"):
        kw.update(
            ffn_hidden_size=cfg.intermediate_size, activation_func=F.silu, add_bias_linear=False,
            moe_layer_freq=[0] * cfg.first_k_dense_replace + [1] * (cfg.num_hidden_layers - cfg.first_k_dense_replace),
            moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=cfg.routed_scaling_factor, moe_router_num_groups=cfg.n_group,
            moe_router_group_topk=cfg.topk_group, moe_router_dtype="fp32",
        )
    if family in MLA_FAMILIES:
        kw.update(
            multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_nope_head_dim, qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
            kv_channels=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, num_query_groups=cfg.num_attention_heads,
            rope_type="rope", rotary_scaling_factor=1.0, qk_layernorm=True,
        )
    if family in DSA_FAMILIES:
        # Megatron-Bridge's GLM-5 settings (glm5_bridge.py): no Hadamard rotation of the indexer's q
        # and k (transformers skips it too: it is orthogonal, so q.k is unchanged), k_norm eps 1e-6
        # (transformers' fixed LayerNorm eps); ReLU on the indexer scores, as transformers computes.
        kw.update(
            experimental_attention_variant="dsa", dsa_indexer_n_heads=cfg.index_n_heads,
            dsa_indexer_head_dim=cfg.index_head_dim, dsa_indexer_topk=cfg.index_topk,
            dsa_indexer_rotate_activation=False, dsa_indexer_k_norm_epsilon=1e-6, dsa_indexer_loss_coeff=0.0,
            dsa_indexer_scoring_relu=True, dsa_indexer_rope_interleaved=family == "glm_moe_dsa",
            **dsa_topk_schedule(cfg, list(range(1, cfg.num_hidden_layers + 1))),
        )
    if family == "minimax_m2":
        kw.update(
            num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
            activation_func=F.silu, add_bias_linear=False, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_dtype="fp32", qk_layernorm=True,
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


class CpuNorm:
    """TENorm on CPU: torch's RMSNorm, or LayerNorm (with bias) when the config says so (the DSA
    indexer's k_norm). megatron-core's WrappedTorchNorm is the same but refuses sequence parallelism,
    which the DSA attention needs at TP > 1 (``AbsorbedMLASelfAttention``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        return norm(hidden_size, eps=eps, dtype=config.params_dtype)


def _duplicated_linear():
    """TELinear(parallel_mode="duplicated") on CPU, for the DSA indexer's projections: a plain linear
    layer, replicated on every TP rank in the checkpoint as TELinear stores it."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    class DuplicatedLinear(torch.nn.Linear):
        def __init__(self, input_size, output_size, *, config, bias=False, **_):
            super().__init__(input_size, output_size, bias=bias, dtype=config.params_dtype)

        def forward(self, x):
            return super().forward(x), None

        # TELinear's _extra_state (its FP8 metadata; nothing without FP8): the checkpoint holds one
        # ShardedObject per projection, as a Transformer Engine model saves and asks for it.
        def get_extra_state(self):
            return None

        def set_extra_state(self, state):
            pass

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, None,
                                                       sharded_offsets)

    return DuplicatedLinear


def _dsa_attention(tc):
    """megatron-core's own DSA attention spec (``get_dsa_module_spec_for_backend``: absorbed MLA whose
    core attention is DSAttention with its DSAIndexer), with the local backend and CPU stand-ins for
    its Transformer Engine modules; the q/kv down projections are ColumnParallelLinear, the local
    module that spec accepts in place of TELinear."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class CpuBackend(LocalSpecProvider):
        def linear(self):
            return _duplicated_linear()

        def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):
            return CpuNorm

    spec = get_dsa_module_spec_for_backend(tc, backend=CpuBackend())
    spec.submodules.linear_q_down_proj = ColumnParallelLinear
    spec.submodules.linear_kv_down_proj = ColumnParallelLinear
    return spec


def _full_dim_qk_norm(heads_of):
    """MiniMax-M2's q/k norm, as Megatron-Bridge builds it (minimax_m2/layer_specs.py
    ``_FullDimRMSNorm``; megatron-core has none): one RMSNorm over all heads of the projection
    (``heads_of(config)`` heads of ``hidden_size``), each TP rank holding its heads' slice of the
    weight, the sum of squares all-reduced over TP. Stored as ``q_layernorm``/``k_layernorm``,
    sharded on its only axis."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    class FullDimRMSNorm(torch.nn.Module):
        def __init__(self, hidden_size, config, eps=1e-6):
            super().__init__()
            self.tp = config.tensor_model_parallel_size
            self.global_dim = heads_of(config) * hidden_size
            assert heads_of(config) % self.tp == 0
            self.eps = eps
            self.weight = torch.nn.Parameter(torch.ones(self.global_dim // self.tp, dtype=config.params_dtype))

        def forward(self, x):  # [sq, b, heads of this rank, head_dim]
            shape = x.shape
            xf = x.reshape(*shape[:2], -1).float()
            ss = xf.pow(2).sum(-1, keepdim=True)
            if self.tp > 1:
                dist.all_reduce(ss, group=ps.get_tensor_model_parallel_group())
            y = xf * torch.rsqrt(ss / self.global_dim + self.eps)
            return (self.weight * y.to(x.dtype)).reshape(shape)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            key = f"{prefix}weight"
            n = len(sharded_offsets)
            return {key: ShardedTensor.from_rank_offsets(
                key, self.weight, *sharded_offsets, (n, ps.get_tensor_model_parallel_rank(), self.tp),
                replica_id=(0, 0, ps.get_data_parallel_rank(with_context_parallel=True)), prepend_axis_num=n)}

    return FullDimRMSNorm


def transformer_config(family: str, cfg, **overrides):
    """The TransformerConfig of ``family`` in the current parallel state (``overrides`` replace
    fields of ``transformer_config_kwargs``). DSA at TP > 1 runs sequence parallel, as megatron-core
    requires (``AbsorbedMLASelfAttention``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = {**transformer_config_kwargs(family, cfg), **overrides}
    tp = ps.get_tensor_model_parallel_world_size()
    config_cls = MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig
    return config_cls(
        **kw, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=1 if kw.get("num_moe_experts") else None,
        sequence_parallel=family in DSA_FAMILIES and tp > 1,
    )


def block_spec(family: str, tc):
    """The local (no Transformer Engine) TransformerBlockSubmodules of ``family`` for ``tc``: one
    layer spec per layer (dense or MoE per ``moe_layer_freq``) and the final norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    variant, tc.experimental_attention_variant = tc.experimental_attention_variant, None
    try:  # megatron-core's GPT block spec refuses a variant; the DSA attention replaces its attention below
        spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    finally:
        tc.experimental_attention_variant = variant
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if family in DSA_FAMILIES:
            layer.submodules.self_attention = _dsa_attention(tc)
            layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = CpuNorm
        elif tc.multi_latent_attention:
            attention.core_attention = _mla_core_attention()
        if family == "minimax_m2":
            attention.q_layernorm = _full_dim_qk_norm(lambda c: c.num_attention_heads)
            attention.k_layernorm = _full_dim_qk_norm(lambda c: c.num_query_groups)
    if family in DSA_FAMILIES:
        spec.layer_norm = CpuNorm
    return spec


def init_values(model) -> None:
    """Non-trivial norm weights, biases, attention sinks and expert biases (a swapped or dropped tensor
    changes the logits); the DSA indexer's projections scaled up, so that its top-k differs clearly
    from what another indexer would pick."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("softmax_offset") or name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif ".indexer." in name:
                p.mul_(5.0)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def megatron_args(family: str, cfg, tc) -> dict:
    """The Megatron-LM arguments a training run of ``tc`` stores (names of
    megatron/training/arguments.py; most are TransformerConfig fields of the same name)."""
    from hf_families import VOCAB_MEGATRON

    same = ["num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
            "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "moe_shared_expert_intermediate_size",
            "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
            "moe_router_num_groups", "moe_router_group_topk", "multi_latent_attention", "q_lora_rank",
            "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm", "add_bias_linear",
            "add_qkv_bias", "softmax_type", "window_size", "window_attn_skip_freq", "glu_linear_offset",
            "activation_func_clamp_value", "experimental_attention_variant", "dsa_indexer_n_heads",
            "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset",
            "dsa_indexer_rope_interleaved", "dsa_indexer_scoring_relu", "dsa_indexer_rotate_activation",
            "mtp_num_layers"]
    rotary_percent = cfg.rope_parameters.get("partial_rotary_factor", 1.0)
    args = {k: getattr(tc, k) for k in same if hasattr(tc, k)}
    args.update(group_query_attention=tc.num_query_groups != tc.num_attention_heads, swiglu=True,
                num_experts=tc.num_moe_experts, padded_vocab_size=VOCAB_MEGATRON,
                untie_embeddings_and_output_weights=True, rotary_percent=rotary_percent,
                rotary_base=int(cfg.rope_parameters["rope_theta"]),
                tensor_model_parallel_size=tc.tensor_model_parallel_size, norm_epsilon=tc.layernorm_epsilon,
                vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=128,
                max_position_embeddings=cfg.max_position_embeddings,
                rope_type=getattr(tc, "rope_type", None) or "rope", use_rope_scaling=False)
    if family == "minimax_m2":
        args["qk_layernorm"] = False  # Megatron-Bridge's setting: its spec injects the full-dim norms itself
    return args


def dsa_mtp_block_spec(tc, layer):
    """The MTP block of a DSA family: megatron-core's MTP layer (``get_gpt_mtp_block_spec``'s modules)
    with ``CpuNorm`` norms, which unlike the local spec's allow the sequence parallelism DSA needs at
    TP > 1, around ``layer`` (a DSA MoE layer spec; ``None`` for a HybridModel, whose MTP layer is
    built from the pattern after '/'). Megatron numbers the MTP block's layer 1, so its attention
    runs its own indexer whatever the top-k sharing schedule."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    layers = [ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=CpuNorm, hnorm=CpuNorm, eh_proj=ColumnParallelLinear, mtp_model_layer=layer, layer_norm=CpuNorm))]
    spec = MultiTokenPredictionBlockSubmodules(layer_specs=layers * tc.mtp_num_layers)
    return spec if layer is not None else ModuleSpec(module=MultiTokenPredictionBlock, submodules=spec)


def build(family: str, cfg):
    """The megatron-core GPTModel of ``family`` shaped like ``cfg``, on CPU in the current parallel
    state, in eval mode, with ``init_values``; and the Megatron-LM args a training run stores."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from hf_families import VOCAB_MEGATRON

    tc = transformer_config(family, cfg)
    spec = block_spec(family, tc)
    mtp = None
    if tc.mtp_num_layers and family in DSA_FAMILIES:
        mtp = dsa_mtp_block_spec(tc, spec.layer_specs[-1])
    elif tc.mtp_num_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp = get_gpt_mtp_block_spec(tc, spec, use_transformer_engine=False)
    torch.manual_seed(1234)
    model = GPTModel(config=tc, transformer_layer_spec=spec, mtp_block_spec=mtp, vocab_size=VOCAB_MEGATRON,
                     max_sequence_length=64, position_embedding_type="rope",
                     rotary_base=int(cfg.rope_parameters["rope_theta"]),
                     rotary_percent=cfg.rope_parameters.get("partial_rotary_factor", 1.0),
                     share_embeddings_and_output_weights=False, parallel_output=False)
    init_values(model)
    return model.eval(), megatron_args(family, cfg, tc)


# name -> the fields of its ``hf_families.Family`` (the MoE ones' resharded layout is TP=2 x EP=2).
FAMILY_ARGS = {
    name: dict(hf_config=functools.partial(hf_config, name), build=functools.partial(build, name),
               moe=name not in DENSE_FAMILIES, cpu_patches=(cpu_patches,))
    for name in ("deepseek_v3", "glm4_moe", "gpt_oss", "deepseek_v32", "minimax_m2", "qwen2", "mixtral")
}
# Flags the architecture implies, saved wrong (``base/tp1/bad_args``): transformers' deepseek_v32
# indexer rotates its rope dims in halves and puts its scores through a ReLU.
FAMILY_ARGS["deepseek_v32"]["bad_args"] = dict(dsa_indexer_rope_interleaved=True, dsa_indexer_scoring_relu=False)
