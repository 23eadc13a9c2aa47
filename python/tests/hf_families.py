"""Model families for the `to-hf` logits tests: a registry and the shared harness.

Each family is a small HF config (transformers' own config class) and a builder of the megatron-core
model that the config describes. The harness (`save_and_forward`, run in gloo worker processes by
`mcore.spawn`) builds the model on CPU in two layouts (TP=1, and one resharded layout: TP=2, with
EP=2 for MoE), records Megatron's logits on fixed tokens and writes each layout twice: with
Megatron's own `dist_checkpointing.save` (torch_dist; megatron-core 0.19 writes no common.pt) and
with shardwise. The tests convert every checkpoint with `to-hf` and compare with transformers.

Add a family: a function building its HF config, a builder of its Megatron model from that config
(the `_gpt` helper covers GPT-like models), and a `Family` row in `FAMILIES`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

import hf_families_hybrid
import hf_families_moe
import hf_workers
from mcore import init_gloo

VOCAB_MEGATRON = 256  # the model's (padded) vocabulary; the HF configs say 250: the converter trims
HF_VOCAB = 250
TOKENS = torch.tensor([[3, 17, 42, 99, 7, 128, 5, 249, 11, 64, 200, 1]])
LAYOUTS = ("tp1", "resharded")
WRITERS = ("megatron", "shardwise")


@dataclass(frozen=True)
class Family:
    """A model family of the logits tests.

    hf_config: builds the small transformers config (its ``model_type`` selects the mapping).
    build: builds the megatron-core model for that config in the current parallel state; returns
        (model, args), args being the Megatron-LM arguments stored in the checkpoint's common state.
    moe: the resharded layout adds EP=2 (experts split between the two ranks) to TP=2.
    bad_args: when given, the TP=1 model is also saved by shardwise with these args changed
        (``base/tp1/bad_args``), for the tests of flags the architecture implies.
    load_check: the resharded model also loads both TP=1 checkpoints with
        ``shardwise.megatron.load`` and records its logits (``base/resharded/loaded_<writer>.pt``).
    gpt_twin: builds the GPTModel of the same config (a HybridModel family): saved by Megatron at
        TP=1 (``base/gpt``, with ``logits.pt``), then loaded into the resharded HybridModel by
        ``shardwise.megatron.load`` (``base/resharded/loaded_gpt.pt``) and by Megatron's own
        ``dist_checkpointing.load`` after its ``gpt_checkpoint_interop`` retargeting: the worker
        returns whether every tensor of the two loads is equal (``gpt_load_equal``).
    transformer_impl: the Megatron-LM ``--transformer-impl`` whose keys ``build`` gives (the GDN
        families' CPU stand-ins store Transformer Engine's fused norms), for ``from-hf``.
    """

    hf_config: Callable[[], object]
    build: Callable[[object], tuple]
    moe: bool = False
    cpu_patches: tuple[Callable[[], None], ...] = field(default=())
    bad_args: dict = field(default_factory=dict)
    load_check: bool = False
    gpt_twin: Callable[[object], object] | None = None
    transformer_impl: str = "local"


# --- CPU stand-ins for Transformer Engine modules -----------------------------------------------
# Qwen3-Next / Qwen3.5 checkpoints come from Transformer Engine training: their norms are
# zero-centred ((1 + w) * x / rms) and fused into the following linear (`in_proj.layer_norm_weight`,
# `linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`). TE does not run on CPU and
# megatron-core's torch norm refuses `layernorm_zero_centered_gamma`, so these two modules compute
# what TENorm / TELayerNormColumnParallelLinear compute and store the same keys.


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with the (1 + weight) scale of TENorm under ``layernorm_zero_centered_gamma``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _layer_norm_column_parallel_linear():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """ColumnParallelLinear after a zero-centred RMSNorm held as ``layer_norm_weight`` (replicated
        over TP in the checkpoint, as TE's fused module stores it)."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.norm_eps = config.layernorm_epsilon
            self.layer_norm_weight = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))

        def forward(self, x, *args, **kwargs):
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            return super().forward((y * (1.0 + self.layer_norm_weight.float())).to(x.dtype), *args, **kwargs)

    return LayerNormColumnParallelLinear


def _cpu_common_patches() -> None:
    # The forward forks Megatron's CUDA RNG tracker around dropout (p=0 here); on CPU there is no
    # CUDA generator to fork, so the fork becomes a no-op.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # megatron-core decorates fused helpers (GDN's gated norm, input preparation) with torch.compile;
    # compiling on a 2-core CPU costs minutes and changes nothing numerically that we test.
    torch._dynamo.config.disable = True


def _cpu_gdn_patches() -> None:
    # megatron-core's GDN needs flash-linear-attention importable; with deterministic_mode=True it
    # runs its pure-torch gated delta rule and F.conv1d, but the q/k L2 norm still calls fla's
    # Triton kernel, which has no CPU driver. Same formula in torch (fla's l2norm: x / sqrt(sum x^2 + 1e-6)).
    from megatron.core.ssm.gated_delta_net import common

    common.l2norm = lambda x, dim=-1, eps=1e-6: x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def hf_cpu_torch_paths() -> None:
    """transformers picks fla's Triton kernels for the gated delta rule whenever fla is importable (it
    is: megatron-core needs it), and those need a GPU. Unwrap the decorated functions of the GDN
    models back to transformers' own torch implementations."""
    for mod_name in ("qwen3_next.modeling_qwen3_next", "qwen3_5.modeling_qwen3_5", "qwen3_5_moe.modeling_qwen3_5_moe"):
        mod = importlib.import_module(f"transformers.models.{mod_name}")
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                   "causal_conv1d_update"):
            f = getattr(mod, fn)
            while hasattr(f, "__wrapped__"):
                f = f.__wrapped__
            setattr(mod, fn, f)


# --- HF configs ----------------------------------------------------------------------------------

_SMALL = dict(vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False)
# Gated DeltaNet: 2 key heads, 4 value heads (2 per key head, so the per-key-head grouping of
# Qwen3-Next is exercised), a full-attention layer every second layer.
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_conv_kernel_dim=4)
_LAYER_TYPES = ["linear_attention", "full_attention"] * 2
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)


def qwen3_next_config():
    import transformers

    return transformers.Qwen3NextConfig(intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1,
                                        mlp_only_layers=[], layer_types=_LAYER_TYPES, **_MOE, **_GDN, **_SMALL)


def qwen3_5_moe_config():
    import transformers

    # One MTP layer, as Qwen3.5's releases declare it (`mtp_num_hidden_layers`, which transformers'
    # config keeps as an extra field).
    return transformers.Qwen3_5MoeTextConfig(layer_types=_LAYER_TYPES, mtp_num_hidden_layers=1, **_MOE, **_GDN,
                                             **_SMALL)


def qwen3_5_config():
    import transformers

    return transformers.Qwen3_5TextConfig(intermediate_size=96, layer_types=_LAYER_TYPES, **_GDN, **_SMALL)


# --- Megatron models -------------------------------------------------------------------------------


def _rope(cfg) -> tuple[float, float]:
    rp = getattr(cfg, "rope_parameters", None) or {}
    theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    return theta, float(rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))


def _randomize_small_params(model) -> None:
    """Norm weights (zero at init) and the GDN decay bias (ones) get distinct values, so that a
    swapped, missing or un-offset tensor cannot go unnoticed in the logits."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def _distinct_experts(model, ep_rank: int) -> None:
    """Every EP rank initialises its local experts from the same seed, so at EP=2 expert 0 would
    equal expert 2: a converter swapping them would go unnoticed in the logits. Noise seeded by the
    EP rank makes every routed expert distinct (replicas of one EP rank stay equal)."""
    g = torch.Generator().manual_seed(1000 + ep_rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def _distinct_mtp_norms(model) -> None:
    """The MTP layer's norms start equal (all ones, or all zeros when zero-centred): a converter
    swapping enorm and hnorm would go unnoticed. Noise from one seed on every rank (the norms are
    replicated) makes each distinct."""
    g = torch.Generator().manual_seed(77)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("mtp.") and "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def _other_weights(model) -> None:
    """The resharded model of a ``load_check`` family is built from the TP=1 model's seed, and with
    CPU initialisation a dense model's weights come out equal at any TP: noise (the same on every rank,
    so replicas stay equal) makes it another model, so a load that leaves a tensor unread changes its
    logits."""
    g = torch.Generator().manual_seed(2000)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def gdn_model(cfg):
    """A megatron-core GPTModel shaped like a Qwen3-Next / Qwen3.5 text config: Gated DeltaNet
    layers and gated full attention per ``cfg.layer_types``, MoE with a gated shared expert (or a
    dense SwiGLU MLP), zero-centred norms, partial RoPE; the modules of a TE training run's
    checkpoint (see the CPU stand-ins above). Returns (model, Megatron-LM args)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    moe = getattr(cfg, "num_experts", 0) > 0
    # Megatron's pattern: layer i is full attention iff (i + 1) % linear_attention_freq == 0.
    full_every = cfg.layer_types.index("full_attention") + 1
    assert cfg.layer_types == ["full_attention" if (i + 1) % full_every == 0 else "linear_attention"
                               for i in range(cfg.num_hidden_layers)], cfg.layer_types
    theta, rotary_percent = _rope(cfg)
    tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    tc = TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim,
        ffn_hidden_size=getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps, layernorm_zero_centered_gamma=True, qk_layernorm=True,
        attention_output_gate=True, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, deterministic_mode=True, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1 if moe else None, sequence_parallel=False,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=full_every,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        **(dict(num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
                moe_ffn_hidden_size=cfg.moe_intermediate_size,
                moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                moe_shared_expert_gate=True, moe_router_load_balancing_type="none",
                moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, moe_router_pre_softmax=False)
           if moe else {}),
    )
    mtp_layers = getattr(cfg, "mtp_num_hidden_layers", 0) or 0
    if mtp_layers:
        tc.mtp_num_layers = mtp_layers
    ln_linear = _layer_norm_column_parallel_linear()
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ln_linear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear))
    attn = ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=SelfAttentionSubmodules(linear_qkv=ln_linear, core_attention=DotProductAttention,
                                                         linear_proj=RowParallelLinear, q_layernorm=ZeroCenteredRMSNorm,
                                                         k_layernorm=ZeroCenteredRMSNorm))
    if moe:
        # MoE layers keep their own pre-MLP norm (`pre_mlp_layernorm`), as in a TE run.
        mlp, pre_mlp = get_moe_module_spec(use_te=False, num_experts=cfg.num_experts), ZeroCenteredRMSNorm
    else:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ln_linear, linear_fc2=RowParallelLinear))
        pre_mlp = IdentityOp
    layers = [ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp, self_attention=gdn if t == "linear_attention" else attn,
        self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=pre_mlp, mlp=mlp, mlp_bda=get_bias_dropout_add))
        for t in cfg.layer_types]
    mtp = None
    if mtp_layers:
        # Qwen3.5's MTP layer: zero-centred norms around eh_proj, then a full-attention MoE layer
        # (the last decoder layer's spec), then its own final norm.
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear
        from megatron.core.transformer.multi_token_prediction import (
            MultiTokenPredictionBlockSubmodules, MultiTokenPredictionLayer, MultiTokenPredictionLayerSubmodules)

        assert cfg.layer_types[-1] == "full_attention"
        mtp = MultiTokenPredictionBlockSubmodules(layer_specs=[ModuleSpec(
            module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
                enorm=ZeroCenteredRMSNorm, hnorm=ZeroCenteredRMSNorm, eh_proj=ColumnParallelLinear,
                mtp_model_layer=layers[-1], layer_norm=ZeroCenteredRMSNorm))] * mtp_layers)
    torch.manual_seed(1234)
    model = GPTModel(config=tc, mtp_block_spec=mtp,
                     transformer_layer_spec=TransformerBlockSubmodules(layer_specs=layers,
                                                                       layer_norm=ZeroCenteredRMSNorm),
                     vocab_size=VOCAB_MEGATRON, max_sequence_length=64, position_embedding_type="rope",
                     rotary_percent=rotary_percent, rotary_base=int(theta),
                     share_embeddings_and_output_weights=False, parallel_output=False)
    _randomize_small_params(model)
    # The Megatron-LM arguments a training run stores (names of megatron/training/arguments.py).
    args = dict(num_layers=tc.num_layers, hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                group_query_attention=True, num_query_groups=tc.num_query_groups, kv_channels=tc.kv_channels,
                ffn_hidden_size=tc.ffn_hidden_size, swiglu=True, padded_vocab_size=VOCAB_MEGATRON,
                untie_embeddings_and_output_weights=True, apply_layernorm_1p=True, qk_layernorm=True,
                attention_output_gate=True, rotary_percent=rotary_percent, rotary_base=int(theta),
                experimental_attention_variant="gated_delta_net", linear_attention_freq=full_every,
                linear_conv_kernel_dim=tc.linear_conv_kernel_dim, linear_key_head_dim=tc.linear_key_head_dim,
                linear_value_head_dim=tc.linear_value_head_dim, linear_num_key_heads=tc.linear_num_key_heads,
                linear_num_value_heads=tc.linear_num_value_heads, num_experts=tc.num_moe_experts,
                make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp, vocab_size=cfg.vocab_size,
                norm_epsilon=tc.layernorm_epsilon, max_position_embeddings=cfg.max_position_embeddings,
                rope_type="rope", use_rope_scaling=False)
    if mtp_layers:
        args.update(mtp_num_layers=mtp_layers)
    if moe:
        args.update(moe_ffn_hidden_size=tc.moe_ffn_hidden_size, moe_router_topk=tc.moe_router_topk,
                    moe_shared_expert_intermediate_size=tc.moe_shared_expert_intermediate_size,
                    moe_shared_expert_gate=True, moe_router_score_function=tc.moe_router_score_function,
                    moe_router_pre_softmax=tc.moe_router_pre_softmax)
    return model.eval(), args


FAMILIES: dict[str, Family] = {
    "qwen3_next": Family(qwen3_next_config, gdn_model, moe=True, cpu_patches=(_cpu_gdn_patches,),
                         bad_args=dict(attention_output_gate=False, apply_layernorm_1p=False,
                                       moe_shared_expert_gate=False), transformer_impl="transformer_engine"),
    "qwen3_5_moe": Family(qwen3_5_moe_config, gdn_model, moe=True, cpu_patches=(_cpu_gdn_patches,),
                          transformer_impl="transformer_engine"),
    "qwen3_5": Family(qwen3_5_config, gdn_model, cpu_patches=(_cpu_gdn_patches,), transformer_impl="transformer_engine"),
}
# deepseek_v3 (MLA), glm4_moe, gpt_oss, deepseek_v32 (DSA), minimax_m2: their configs and Megatron
# builders are in hf_families_moe; HybridModel families in hf_families_hybrid.
FAMILIES.update({name: Family(**kw) for name, kw in hf_families_moe.FAMILY_ARGS.items()})
FAMILIES.update({name: Family(**kw, load_check=True) for name, kw in hf_families_hybrid.FAMILY_ARGS.items()})
for _name in ("deepseek_v32", "minimax_m2", "qwen2", "mixtral"):
    FAMILIES[_name] = dataclasses.replace(FAMILIES[_name], load_check=True)


def _moe_without_te_patch() -> None:
    # megatron-core 0.16.1 without Transformer Engine: moe_utils reads the global te_general_gemm,
    # defined only when TE imports; None selects its plain torch path.
    from megatron.core.transformer.moe import moe_utils

    moe_utils.__dict__.setdefault("te_general_gemm", None)


# llama, qwen3 and qwen3_moe: the configs and builders of the to-hf tests (hf_workers), registered
# here for from-hf's load-and-compare run (their to-hf tests are test_hf.py's; ``args`` is unused).
FAMILIES.update({
    arch: Family(functools.partial(hf_workers.hf_config, arch),
                 functools.partial(lambda arch, cfg: (hf_workers.build_model(arch, cfg), {}), arch),
                 moe=arch == "qwen3_moe", cpu_patches=(_moe_without_te_patch,))
    for arch in ("llama", "qwen3", "qwen3_moe")
})


# --- the harness ------------------------------------------------------------------------------


def _megatron_logits(model, vocab: int):
    """The model's logits on ``TOKENS`` ([seq, vocab])."""
    return _megatron_forward(model, vocab)[0]


def _megatron_forward(model, vocab: int):
    """The model's logits on ``TOKENS`` ([seq, vocab]) and, when it has MTP layers, Megatron's own MTP
    forward ([mtp layers, seq, vocab]: the hidden states the MTP block returns inside the model's
    forward, through the model's output layer), else None."""
    seq = TOKENS.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    captured = []
    mtp = getattr(model, "mtp", None)
    hook = mtp.register_forward_hook(lambda m, i, out: captured.append(out)) if mtp is not None else None
    with torch.no_grad():
        logits = model(TOKENS, torch.arange(seq).unsqueeze(0), mask)[0, :, :vocab].clone()
        mtp_logits = None
        if hook is not None:
            hook.remove()
            # [(1 + mtp layers) * seq, batch, hidden]: the decoder's, then each MTP layer's.
            chunks = torch.chunk(captured[0], 1 + model.config.mtp_num_layers, dim=0)[1:]
            mtp_logits = torch.stack([model.output_layer(h)[0][:, 0, :vocab] for h in chunks])
    return logits, mtp_logits


def _mtp_sources(model) -> dict:
    """Megatron's MTP module tensors and the embedding and output layer, by key (whole tensors at
    TP=1, EP=1), for the test that each exported MTP tensor equals its source."""
    keep = ("mtp.", "embedding.word_embeddings.weight", "output_layer.weight")
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if k.startswith(keep) and "_extra_state" not in k}


def _load_into(model, ckpt, **kwargs):
    """Loads ``ckpt`` into ``model`` with ``shardwise.megatron.load`` (no collective) and returns the
    model's logits; the state dict's tensors as loaded, by key."""
    import shardwise.megatron as swm

    state = swm.load(model.sharded_state_dict(), ckpt, **kwargs)
    for k in ("args", "iteration"):
        state.pop(k, None)
    model.load_state_dict(state)
    return _megatron_logits(model, HF_VOCAB), state


def _gpt_checkpoint_loads(model, ckpt, pattern) -> dict:
    """The GPT -> hybrid load of ``ckpt`` into ``model``: shardwise's (logits) and Megatron's own
    (``retarget_sharded_state_dict_to_gpt_checkpoint`` then ``dist_checkpointing.load``), every tensor
    compared."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
        gpt_compatible_layer_maps,
        retarget_sharded_state_dict_to_gpt_checkpoint,
    )

    logits, ours = _load_into(model, ckpt, hybrid_layer_pattern=pattern)
    sd = model.sharded_state_dict()
    retarget_sharded_state_dict_to_gpt_checkpoint(sd, gpt_compatible_layer_maps(pattern))
    theirs = dist_checkpointing.load(sd, ckpt)
    keys = sorted(k for k, v in theirs.items() if isinstance(v, torch.Tensor))
    equal = keys == sorted(k for k, v in ours.items() if isinstance(v, torch.Tensor)) and all(
        torch.equal(ours[k], theirs[k]) for k in keys)
    return {"logits": logits, "equal": equal, "tensors": len(keys)}


def save_and_forward(rank, world, port, base, family):
    """Worker (2 ranks): for each layout of ``LAYOUTS``, builds the family's model, records its logits
    (``base/<layout>/logits.pt``) and saves it with Megatron and with shardwise
    (``base/<layout>/<writer>``); a HybridModel's TP=1 model also without args
    (``base/tp1/noargs``). Writes the HF config to ``base/hf_config``. The load checks of
    ``Family.load_check`` and ``Family.gpt_twin`` run on the resharded model; each rank writes
    whether its share of the GPT -> hybrid load equals Megatron's (``base/gpt_load_rank<r>.json``)."""
    init_gloo(rank, world, port)
    _cpu_common_patches()
    _save_and_forward(rank, base, family)
    return {}


def save_and_forward_group(rank, world, port, base, families):
    """``save_and_forward`` of several families in one 2-process run (one start-up and import of
    megatron-core for all), each into ``base/<family>``. Their CPU patches must not conflict."""
    init_gloo(rank, world, port)
    _cpu_common_patches()
    for family in families:
        _save_and_forward(rank, os.path.join(base, family), family)
    return {}


# Families whose runs share one 2-process run (``save_and_forward_group``).
GROUP = ("deepseek_v32", "minimax_m2", "hybrid_qwen3", "hybrid_glm_moe_dsa", "qwen2", "mixtral")


def _save_and_forward(rank, base, family):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import shardwise.megatron as swm

    fam = FAMILIES[family]
    for patch in fam.cpu_patches:
        patch()
    cfg = fam.hf_config()
    for layout in LAYOUTS:
        tp = 1 if layout == "tp1" else 2
        ep = 2 if layout != "tp1" and fam.moe else 1
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1 if fam.moe else None)
        model, args = fam.build(cfg)
        _distinct_experts(model, ps.get_expert_model_parallel_rank())
        _distinct_mtp_norms(model)
        if layout != "tp1" and fam.load_check:
            _other_weights(model)
        logits, mtp_logits = _megatron_forward(model, cfg.vocab_size)
        if rank == 0 and mtp_logits is not None:
            os.makedirs(os.path.join(base, layout), exist_ok=True)
            torch.save(mtp_logits, os.path.join(base, layout, "mtp_logits.pt"))
            if layout == "tp1":
                torch.save(_mtp_sources(model), os.path.join(base, layout, "mtp_sources.pt"))
        variants = [(w, args) for w in WRITERS]
        if layout == "tp1" and fam.bad_args:
            variants.append(("bad_args", {**args, **fam.bad_args}))
        if layout == "tp1" and "hybrid_layer_pattern" in args:
            variants.append(("noargs", None))
        for name, stored_args in variants:
            sd = model.sharded_state_dict()
            if stored_args is not None:
                sd["args"] = argparse.Namespace(**stored_args)
            sd["iteration"] = 1
            d = os.path.join(base, layout, name)
            os.makedirs(d, exist_ok=True)
            if name == "megatron":
                dist_checkpointing.save(sd, d)
            else:
                swm.save(sd, d, timeout_s=120)
        if rank == 0:
            torch.save(logits, os.path.join(base, layout, "logits.pt"))
        if layout == "tp1" and fam.gpt_twin is not None:
            twin = fam.gpt_twin(cfg)
            os.makedirs(os.path.join(base, "gpt", "megatron"), exist_ok=True)
            sd = twin.sharded_state_dict()
            sd["args"] = argparse.Namespace(num_layers=cfg.num_hidden_layers)
            dist_checkpointing.save(sd, os.path.join(base, "gpt", "megatron"))
            if rank == 0:
                torch.save(_megatron_logits(twin, cfg.vocab_size), os.path.join(base, "gpt", "logits.pt"))
        if layout != "tp1" and fam.load_check:
            for writer in WRITERS:
                loaded, _ = _load_into(model, os.path.join(base, "tp1", writer))
                if rank == 0:
                    torch.save(loaded, os.path.join(base, layout, f"loaded_{writer}.pt"))
        if layout != "tp1" and fam.gpt_twin is not None:
            gpt = _gpt_checkpoint_loads(model, os.path.join(base, "gpt", "megatron"), args["hybrid_layer_pattern"])
            with open(os.path.join(base, f"gpt_load_rank{rank}.json"), "w") as f:
                json.dump({"equal": gpt["equal"], "tensors": gpt["tensors"]}, f)
            if rank == 0:
                torch.save(gpt["logits"], os.path.join(base, layout, "loaded_gpt.pt"))
        ps.destroy_model_parallel()
    if rank == 0:
        cfg.save_pretrained(os.path.join(base, "hf_config"))


def random_hf_model(cfg, out_dir: str):
    """A transformers model of ``cfg`` (float32) with every weight random and distinct: norms,
    biases, the GDN decay parameters, attention sinks and router biases too (transformers
    initialises many of them to constants, which would hide a swapped or dropped tensor). Norm
    weights lie in [0.6, 1.6), where ``w - 1`` and ``+ 1`` are exact in float32 (the GDN output
    norm's offset). Saved with ``save_pretrained`` into ``out_dir``; returns its logits on
    ``TOKENS``."""
    import transformers

    hf_cpu_torch_paths()
    torch.manual_seed(4321)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not p.is_floating_point() or "rotary" in name or name.endswith("inv_freq"):
                continue
            if "norm" in name or name.endswith("dt_bias"):
                p.copy_(0.6 + torch.rand(p.shape, generator=g))
            elif p.dim() < 2 or name.endswith("_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        model.save_pretrained(out_dir)
        return model(TOKENS).logits[0].clone()


# Config fields that no Megatron args hold (token ids) or that transformers uses only to initialise
# or train a model (initialisation, dropout, auxiliary loss, cache), and the config class's own
# bookkeeping: a config.json built from the args keeps transformers' defaults for them.
NOT_FROM_ARGS = {"self", "kwargs", "transformers_version", "architectures", "dtype", "output_hidden_states",
                 "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
                 "problem_type", "initializer_range", "use_cache", "output_router_logits", "router_aux_loss_coef",
                 "router_jitter_noise", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id"}


def model_fields(config) -> set:
    """The fields of ``config``'s class that the model reads: its constructor's parameters (transformers
    5 configs are dataclasses), less ``NOT_FROM_ARGS``."""
    import inspect

    return set(inspect.signature(type(config).__init__).parameters) - NOT_FROM_ARGS


def checkpoint_key_mismatch(model, ckpt_dir: str) -> tuple[list, list]:
    """What megatron-core's ``strict=raise_all`` compares, over all ranks: the keys of the
    checkpoint no rank asks for, and the keys some rank asks for that the checkpoint lacks
    (``validation._determine_missing_and_unexpected_keys``). megatron-core reads the checkpoint's
    keys with ``load_sharded_metadata``, which fails under torch 2.15 for any checkpoint
    (``torch.empty(**TensorProperties.__dict__)`` gets torch 2.15's new ``strides`` field), so the
    keys come from torch DCP's own ``.metadata`` reader here (a ShardedObject is stored as
    ``key/shard_<offset>_<shape>``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    asked = {v.key for v in nested_values(sd) if isinstance(v, ShardedBase)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(asked))
    asked_anywhere = set().union(*map(set, gathered))
    stored = {k.split("/shard_")[0] for k in dcp.FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata}
    return sorted(stored - asked_anywhere), sorted(asked - stored)


def _without_mtp(cfg):
    """``cfg`` declaring no MTP layers: from-hf converts transformers' own models, which build none
    (their MTP weights are ignored), so the Megatron model loading the result has none either."""
    for f in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if getattr(cfg, f, None):
            setattr(cfg, f, 0)
    return cfg


def load_and_forward(rank, world, port, base, families):
    """Worker (2 ranks): for each family, builds a fresh megatron-core model in the resharded layout
    (TP=2, EP=2 for MoE), fills it with megatron-core's own unmodified ``dist_checkpointing.load``
    from ``base/<family>/ckpt`` and records its logits (``base/<family>/megatron_logits.pt``).
    Returns, per family, the key mismatches ``strict=raise_all`` would report
    (:func:`checkpoint_key_mismatch`)."""
    init_gloo(rank, world, port)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    _cpu_common_patches()
    mismatch, errors = {}, {}
    for family in families:
        fam = FAMILIES[family]
        for patch in fam.cpu_patches:
            patch()
        cfg = _without_mtp(fam.hf_config())
        ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2 if fam.moe else 1,
                                     expert_tensor_parallel_size=1 if fam.moe else None)
        # One family's failure (a refused load fails on both ranks alike) is its test's, not the others'.
        try:
            model, _ = fam.build(cfg)
            ckpt = os.path.join(base, family, "ckpt")
            mismatch[family] = checkpoint_key_mismatch(model, ckpt)
            # As Megatron-LM's load_checkpoint asks: the model under "model", the common state beside it.
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt)
            model.load_state_dict(loaded["model"])
            logits = _megatron_logits(model, cfg.vocab_size)
            if rank == 0:
                torch.save(logits, os.path.join(base, family, "megatron_logits.pt"))
        except (Exception, CheckpointException):  # torch's CheckpointException is a BaseException
            errors[family] = traceback.format_exc()
        finally:
            ps.destroy_model_parallel()
    return {"mismatch": mismatch, "errors": errors}


def round_trip_load(rank, world, port, jobs):
    """Worker (2 ranks): for each ``(name, family, ckpt, original, out)``, builds the family's model with its MTP
    layers in the resharded layout (TP=2, EP=2 for MoE) and fills it with megatron-core's own
    ``dist_checkpointing.load`` from ``ckpt`` (a from-hf output), then a second one from
    ``original`` (the Megatron checkpoint that to-hf exported). Returns, per family, the key
    mismatches ``strict=raise_all`` would report and the state-dict keys whose local shards differ between the two (the vocabulary rows past ``vocab_size``
    excluded: Megatron pads them with random rows, from-hf with copies of the last row); rank 0 saves
    the first model's logits and MTP logits as ``out/logits.pt`` and ``out/mtp_logits.pt``. Results
    by ``name``."""
    init_gloo(rank, world, port)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    _cpu_common_patches()
    out = {}
    for name, family, ckpt, original, out_dir in jobs:
        fam = FAMILIES[family]
        for patch in fam.cpu_patches:
            patch()
        cfg = fam.hf_config()
        ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2 if fam.moe else 1,
                                     expert_tensor_parallel_size=1 if fam.moe else None)
        try:
            states, result = [], {"mismatch": None}
            for i, path in enumerate((ckpt, original)):
                model, _ = fam.build(cfg)
                if i == 0:
                    result["mismatch"] = checkpoint_key_mismatch(model, path)
                loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
                model.load_state_dict(loaded["model"])
                if i == 0:
                    logits, mtp_logits = _megatron_forward(model, cfg.vocab_size)  # on every rank: TP
                    if rank == 0:
                        torch.save(logits, os.path.join(out_dir, "logits.pt"))
                        torch.save(mtp_logits, os.path.join(out_dir, "mtp_logits.pt"))
                states.append({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
                               and not k.endswith("_extra_state")})
            ours, theirs = states
            rows = cfg.vocab_size - ps.get_tensor_model_parallel_rank() * ours["embedding.word_embeddings.weight"].shape[0]
            vocab = ("embedding.word_embeddings.weight", "output_layer.weight")

            def expected(k, t):
                """The original tensor as the round trip must give it back: the vocabulary rows
                only; the GDN output norm through HF's ``w + 1`` and back (``RMSNormGated`` scales
                by w, Megatron's by 1 + w), exact only where ``w + 1`` is in float32."""
                if k in vocab:
                    return t[:max(rows, 0)]
                return (t + 1) - 1 if k.endswith("self_attention.out_norm.weight") else t

            result["differ"] = sorted(
                k for k in set(ours) | set(theirs)
                if k not in ours or k not in theirs
                or not torch.equal(expected(k, ours[k]) if k in vocab else ours[k], expected(k, theirs[k])))
            result["tensors"] = len(ours)
        finally:
            ps.destroy_model_parallel()
        out[name] = result
    return out


def hf_reference_tensors(config_dir: str, out_dir: str) -> dict:
    """Name -> (dtype, shape) of what transformers' own ``save_pretrained`` writes for the config: a
    randomly initialised model of the config, saved."""
    import transformers
    from safetensors import safe_open

    cfg = transformers.AutoConfig.from_pretrained(config_dir)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    return safetensors_tensors(out_dir)


def safetensors_tensors(folder: str) -> dict:
    from pathlib import Path

    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                out[k] = (sl.get_dtype(), list(sl.get_shape()))
    return out


def declared_class(out_dir: str):
    """The transformers class the folder's config.json declares (``architectures[0]``), or
    ``AutoModelForCausalLM`` for a config that declares none."""
    import json

    import transformers

    arch = (json.loads(open(os.path.join(out_dir, "config.json")).read()).get("architectures") or [None])[0]
    return getattr(transformers, arch) if arch else transformers.AutoModelForCausalLM


def hf_load_and_logits(out_dir: str):
    """Loads a converted folder with the class its config.json declares (``declared_class``); returns
    (logits on ``TOKENS``, loading info: missing / unexpected / mismatched keys)."""
    hf_cpu_torch_paths()
    model, info = declared_class(out_dir).from_pretrained(out_dir, dtype=torch.float32, output_loading_info=True)
    model.eval()
    with torch.no_grad():
        return model(TOKENS).logits[0], info


# --- MTP: the published formula, computed from the exported HF tensors ------------------------------
# The MTP module of DeepSeek-V3 (its technical report, §2.2; its release's README_WEIGHTS.md) and of
# the families that copied it: for position i, h_i is the main model's last hidden state (after its
# final norm) and e_i the embedding of token i + 1;
#     x = eh_proj(concat(enorm(e_i), hnorm(h_i)));  x = TransformerLayer(x);  logits = head(norm(x)).
# The HF names of each family's module ("{L}" = num_hidden_layers): DeepSeek-V3's and GLM-4.5's
# releases keep it as decoder layer L, with its own copies of the embedding and head; Qwen3.5's
# (and Qwen3-Next's) as the top-level `mtp.*`, sharing the model's embedding and head. Qwen's norms
# are zero-centred ((1 + w) x / rms).
MTP_LAYOUT = {
    "deepseek_v3": dict(embed="model.layers.{L}.embed_tokens.weight", enorm="model.layers.{L}.enorm.weight",
                        hnorm="model.layers.{L}.hnorm.weight", proj="model.layers.{L}.eh_proj.weight",
                        norm="model.layers.{L}.shared_head.norm.weight",
                        head="model.layers.{L}.shared_head.head.weight", layer="model.layers.{L}.", one_plus=False),
    "qwen3_5_moe": dict(embed="model.embed_tokens.weight", enorm="mtp.pre_fc_norm_embedding.weight",
                        hnorm="mtp.pre_fc_norm_hidden.weight", proj="mtp.fc.weight", norm="mtp.norm.weight",
                        head="lm_head.weight", layer="mtp.layers.0.", one_plus=True),
}
MTP_LAYOUT["glm4_moe"] = MTP_LAYOUT["deepseek_v3"]
# DeepSeek-V3.2 keeps DeepSeek-V3's layout (deepseek-ai/DeepSeek-V3.2: layer 61 of 61, copies
# included); GLM-5 its names without the copies of the embedding and head (zai-org/GLM-5: layer 78
# of 78 holds enorm, hnorm, eh_proj, shared_head.norm and the layer; the model's embed_tokens and
# lm_head serve it). Both MTP layers hold a DSA indexer.
MTP_LAYOUT["deepseek_v32"] = MTP_LAYOUT["deepseek_v3"]
MTP_LAYOUT["glm_moe_dsa"] = dict(MTP_LAYOUT["deepseek_v3"], embed="model.embed_tokens.weight", head="lm_head.weight")
MTP_LAYOUT["hybrid_glm_moe_dsa"] = MTP_LAYOUT["glm_moe_dsa"]
# The names each release holds for its MTP layer L = num_hidden_layers beyond a decoder layer's, and
# its indexer's (FP8 scales left out): deepseek-ai/DeepSeek-V3.2 layer 61 (DeepSeek-V3's
# README_WEIGHTS.md names; its 92,425 tensors count them), zai-org/GLM-5 layer 78 (Megatron-Bridge
# glm5_bridge.py's MTP names; vLLM-Ascend's GLM-5 guide: no embed_tokens / shared_head.head copies).
# The index files themselves were not at hand: crates/shardwise-hf/src/rules.rs cites each source.
RELEASE_MTP_NAMES = {
    "deepseek_v32": ["model.layers.{L}.embed_tokens.weight", "model.layers.{L}.enorm.weight",
                     "model.layers.{L}.hnorm.weight", "model.layers.{L}.eh_proj.weight",
                     "model.layers.{L}.shared_head.norm.weight", "model.layers.{L}.shared_head.head.weight",
                     "model.layers.{L}.self_attn.indexer.wq_b.weight", "model.layers.{L}.self_attn.indexer.wk.weight",
                     "model.layers.{L}.self_attn.indexer.k_norm.weight", "model.layers.{L}.self_attn.indexer.k_norm.bias",
                     "model.layers.{L}.self_attn.indexer.weights_proj.weight"],
    "glm_moe_dsa": ["model.layers.{L}.enorm.weight", "model.layers.{L}.hnorm.weight", "model.layers.{L}.eh_proj.weight",
                    "model.layers.{L}.shared_head.norm.weight", "model.layers.{L}.self_attn.indexer.wq_b.weight",
                    "model.layers.{L}.self_attn.indexer.wk.weight", "model.layers.{L}.self_attn.indexer.k_norm.weight",
                    "model.layers.{L}.self_attn.indexer.k_norm.bias",
                    "model.layers.{L}.self_attn.indexer.weights_proj.weight"],
}


def mtp_expected_tensors(family: str, reference: dict, num_layers: int) -> dict:
    """Name -> (dtype, shape) of the MTP tensors the family's official layout holds for one MTP layer,
    from ``reference`` (what ``save_pretrained`` writes for the model without MTP): the transformer layer
    is shaped like the last decoder layer (full attention and MoE in each family here)."""
    lay = MTP_LAYOUT[family]
    L = str(num_layers)
    last = f"model.layers.{num_layers - 1}."
    layer = lay["layer"].replace("{L}", L)
    out = {layer + k[len(last):]: v for k, v in reference.items() if k.startswith(last)}
    # A DSA MTP layer runs its own indexer, shaped like every indexer of the model (glm_moe_dsa's
    # last decoder layer shares its predecessor's top-k and has none).
    out.update({layer + k.split(".", 3)[3]: v for k, v in reference.items() if ".self_attn.indexer." in k})
    dt, (_, hidden) = reference["model.embed_tokens.weight"][0], reference["model.embed_tokens.weight"][1]
    for k in ("enorm", "hnorm", "norm"):
        out[lay[k].replace("{L}", L)] = (dt, [hidden])
    out[lay["proj"].replace("{L}", L)] = (dt, [hidden, 2 * hidden])
    if lay["embed"].replace("{L}", L).startswith(layer):  # DeepSeek's own copies
        out[lay["embed"].replace("{L}", L)] = reference["model.embed_tokens.weight"]
        out[lay["head"].replace("{L}", L)] = reference["lm_head.weight"]
    return out


def mtp_source_pairs(family: str, sources: dict, num_layers: int, vocab: int, t: dict) -> list:
    """(Megatron key, HF name, Megatron tensor) for each exported MTP tensor that is its Megatron
    source as it is (no split or fusion): the module's own tensors, its copies of the embedding and
    head (vocabulary padding trimmed), the layer's norms, router and experts' down projections.
    ``sources``: Megatron's state_dict at TP=1 (``_mtp_sources``); ``t``: the exported tensors (for
    the multimodal layout's prefix)."""
    lay = {k: (v.replace("{L}", str(num_layers)) if isinstance(v, str) else v) for k, v in MTP_LAYOUT[family].items()}
    if lay["embed"] not in t:
        lay["embed"] = lay["embed"].replace("model.", "model.language_model.")
    layer = lay["layer"]
    own = {"enorm.weight": lay["enorm"], "hnorm.weight": lay["hnorm"], "eh_proj.weight": lay["proj"],
           "final_layernorm.weight": lay["norm"],
           "mtp_model_layer.pre_mlp_layernorm.weight": layer + "post_attention_layernorm.weight",
           "mtp_model_layer.input_layernorm.weight": layer + "input_layernorm.weight",
           "mtp_model_layer.mlp.router.weight": layer + "mlp.gate.weight"}
    pairs = []
    for k, v in sources.items():
        if k == "embedding.word_embeddings.weight" and lay["embed"].startswith(layer):
            pairs.append((k, lay["embed"], v[:vocab]))
        elif k == "output_layer.weight" and lay["head"].startswith(layer):
            pairs.append((k, lay["head"], v[:vocab]))
        elif k.startswith("mtp.layers.0."):
            # A HybridModel's MTP layer is its attention (layers.0) and MoE (layers.1) layer.
            sub = re.sub(r"^mtp_model_layer\.layers\.[01]\.", "mtp_model_layer.", k[len("mtp.layers.0."):])
            m = re.fullmatch(r"mtp_model_layer\.mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", sub)
            if sub in own:
                pairs.append((k, own[sub], v))
            elif m:
                pairs.append((k, f"{layer}mlp.experts.{m[1]}.down_proj.weight", v))
    return pairs


def _folder_tensors(folder: str) -> dict:
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _load_layer(layer, prefix: str, t: dict, module: set) -> None:
    """Loads the exported tensors under ``prefix`` (per-expert names, as ``save_pretrained`` writes
    them) into transformers' decoder ``layer``, fusing experts as its parameters hold them
    (``gate_up_proj`` [E, 2I, H] = per expert [gate; up], ``down_proj`` [E, H, I]). Every exported
    tensor of the layer is used, and every parameter and buffer set. ``module``: the MTP module's own
    tensors (DeepSeek's share the layer's prefix), which the formula uses instead."""
    ours = {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix) and k not in module}
    used, sd = set(), {}
    for k, v in layer.state_dict().items():
        if k in ours:
            sd[k] = ours[k]
            used.add(k)
            continue
        base, _, kind = k.rpartition(".")  # mlp.experts . gate_up_proj / down_proj
        n = v.shape[0]
        if kind == "gate_up_proj":
            names = [[f"{base}.{e}.gate_proj.weight", f"{base}.{e}.up_proj.weight"] for e in range(n)]
            sd[k] = torch.stack([torch.cat([ours[g], ours[u]]) for g, u in names])
            used.update(x for pair in names for x in pair)
        elif kind == "down_proj":
            names = [f"{base}.{e}.down_proj.weight" for e in range(n)]
            sd[k] = torch.stack([ours[x] for x in names])
            used.update(names)
        else:
            raise AssertionError(f"{prefix}{k}: not exported")
    assert used == set(ours), sorted(set(ours) - used)
    layer.load_state_dict(sd, strict=True)


def hf_mtp_logits(out_dir: str, family: str):
    """The MTP layer's logits on ``TOKENS`` ([seq, vocab]), by the formula above from the exported
    tensors alone; transformers supplies the main model's last hidden state and the decoder layer
    class (a copy of its last layer, loaded with the MTP layer's tensors). Megatron's MTP takes token
    i + 1 at position i and token 0 past the end (``roll_tensor``), as here."""
    import copy

    import transformers

    hf_cpu_torch_paths()
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    cfg = model.config.get_text_config()
    t = _folder_tensors(out_dir)
    lay = {k: (v.replace("{L}", str(cfg.num_hidden_layers)) if isinstance(v, str) else v) for k, v in
           MTP_LAYOUT[family].items()}
    if lay["embed"] not in t:  # the multimodal layout's text model
        lay["embed"] = lay["embed"].replace("model.", "model.language_model.")
    eps = cfg.rms_norm_eps

    def norm(x, w):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * (1.0 + w if lay["one_plus"] else w)

    decoder = model.get_decoder()
    # The last decoder layer, or for DSA the last that runs its own indexer (as the MTP layer does).
    last = max(i for i, l in enumerate(decoder.layers)
               if not getattr(getattr(l, "self_attn", None), "skip_topk", False))
    layer = copy.deepcopy(decoder.layers[last])
    _load_layer(layer, lay["layer"], t, {v for k, v in lay.items() if k not in ("layer", "one_plus")})
    seq = TOKENS.shape[1]
    pos = torch.arange(seq).unsqueeze(0)
    with torch.no_grad():
        h = decoder(input_ids=TOKENS).last_hidden_state
        nxt = torch.cat([TOKENS[:, 1:], torch.zeros_like(TOKENS[:, :1])], dim=1)
        e = torch.nn.functional.embedding(nxt, t[lay["embed"]])
        x = torch.cat([norm(e, t[lay["enorm"]]), norm(h, t[lay["hnorm"]])], dim=-1) @ t[lay["proj"]].T
        mask = None
        if hasattr(getattr(layer, "self_attn", None), "indexer"):  # DSA: the indexer masks by the causal mask it is given
            from transformers.masking_utils import create_causal_mask

            mask = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos,
                                      allow_is_causal_skip=False)
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=decoder.rotary_emb(x, pos))
        x = out[0] if isinstance(out, tuple) else out
        return (norm(x, t[lay["norm"]]) @ t[lay["head"]].T)[0]


def train_and_save(rank, world, port, family, ckpt, base, steps):
    """Worker (4 ranks), the slime #1908 job scaled down: the family's model (with its MTP layer where
    it has one) at TP=2 (x EP=2 for MoE), DP=2, starts from ``ckpt`` (from-hf's output, loaded by
    megatron-core), trains
    ``steps`` SGD steps (language-model and MTP loss; gradients averaged over the DP and expert-DP
    groups as Megatron's DDP does), and saves after each step with
    ``shardwise.megatron.save(async_save=True)`` into ``base/iter_<step>``. While a save runs, the
    ranks' process groups disagree: ranks 0 and 1 sync "rollout weights" over their own group, ranks
    2 and 3 over theirs, and rank 3 calls save 2 s late, so no collective spanning all ranks could
    complete (Megatron's save gathers its plan on all ranks). Rank 0 saves the trained model's logits
    and MTP logits as ``base/logits.pt`` and ``base/mtp_logits.pt``. Returns each save's report."""
    import time

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import shardwise.megatron as swm

    init_gloo(rank, world, port)
    _cpu_common_patches()
    fam = FAMILIES[family]
    for patch in fam.cpu_patches:
        patch()
    cfg = fam.hf_config()
    pair_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2 if fam.moe else 1,
                                 expert_tensor_parallel_size=1 if fam.moe else None)
    model, _ = fam.build(cfg)
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt)["model"])
    # The run's args are the ones from-hf stored (what --use-checkpoint-args would start from).
    args = dist_checkpointing.load_common_state_dict(ckpt)["args"]
    seq = TOKENS.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    labels = torch.roll(TOKENS, -1, dims=1)
    reports = []
    for step in range(1, steps + 1):
        # eval mode: Megatron refuses MoE with TP in training mode without sequence parallelism,
        # which the CPU forward does not run; dropout is 0 and the MTP loss still reaches its
        # gradients (``process_mtp_loss`` only logs by ``is_training``).
        model.zero_grad()
        loss = model(TOKENS, torch.arange(seq).unsqueeze(0), mask, labels=labels).float().mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is None:
                    continue
                # Expert weights over the expert-DP group; the others over DP, and those that every
                # TP rank holds whole (norms, the per-head q/k norms whose gradient each TP rank
                # computes from its own heads) over TP too, so that every replica stays equal.
                groups = ([ps.get_expert_data_parallel_group()] if not getattr(p, "allreduce", True)
                          else [ps.get_data_parallel_group()]
                          + ([] if getattr(p, "tensor_model_parallel", False)
                             else [ps.get_tensor_model_parallel_group()]))
                for group in groups:
                    dist.all_reduce(p.grad, group=group)
                    p.grad /= dist.get_world_size(group)
                p -= 1e-2 * p.grad
        sd = model.sharded_state_dict()
        sd["args"] = args
        sd["iteration"] = step
        if rank == 3:
            time.sleep(2.0)
        handle = swm.save(sd, os.path.join(base, f"iter_{step:07d}"), async_save=True, timeout_s=120)
        pair = pair_groups[rank // 2]
        for _ in range(3):
            dist.all_reduce(torch.ones(4), group=pair)
        reports.append(handle.wait(120))
    logits, mtp_logits = _megatron_forward(model, cfg.vocab_size)
    if rank == 0:
        torch.save(logits, os.path.join(base, "logits.pt"))
        torch.save(mtp_logits, os.path.join(base, "mtp_logits.pt"))
    return {"reports": [{k: r[k] for k in ("committed", "save_id")} for r in reports]}
