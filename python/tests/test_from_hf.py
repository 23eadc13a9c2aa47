"""`shardwise from-hf`: a Hugging Face folder becomes a Megatron torch_dist checkpoint by the to-hf rule
table read in reverse. For every family of the to-hf registry (``hf_families``): random weights from
transformers (``save_pretrained``) are converted at TP=2 (the vocabulary padded to 128 x 2); megatron-core's
own unmodified ``dist_checkpointing.load`` fills a freshly built model at TP=2 (x EP=2 for MoE) on gloo
CPU ranks (one 2-process run for all families), with no key mismatch of the kind ``strict=raise_all``
reports (``hf_families.checkpoint_key_mismatch``: that check itself fails under torch 2.15); Megatron's logits equal
transformers'; and ``to-hf`` of the result gives back the input tensors bitwise. Quantized inputs
(block FP8, MXFP4) are dequantized bitwise as the tests' own reference computes; bad inputs are refused,
naming the tensor, with nothing committed; ``--workers`` and ``--part`` write byte-identical files."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_families
import hf_families_hybrid
import shardwise
from mcore import spawn

# from-hf writes a GPTModel's keys; the HybridModel variants (hf_families_hybrid) are the same HF
# families, which megatron-core's gpt_checkpoint_interop retargets.
MCORE = importlib.metadata.version("megatron-core")
# With an older release first on PYTHONPATH (`make test` runs the Megatron load of this file once
# more with the oldest release of the matrix), hf_workers' dense builders only: the other builders
# use 0.19's modules, and before 0.19 a MoE model at TP=2 x EP=2 requires sequence parallelism,
# which the CPU forward does not run.
FAMILIES = ([f for f in hf_families.FAMILIES if f not in hf_families_hybrid.FAMILY_ARGS]
            if tuple(map(int, MCORE.split(".")[:2])) >= (0, 19) else ["llama", "qwen3"])
LOADED = FAMILIES
MAX_REL_DIFF = 1e-4


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _hf_tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _from_hf(family, hf_dir, ckpt, **kw):
    fam = hf_families.FAMILIES[family]
    return shardwise.from_hf(str(hf_dir), str(ckpt), dtype="fp32", transformer_impl=fam.transformer_impl,
                             tensor_model_parallel_size=2, **kw)


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """Every family's random HF folder (``<family>/hf``), its transformers logits and its from-hf
    checkpoint (``<family>/ckpt``)."""
    base = tmp_path_factory.mktemp("from_hf")
    summaries = {}
    for family in FAMILIES:
        fam = hf_families.FAMILIES[family]
        logits = hf_families.random_hf_model(fam.hf_config(), str(base / family / "hf"))
        torch.save(logits, base / family / "hf_logits.pt")
        summaries[family] = _from_hf(family, base / family / "hf", base / family / "ckpt", workers=2)
    return base, summaries


@pytest.fixture(scope="session")
def megatron_loaded(converted):
    """One 2-rank run for all families: megatron-core's load of each checkpoint and its logits
    (``<family>/megatron_logits.pt``); the ranks' results, failures included."""
    base, _ = converted
    assert MCORE == os.environ.get("SHARDWISE_MCORE", MCORE), "not the release the matrix asked for"
    return spawn(hf_families.load_and_forward, 2, str(base / "out"), str(base), LOADED, timeout_s=900)


@pytest.mark.parametrize("family", LOADED)
def test_megatron_loads_it_strictly_and_its_logits_equal_transformers(converted, megatron_loaded, family):
    base, summaries = converted
    failed = [r for r in megatron_loaded if not r.get("ok")]
    assert not failed, "\n".join(f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}" for r in failed)
    for r in megatron_loaded:
        assert family not in r["errors"], f"rank {r['rank']}: {r['errors'][family]}"
        unrequested, absent = r["mismatch"][family]
        assert unrequested == [] and absent == [], (r["rank"], unrequested, absent)
    s = summaries[family]
    assert s["committed"] and s["padded_vocab_size"] == 256 and not s["skipped"], s
    assert (base / family / "ckpt" / "common.pt").is_file() and (base / family / "ckpt" / "metadata.json").is_file()
    hf = torch.load(base / family / "hf_logits.pt")
    mg = torch.load(base / family / "megatron_logits.pt")
    assert hf.shape == mg.shape
    rel = ((hf - mg).abs().max() / mg.abs().max()).item()
    assert rel <= MAX_REL_DIFF, (family, rel)


@pytest.mark.parametrize("family", FAMILIES)
def test_to_hf_of_the_result_gives_the_input_back_bitwise(converted, family, tmp_path):
    base, summaries = converted
    s = summaries[family]
    assert s["committed"] and s["padded_vocab_size"] == 256 and not s["skipped"], s
    hf_dir = base / family / "hf"
    out = tmp_path / "back"
    # The stored args alone are checked against config.json: every row passes.
    summary = shardwise.to_hf(str(base / family / "ckpt"), str(out), hf_config=str(hf_dir / "config.json"))
    assert summary["args_check"] == "passed" and not summary["args_unchecked"], summary
    want, got = _hf_tensors(hf_dir), _hf_tensors(out)
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(_bits(got[k]), _bits(t)), k


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_folder_round_trips_bitwise_in_bf16(converted, family, tmp_path):
    """HF -> Megatron -> HF in bfloat16, ``--dtype`` equal to the input's: every tensor comes back
    bitwise (the GDN output norm's ``w - 1`` and ``+ 1`` are exact for the folder's norms, which lie in
    [0.6, 1.6): Sterbenz)."""
    base, _ = converted
    hf = base / family / "hf"
    config = json.loads((hf / "config.json").read_text())
    tensors = {k: v.to(torch.bfloat16) for k, v in _hf_tensors(hf).items()}
    folder = _folder(tmp_path / "hf", {**config, "torch_dtype": "bfloat16"}, tensors)
    fam = hf_families.FAMILIES[family]
    s = shardwise.from_hf(str(folder), str(tmp_path / "ckpt"), dtype="bf16", transformer_impl=fam.transformer_impl,
                          tensor_model_parallel_size=2)
    assert s["committed"], s
    shardwise.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), hf_config=str(folder / "config.json"), dtype="bf16")
    got = _hf_tensors(tmp_path / "back")
    assert sorted(got) == sorted(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == torch.bfloat16 and got[k].shape == t.shape and torch.equal(_bits(got[k]), _bits(t)), k


# The MTP layer count: transformers' models build no MTP layers, so these folders hold none and the
# checkpoint none (the config.json written from the args says so, 0); MTP folders are tested below.
MTP_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


def _effective(config, field):
    """``config``'s value of ``field`` as its model reads it: ``head_dim`` None is
    ``hidden_size // num_attention_heads`` (transformers' qwen2 attention), ``indexer_types`` None is
    every layer ``full`` (transformers' deepseek_v32 runs every layer's indexer)."""
    v = getattr(config, field, None)
    if v is None and field == "head_dim":
        return config.hidden_size // config.num_attention_heads
    if v is None and field == "indexer_types":
        return ["full"] * config.num_hidden_layers
    return v


@pytest.mark.parametrize("family", FAMILIES)
def test_to_hf_arch_of_the_result_writes_the_original_config(converted, family, tmp_path):
    """Without --hf-config, a config.json built from the args from-hf stored equals the original on
    every field the model reads (router top-k and normalisation, RoPE base, grouped routing, ...)."""
    import transformers

    base, _ = converted
    hf_dir = base / family / "hf"
    want = transformers.AutoConfig.from_pretrained(str(hf_dir))
    out = tmp_path / "back"
    summary = shardwise.to_hf(str(base / family / "ckpt"), str(out), arch=want.model_type)
    assert summary["config_written"], summary
    written = transformers.AutoConfig.from_pretrained(str(out))
    assert type(written) is type(want)
    fields = hf_families.model_fields(want) - set(MTP_FIELDS)
    assert len(fields) >= 10, fields
    diff = {f: (_effective(written, f), _effective(want, f)) for f in sorted(fields)
            if _effective(written, f) != _effective(want, f)}
    assert not diff, diff
    assert not any(getattr(written, f, None) for f in MTP_FIELDS)


def _args_without(ckpt: Path, out: Path, field: str) -> Path:
    """A copy of the checkpoint ``ckpt`` whose stored args lack ``field``."""
    import argparse
    import shutil

    shutil.copytree(ckpt, out)
    common = torch.load(out / "common.pt", weights_only=False)  # written by from-hf in this test run
    assert isinstance(common["args"], argparse.Namespace) and hasattr(common["args"], field)
    delattr(common["args"], field)
    torch.save(common, out / "common.pt")
    return out


@pytest.mark.parametrize("field,config_field", [("rotary_base", "rope_theta"),
                                                ("moe_router_topk", "num_experts_per_tok")])
def test_to_hf_arch_refuses_args_that_do_not_say_a_config_field(converted, tmp_path, field, config_field):
    """A config built from args without the field would hold transformers' default (another model):
    to-hf --arch refuses, naming the args field and the config field, and writes nothing."""
    base, _ = converted
    ckpt = _args_without(base / "qwen3_moe" / "ckpt", tmp_path / "ckpt", field)
    out = tmp_path / "out"
    with pytest.raises(shardwise.InvalidArgumentError, match=rf"args do not say {field} \({config_field}\).*pass --hf-config"):
        shardwise.to_hf(str(ckpt), str(out), arch="qwen3_moe")
    assert not out.exists() or not any(out.iterdir())
    # With the config given, nothing is taken from the args' missing field.
    s = shardwise.to_hf(str(ckpt), str(out), hf_config=str(base / "qwen3_moe" / "hf" / "config.json"))
    assert s["args_check"] == "passed", s


# Every field Megatron-LM's ``load_args_from_checkpoint`` copies from a checkpoint's args
# (megatron/training/checkpointing.py at core_r0.19.0, f8837c04: its ``_set_arg`` calls, in order; the
# tokenizer's two only with --use-tokenizer-model-from-checkpoint-args, the parallel sizes only with
# --use-mp-args-from-checkpoint-args). megatron-core on PyPI ships no megatron/training to import.
LOAD_ARGS_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent",
    "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
    "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization", "apply_query_key_layer_scaling",
    "attention_dropout", "hidden_dropout", "mtp_hybrid_override_pattern", "mtp_num_layers", "mtp_use_repeated_layer",
    "spec", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_token_dispatcher_type",
    "moe_router_pre_softmax", "moe_grouped_gemm", "moe_single_grouped_weight", "moe_single_grouped_bias",
    "moe_shared_expert_intermediate_size", "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
    "hybrid_layer_pattern", "heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json",
    "moe_latent_size", "tokenizer_model", "tokenizer_type", "tiktoken_pattern", "padded_vocab_size", "ckpt_format",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "expert_model_parallel_size",
)


def test_args_hold_every_field_megatron_lm_loads(converted):
    """Every family's args hold each field ``load_args_from_checkpoint`` copies, and an MoE model's
    router as its HF config says (top-k, scoring, renormalisation, expert bias, grouped routing)."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    base, _ = converted
    for family in FAMILIES:
        args = load_common_state_dict(str(base / family / "ckpt"))["args"]
        missing = [f for f in LOAD_ARGS_FIELDS if not hasattr(args, f)]
        assert not missing, (family, missing)
        cfg = json.loads((base / family / "hf" / "config.json").read_text())
        cfg = {**cfg, **cfg.get("rope_parameters", {})}
        assert args.rotary_base == cfg["rope_theta"] and args.rotary_percent == cfg.get("partial_rotary_factor", 1.0)
        if not args.num_experts:
            continue
        sigmoid = "deepseek" in family or "glm" in family or family == "minimax_m2"
        assert args.moe_router_topk == cfg["num_experts_per_tok"], family
        assert args.moe_router_score_function == ("sigmoid" if sigmoid else "softmax"), family
        assert args.moe_router_enable_expert_bias == sigmoid, family
        assert args.moe_router_pre_softmax == (not sigmoid and not cfg.get("norm_topk_prob", True)), family
        assert args.moe_router_topk_scaling_factor == cfg.get("routed_scaling_factor"), family
        assert getattr(args, "moe_router_num_groups", None) == cfg.get("n_group"), family


def test_common_state_is_megatrons(converted):
    """common.pt loads with megatron-core's own loader (weights_only, its safe globals): args with the
    model fields, checkpoint_version 3.0, the iteration."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    base, _ = converted
    common = load_common_state_dict(str(base / "qwen3_moe" / "ckpt"))
    args = common["args"]
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    assert (args.num_layers, args.hidden_size, args.padded_vocab_size, args.tensor_model_parallel_size) == (2, 64, 256, 2)
    assert (args.num_experts, args.moe_ffn_hidden_size, args.moe_layer_freq) == (4, 32, 1)
    assert args.no_save_optim and args.no_save_rng and args.transformer_impl == "local"


# --- quantized inputs ------------------------------------------------------------------------------


def _llama_fp32(tmp_path, hidden=144, ffn=272):
    """A llama whose weights have partial 128 x 128 blocks at their edges (144 = 128 + 16, ...)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=250, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    hf_families.random_hf_model(cfg, str(tmp_path / "bf"))
    return cfg, _hf_tensors(tmp_path / "bf")


def _fp8_reference(w: torch.Tensor):
    """The test's own block-FP8 recipe: DeepGEMM's per_block_cast_to_fp8 (amax per 128 x 128 block,
    clamped at 1e-4; scale_inv = amax / 448), and its dequantization (f32 product, then the dtype)."""
    m, n = w.shape
    pad = torch.zeros((m + 127) // 128 * 128, (n + 127) // 128 * 128, dtype=w.dtype)
    pad[:m, :n] = w
    v = pad.view(-1, 128, pad.size(1) // 128, 128)
    amax = v.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    q = (v * (448.0 / amax)).to(torch.float8_e4m3fn).view_as(pad)[:m, :n].contiguous()
    s = (amax / 448.0).view(v.size(0), v.size(2))
    return q, s


def _fp8_dequantize(q, s, dtype):
    m, n = q.shape
    full = s.repeat_interleave(128, 0)[:m].repeat_interleave(128, 1)[:, :n]
    return (q.float() * full).to(dtype)


@pytest.mark.parametrize("dtype,scale_dtype", [("bf16", torch.float32), ("fp32", torch.bfloat16)])
def test_block_fp8_input_is_dequantized_bitwise(tmp_path, dtype, scale_dtype):
    cfg, tensors = _llama_fp32(tmp_path)
    tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    quantized, expected = {}, {}
    for k, t in tensors.items():
        if k.endswith("proj.weight"):
            q, s = _fp8_reference(t.to(torch.bfloat16))
            s = s.to(scale_dtype)
            quantized[k], quantized[k.replace(".weight", ".weight_scale_inv")] = q, s
            expected[k] = _fp8_dequantize(q, s.float(), tdtype)
        else:
            quantized[k] = t.to(torch.bfloat16)
            expected[k] = t.to(torch.bfloat16).to(tdtype)
    hf = tmp_path / "fp8"
    hf.mkdir()
    save_file(quantized, str(hf / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "bf" / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    (hf / "config.json").write_text(json.dumps(config))
    s = shardwise.from_hf(str(hf), str(tmp_path / "ckpt"), dtype=dtype, transformer_impl="local")
    assert s["dequantized"] == 14 and s["committed"], s
    shardwise.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), hf_config=str(tmp_path / "bf" / "config.json"))
    got = _hf_tensors(tmp_path / "back")
    assert sorted(got) == sorted(expected)
    for k, t in expected.items():
        assert got[k].dtype == tdtype and torch.equal(_bits(got[k]), _bits(t)), k


def test_mxfp4_gpt_oss_input_is_dequantized_bitwise(tmp_path):
    """gpt-oss's experts as MXFP4 blocks and e8m0 scales (random codes, scales around 2^0): what
    from-hf writes is transformers' own dequantization (``convert_moe_packed_tensors``), bitwise."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    fam = hf_families.FAMILIES["gpt_oss"]
    cfg = fam.hf_config()
    hf_families.random_hf_model(cfg, str(tmp_path / "bf"))
    tensors = _hf_tensors(tmp_path / "bf")
    g = torch.Generator().manual_seed(5)
    quantized, expected = {}, {}
    for k, t in tensors.items():
        if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            e, cols, rows = t.shape  # transformers' parameter [E, in, out]; blocks are [E, out, in/32, 16]
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(118, 136, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
            quantized[k + "_blocks"], quantized[k + "_scales"] = blocks, scales
            expected[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        else:
            quantized[k] = expected[k] = t.to(torch.bfloat16)
    hf = tmp_path / "mx"
    hf.mkdir()
    save_file(quantized, str(hf / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "bf" / "config.json").read_text())
    config["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"],
                                     "quant_method": "mxfp4"}
    (hf / "config.json").write_text(json.dumps(config))
    s = shardwise.from_hf(str(hf), str(tmp_path / "ckpt"), dtype="bf16", transformer_impl="local")
    assert s["dequantized"] == 2 * cfg.num_hidden_layers and s["committed"], s
    shardwise.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), hf_config=str(tmp_path / "bf" / "config.json"))
    got = _hf_tensors(tmp_path / "back")
    assert sorted(got) == sorted(expected)
    for k, t in expected.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(_bits(got[k]), _bits(t)), k


# --- bad inputs --------------------------------------------------------------------------------------


def _llama_folder(tmp_path):
    cfg, tensors = _llama_fp32(tmp_path, hidden=64, ffn=128)
    return json.loads((tmp_path / "bf" / "config.json").read_text()), tensors


def _folder(hf: Path, config: dict, tensors: dict) -> Path:
    """An HF folder: ``tensors`` in model.safetensors and ``config`` as config.json."""
    hf.mkdir(exist_ok=True)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps(config))
    return hf


def _bad(tmp_path, config, tensors, message):
    hf, ckpt = _folder(tmp_path / "bad", config, tensors), tmp_path / "ckpt"
    with pytest.raises(shardwise.ValidationError, match=message):
        shardwise.from_hf(str(hf), str(ckpt), transformer_impl="local")
    assert not ckpt.exists() or not any(ckpt.iterdir()), list(ckpt.iterdir())


def test_more_layers_in_the_config_than_in_the_weights_is_refused(tmp_path):
    config, tensors = _llama_folder(tmp_path)
    _bad(tmp_path, {**config, "num_hidden_layers": 3}, tensors, r"not in the folder: model\.layers\.2\.")


def test_a_missing_tensor_is_refused_by_name(tmp_path):
    config, tensors = _llama_folder(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    _bad(tmp_path, config, tensors, r"not in the folder: model\.layers\.1\.mlp\.up_proj\.weight")


def test_an_unknown_tensor_is_refused_by_name(tmp_path):
    config, tensors = _llama_folder(tmp_path)
    tensors["model.layers.0.self_attn.rotary_mystery"] = torch.zeros(3)
    _bad(tmp_path, config, tensors, r"no rule reads these HF tensors .*model\.layers\.0\.self_attn\.rotary_mystery")


def test_a_wrong_shape_is_refused_by_name(tmp_path):
    config, tensors = _llama_folder(tmp_path)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 120)
    _bad(tmp_path, config, tensors, r"model\.layers\.0\.mlp\.down_proj\.weight: .*intermediate_size = 128")


def test_a_non_empty_output_folder_is_refused(tmp_path):
    config, tensors = _llama_folder(tmp_path)
    hf = _folder(tmp_path / "ok", config, tensors)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("mine")
    with pytest.raises(shardwise.InvalidArgumentError, match="not empty"):
        shardwise.from_hf(str(hf), str(ckpt), transformer_impl="local")
    assert sorted(p.name for p in ckpt.iterdir()) == ["notes.txt"]
    # --overwrite replaces a committed checkpoint; the second conversion commits again.
    (ckpt / "notes.txt").unlink()
    assert shardwise.from_hf(str(hf), str(ckpt), transformer_impl="local")["committed"]
    with pytest.raises(shardwise.InvalidArgumentError, match="not empty"):
        shardwise.from_hf(str(hf), str(ckpt), transformer_impl="local")
    assert shardwise.from_hf(str(hf), str(ckpt), transformer_impl="local", overwrite=True)["committed"]


@pytest.mark.parametrize("family,field,mtp_names", [
    # DeepSeek-V3's release layout: the MTP layer is layer num_hidden_layers (3 here).
    ("deepseek_v3", "num_nextn_predict_layers",
     {"model.layers.3.enorm.weight": "model.layers.2.input_layernorm.weight",
      "model.layers.3.hnorm.weight": "model.layers.2.input_layernorm.weight",
      "model.layers.3.self_attn.o_proj.weight": "model.layers.2.self_attn.o_proj.weight"}),
    # Qwen3.5's: one `mtp.` module.
    ("qwen3_5_moe", "mtp_num_hidden_layers",
     {"mtp.fc.weight": "model.layers.0.mlp.gate.weight",
      "mtp.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight"}),
    # A family without an MTP layout.
    ("llama", None, {"mtp.fc.weight": "model.layers.0.mlp.up_proj.weight"}),
])
def test_a_folder_with_mtp_layers_is_never_converted_without_them(converted, tmp_path, family, field, mtp_names):
    """A folder holding MTP tensors converts them all or fails before writing anything, even with
    --allow-unmapped (which would leave a checkpoint that silently lost them): here the MTP layer is
    incomplete, or config.json declares none, or the family has no MTP layout. --drop-mtp converts
    without them, and says so."""
    base, _ = converted
    hf = base / family / "hf"
    tensors = _hf_tensors(hf)
    tensors.update({k: tensors[v].clone() for k, v in mtp_names.items()})
    config = json.loads((hf / "config.json").read_text())
    ckpt = tmp_path / "ckpt"
    first = sorted(mtp_names)[0]
    if field is None:
        cases = [(config, rf"holds {len(mtp_names)} tensors of MTP layers \({first}.*, but shardwise knows no HF "
                          rf"layout of MTP layers for {family}; pass --drop-mtp")]
    else:
        cases = [({**config, field: 1}, r"HF tensors the config requires are not in the folder: |the config implies"),
                 ({**config, field: 0}, rf"holds {len(mtp_names)} tensors of MTP layers \({first}.*, but config\.json's "
                                        rf"{field} says 0; pass --drop-mtp")]
    for i, (cfg, message) in enumerate(cases):
        folder = _folder(tmp_path / f"mtp{i}", cfg, tensors)
        with pytest.raises(shardwise.ValidationError, match=message):
            _from_hf(family, folder, ckpt, allow_unmapped=True)
        assert not ckpt.exists() or not any(ckpt.iterdir())
    s = _from_hf(family, folder, ckpt, drop_mtp=True)
    assert s["committed"] and s["mtp_layers"] == 0 and s["dropped_mtp"] == len(mtp_names), s
    assert any(w.startswith(f"--drop-mtp: the folder holds {len(mtp_names)} tensors of MTP layers") for w in s["warnings"]), s


def test_a_config_declaring_mtp_layers_the_folder_lacks_converts_with_a_warning(converted):
    """transformers' save_pretrained leaves MTP layers out (its models ignore them): a folder whose
    config.json declares one but holds none converts without, and the summary says so."""
    _, summaries = converted
    cfg = hf_families.FAMILIES["deepseek_v3"].hf_config()
    assert cfg.num_nextn_predict_layers == 1
    s = summaries["deepseek_v3"]
    assert s["mtp_layers"] == 0 and s["warnings"] == [
        "config.json's num_nextn_predict_layers says 1, but the folder holds no MTP tensors (transformers' "
        "save_pretrained leaves them out): the checkpoint has no MTP layers (args.mtp_num_layers None)"], s


# --- parallel and split conversions ------------------------------------------------------------------


def _files(ckpt: Path) -> dict:
    names = [p for p in ckpt.iterdir() if p.is_file()]
    return {p.name: p.read_bytes() for p in names}


def test_workers_and_parts_write_the_same_bytes_and_the_tracker(tmp_path):
    config, tensors = _llama_folder(tmp_path)
    hf = _folder(tmp_path / "hf", config, tensors)
    kw = dict(transformer_impl="local", max_file_size="20KB", iteration=7)
    one = shardwise.from_hf(str(hf), str(tmp_path / "a" / "iter_0000007"), workers=1, tracker=True, **kw)
    assert one["files"] >= 4 and one["committed"], one
    assert (tmp_path / "a" / "latest_checkpointed_iteration.txt").read_text() == "7"
    # More workers than files: the saves of one process queue behind one writer (16 workers on
    # one pool once deadlocked on the save ticket).
    shardwise.from_hf(str(hf), str(tmp_path / "b"), workers=16, **kw)
    parts = [shardwise.from_hf(str(hf), str(tmp_path / "c"), workers=1, part=f"{i}/3", **kw) for i in (2, 0, 1)]
    assert [p["committed"] for p in parts] == [False, False, True]
    want = _files(tmp_path / "a" / "iter_0000007")
    assert {".metadata", "common.pt", "metadata.json"} <= set(want)
    for other in ("b", "c"):
        got = _files(tmp_path / other)
        assert sorted(got) == sorted(want), other
        for name, data in want.items():
            assert got[name] == data, (other, name)
    # The tracker needs the folder name Megatron-LM looks for.
    with pytest.raises(shardwise.InvalidArgumentError, match="iter_0000007"):
        shardwise.from_hf(str(hf), str(tmp_path / "d" / "weights"), tracker=True, **kw)


def test_cli_from_hf(tmp_path):
    config, tensors = _llama_folder(tmp_path)
    hf = _folder(tmp_path / "hf", config, tensors)
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "from-hf", str(hf), str(tmp_path / "release"),
                        "--transformer-impl", "local", "--tracker", "--workers", "2", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["committed"] and out["keys"] == 9, out  # 3 model keys, 6 stacked layer keys
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "from-hf", str(hf), str(tmp_path / "release")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "not empty" in r.stderr


STOP_WITHIN_S = 1.0


def test_ctrl_c_commits_nothing_and_a_rerun_completes(tmp_path):
    """A real SIGINT to a running ``shardwise from-hf`` (the CLI; data files already written, the
    next ones' tensors being converted): it exits non-zero within a second with nothing committed
    (no .metadata, metadata.json or common.pt), and the same command run again into that folder
    completes and commits."""
    import signal
    import time

    import transformers

    # About 400 MB of bf16 weights, written as fp32 in 16 MB data files: seconds of work.
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
                                   num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    tensors = {"model.embed_tokens.weight": torch.zeros(256, 1024), "lm_head.weight": torch.zeros(256, 1024),
               "model.norm.weight": torch.ones(1024)}
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        for n, shape in [("self_attn.q_proj.weight", (1024, 1024)), ("self_attn.k_proj.weight", (1024, 1024)),
                         ("self_attn.v_proj.weight", (1024, 1024)), ("self_attn.o_proj.weight", (1024, 1024)),
                         ("mlp.gate_proj.weight", (4096, 1024)), ("mlp.up_proj.weight", (4096, 1024)),
                         ("mlp.down_proj.weight", (1024, 4096)), ("input_layernorm.weight", (1024,)),
                         ("post_attention_layernorm.weight", (1024,))]:
            tensors[p + n] = torch.full(shape, float(l), dtype=torch.bfloat16)
    hf = _folder(tmp_path / "hf", cfg.to_dict(), {k: t.to(torch.bfloat16) for k, t in tensors.items()})
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "shardwise.cli", "from-hf", str(hf), str(ckpt), "--transformer-impl", "local",
           "--dtype", "fp32", "--workers", "1", "--max-file-size", "16MB"]
    # SIGINT as a terminal gives it, whatever this test run inherited (background jobs ignore it).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not list(ckpt.glob("*.distcp")):  # data files are being written
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    stopped_s = time.monotonic() - sent
    assert proc.returncode != 0, "the conversion finished before the interrupt: make the folder larger"
    # The workers converting the next data file's tensors stop at their next tensor (the main
    # thread polls for the signal every 20 ms); at most the data file being written is finished.
    assert stopped_s < STOP_WITHIN_S, stopped_s
    assert "interrupted" in err, err
    for name in (".metadata", "metadata.json", "common.pt"):
        assert not (ckpt / name).exists(), name
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (ckpt / ".metadata").is_file() and (ckpt / "common.pt").is_file()
