"""Spawned workers for the to-hf tests: a megatron-core GPTModel shaped like a small HF config,
saved by Megatron's own torch_dist and by shardwise at TP=2 (EP=2 for MoE), and its logits on fixed
tokens for comparison with the converted HF model."""

from __future__ import annotations

import argparse
import os

import torch

from mcore import init_gloo

VOCAB_MEGATRON = 256  # the model's (padded) vocabulary; the HF config says 250: the converter trims
TOKENS = torch.tensor([[3, 17, 42, 99, 7, 128, 5, 249, 11, 64, 200, 1]])


def hf_config(arch: str):
    """The small HF config of each architecture (transformers' own config classes)."""
    import transformers

    common = dict(vocab_size=250, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False)
    if arch == "llama":
        return transformers.LlamaConfig(intermediate_size=128, attention_bias=False, mlp_bias=False, **common)
    if arch == "qwen3":
        return transformers.Qwen3Config(intermediate_size=128, **common)
    return transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                       num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                       mlp_only_layers=[], **common)


def _rope_theta(cfg) -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def build_model(arch: str, cfg):
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = arch == "qwen3_moe"
    tc = TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.intermediate_size, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
        qk_layernorm=arch != "llama", hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size() if moe else 1,
        expert_tensor_parallel_size=1 if moe else None,
        sequence_parallel=False,
        **(dict(num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
                moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_router_load_balancing_type="none",
                moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, moe_router_pre_softmax=False)
           if moe else {}),
    )
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts if moe else None, qk_layernorm=arch != "llama")
    torch.manual_seed(1234)
    model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=VOCAB_MEGATRON, max_sequence_length=64,
                     position_embedding_type="rope", rotary_base=int(_rope_theta(cfg)),
                     share_embeddings_and_output_weights=False, parallel_output=False)
    # Non-trivial norm weights, so that a swapped or missing norm cannot go unnoticed.
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def save_and_forward(rank, world, port, base, arch, url=None):
    """Builds the model, saves it with Megatron and shardwise into ``base``, and records the logits.
    With ``url`` (an object-store checkpoint) shardwise saves there too, leaving the commit to
    ``shardwise merge`` (``merge_rank=None``), and Megatron's own save is skipped."""
    init_gloo(rank, world, port)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import shardwise.megatron as swm

    moe = arch == "qwen3_moe"
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2 if moe else 1,
                                 expert_tensor_parallel_size=1 if moe else None)
    cfg = hf_config(arch)
    model = build_model(arch, cfg)
    # The forward forks Megatron's CUDA RNG tracker around dropout (p=0 here); on CPU there is no
    # CUDA generator to fork, so the fork becomes a no-op.
    import contextlib

    from megatron.core.tensor_parallel import random as mrandom

    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    if moe:
        # megatron-core 0.16.1 bug without TransformerEngine: moe_utils reads the global te_general_gemm,
        # which is defined only when TE imports. None selects its plain torch path.
        from megatron.core.transformer.moe import moe_utils

        moe_utils.__dict__.setdefault("te_general_gemm", None)
    seq = TOKENS.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(TOKENS, torch.arange(seq).unsqueeze(0), mask)
    # The args fields megatron/training/arguments.py stores that the to-hf checks read (a real
    # training run stores them all; padded_vocab_size is make_vocab_size_divisible_by x TP = 256).
    args = argparse.Namespace(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                              num_attention_heads=cfg.num_attention_heads, group_query_attention=True,
                              num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim,
                              ffn_hidden_size=cfg.intermediate_size,
                              num_experts=cfg.num_experts if moe else None,
                              moe_ffn_hidden_size=cfg.moe_intermediate_size if moe else None,
                              moe_shared_expert_intermediate_size=None, moe_layer_freq=1,
                              untie_embeddings_and_output_weights=True, vocab_size=cfg.vocab_size,
                              padded_vocab_size=VOCAB_MEGATRON, make_vocab_size_divisible_by=128,
                              tensor_model_parallel_size=2, norm_epsilon=cfg.rms_norm_eps,
                              max_position_embeddings=cfg.max_position_embeddings,
                              rotary_base=int(_rope_theta(cfg)),
                              moe_router_topk=cfg.num_experts_per_tok if moe else None,
                              moe_router_score_function="softmax", moe_router_pre_softmax=False,
                              swiglu=True, qk_layernorm=arch != "llama", rope_type="rope",
                              use_rope_scaling=False)
    # "megatron": Megatron's own save (megatron-core 0.19: args inside the .distcp files'
    # common_state object); "shardwise": common.pt; "noargs": no args stored at all.
    for who in ("shardwise", "s3") if url else ("megatron", "shardwise", "noargs"):
        sd = model.sharded_state_dict()
        if who != "noargs":
            sd["args"] = args
        sd["iteration"] = 1
        d = os.path.join(base, who)
        os.makedirs(d, exist_ok=True)
        if who == "s3":
            swm.save(sd, url, timeout_s=120, merge_rank=None)
            continue
        if who == "megatron":
            dist_checkpointing.save(sd, d)
        else:
            swm.save(sd, d, timeout_s=120)
    if rank == 0:
        torch.save(logits[0, :, :cfg.vocab_size].clone(), os.path.join(base, "logits.pt"))
        cfg.save_pretrained(os.path.join(base, "hf_config"))
    return {}
