"""HybridModel versions of the `to-hf` families: megatron-core 0.19.2's HybridModel (GPTModel is
deprecated for it since 0.19.0, Megatron-LM #5911) gives each attention and each MLP its own layer,
``decoder.layers.<g>.self_attention...`` then ``decoder.layers.<g+1>.mlp...``, and ends in
``decoder.final_norm``. The model is built from the same local layer specs as the family's GPTModel
(``hf_families_moe.block_spec``): the attention part of each GPT layer becomes the pattern's mixer
layer ('*' attention, '+' MLA, 'D' DeepSeek sparse attention), its MLP part an MLP ('-') or MoE ('E')
layer, so HF layer l is hybrid layers 2l and 2l + 1 (``hybrid_layer_pattern`` e.g. ``*-*-*-``).

The stored args are those of a hybrid training run (megatron/training/arguments.py): ``num_layers`` is
the pattern's length, ``hybrid_layer_pattern`` the pattern, ``moe_layer_freq`` left at its default (a
HybridModel takes its MoE layers from the pattern).
"""

from __future__ import annotations

import functools

import torch

import hf_families_moe as hfm


def cpu_patches() -> None:
    """HybridStack builds its final norm as TENorm whatever the spec says
    (``hybrid_block.HybridStack.__init__``); on CPU it is ``hf_families_moe.CpuNorm``."""
    from megatron.core.models.hybrid import hybrid_block

    hybrid_block.TENorm = hfm.CpuNorm


def _mixer(family: str) -> str:
    return "D" if family in hfm.DSA_FAMILIES else "+" if family in hfm.MLA_FAMILIES else "*"


def build(family: str, cfg):
    """The HybridModel of ``family`` shaped like ``cfg`` (see the module doc), on CPU in the current
    parallel state, with ``hf_families_moe.init_values``; and the args of a hybrid training run."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_moe_layer_pattern
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from hf_families import VOCAB_MEGATRON

    n = cfg.num_hidden_layers
    gpt = hfm.transformer_config(family, cfg)
    layers = hfm.block_spec(family, gpt).layer_specs
    moe = [bool(m) for m in get_moe_layer_pattern(gpt)] if gpt.num_moe_experts else [False] * n
    mixer = _mixer(family)
    pattern = "".join(mixer + ("E" if m else "-") for m in moe)
    if gpt.mtp_num_layers:
        # Each MTP depth one attention and one MoE layer, after '/' (the MTP layer of DeepSeek-V3.2
        # and GLM-5: DSA with its indexer, MoE).
        pattern += f"/{mixer}E" * gpt.mtp_num_layers
    overrides = dict(num_layers=2 * n)
    if gpt.num_moe_experts:
        overrides["moe_layer_freq"] = 1  # Megatron's default; the pattern places the MoE layers
    if family in hfm.DSA_FAMILIES:
        # The top-k sharing schedule counts hybrid layers: HF layer l's attention is layer 2l + 1.
        overrides.update(hfm.dsa_topk_schedule(cfg, [2 * l + 1 for l in range(n)]))
    tc = hfm.transformer_config(family, cfg, **overrides)

    def part(cls, layer, **fields):
        # The GPT layer's key map too: its norms are saved under Transformer Engine's fused names
        # (``linear_qkv.layer_norm_weight``), as a HybridModel (always TE) and the GPT twin save them.
        return ModuleSpec(module=cls, submodules=TransformerLayerSubmodules(
            **{f: getattr(layer.submodules, f) for f in fields},
            sharded_state_dict_keys_map=dict(layer.submodules.sharded_state_dict_keys_map)))

    slot = {"*": "attention_layer", "+": "mla_layer", "D": "dsa_layer"}[mixer]
    stack = {slot: part(TransformerLayer, layers[0], input_layernorm=1, self_attention=1, self_attn_bda=1)}
    if not all(moe):
        stack["mlp_layer"] = part(MLPLayer, layers[moe.index(False)], pre_mlp_layernorm=1, mlp=1, mlp_bda=1)
    if any(moe):
        stack["moe_layer"] = part(MoETransformerLayer, layers[moe.index(True)], pre_mlp_layernorm=1, mlp=1, mlp_bda=1)
    if gpt.mtp_num_layers:
        stack["mtp_block_spec"] = hfm.dsa_mtp_block_spec(tc, None)
    torch.manual_seed(1234)
    model = HybridModel(config=tc, hybrid_stack_spec=ModuleSpec(module=HybridStack,
                                                                submodules=HybridStackSubmodules(**stack)),
                        vocab_size=VOCAB_MEGATRON, max_sequence_length=64, hybrid_layer_pattern=pattern,
                        position_embedding_type="rope", rotary_base=int(cfg.rope_parameters["rope_theta"]),
                        rotary_percent=cfg.rope_parameters.get("partial_rotary_factor", 1.0),
                        share_embeddings_and_output_weights=False, parallel_output=False)
    hfm.init_values(model)
    args = hfm.megatron_args(family, cfg, tc)
    args["hybrid_layer_pattern"] = pattern
    return model.eval(), args


def build_gpt(family: str, cfg):
    """The GPTModel of the same config (other weights): the source of the GPT -> hybrid load."""
    torch.manual_seed(99)
    model, _ = hfm.build(family, cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(99)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


# name -> the fields of its ``hf_families.Family``. hybrid_qwen3: the dense pattern ``*-*-*-``, also
# loaded from a GPT checkpoint of the same config (Megatron's GPT -> hybrid interop covers '*' and
# '-'); hybrid_glm_moe_dsa: DSA mixers, a dense then MoE layers (``D-DEDE``), top-k sharing counted
# in hybrid layers.
FAMILY_ARGS = {
    "hybrid_qwen3": dict(hf_config=functools.partial(hfm.hf_config, "qwen3"), build=functools.partial(build, "qwen3"),
                         cpu_patches=(cpu_patches,), gpt_twin=functools.partial(build_gpt, "qwen3"),
                         # A stored pattern that does not pair into HF layers (``base/tp1/bad_args``).
                         bad_args=dict(hybrid_layer_pattern="*--**-")),
    "hybrid_glm_moe_dsa": dict(hf_config=functools.partial(hfm.hf_config, "glm_moe_dsa"),
                               build=functools.partial(build, "glm_moe_dsa"), moe=True,
                               cpu_patches=(hfm.cpu_patches, cpu_patches),
                               # transformers' glm_moe_dsa indexer rotates its rope dims interleaved.
                               bad_args=dict(dsa_indexer_rope_interleaved=False)),
}
