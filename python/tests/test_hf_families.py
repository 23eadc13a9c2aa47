"""`shardwise to-hf` for the hybrid Gated-DeltaNet families, qwen3_next, qwen3_5_moe and qwen3_5, for
deepseek_v3 (MLA), glm4_moe, gpt_oss, deepseek_v32 (DeepSeek sparse attention), minimax_m2, qwen2 and
mixtral (``hf_families_moe``), and for HybridModel checkpoints (``hf_families_hybrid``: a dense qwen3
``*-*-*-`` and a glm_moe_dsa ``D-DEDE``): a real megatron-core 0.19.2 model of each, built on CPU,
saved at TP=1 and at TP=2 (x EP=2 for MoE) by Megatron's own torch_dist and by shardwise, is
converted; transformers loads the output with no missing, unexpected or mismatched keys, its tensor
names, dtypes and shapes are those of transformers' own ``save_pretrained``, and its logits equal
Megatron's. Each config field the mapping checks against the stored args is refused when wrong, named.
``shardwise.megatron.load`` fills the resharded model from the TP=1 checkpoints (and a HybridModel from
a GPTModel's checkpoint through megatron-core's own key translation) with the same logits.

One 2-process run per family, on first use; the families of each of ``GROUPS`` share one run.

from-hf of each family's export, and to-hf of that, give back the Megatron checkpoint and the HF
folder bitwise (MTP layers and a multimodal folder's vision tower included)."""

from __future__ import annotations

import json

import pytest
import torch

import hf_families
import shardwise
from mcore import spawn

FAMILIES = ["qwen3_next", "qwen3_5_moe", "qwen3_5", "deepseek_v3", "glm4_moe", "gpt_oss", *hf_families.GROUP]
HYBRID = ["hybrid_qwen3", "hybrid_glm_moe_dsa"]
LOADED = [f for f in FAMILIES if hf_families.FAMILIES[f].load_check]
# Multimodal configs whose text model converts: (family run, transformers config class).
MULTIMODAL = [("qwen3_5_moe", "Qwen3_5MoeConfig"), ("qwen3_5", "Qwen3_5Config")]
# Families whose HF layout keeps the MTP layer as decoder layer num_hidden_layers (DeepSeek-V3's).
MTP_AS_DECODER_LAYER = ("deepseek_v3", "glm4_moe", "deepseek_v32", "hybrid_glm_moe_dsa")
# max |HF - Megatron| / max |Megatron| over the logits of the fixed tokens.
MAX_REL_DIFF = 1e-4
# Families saved in one 2-process run each: hf_families.GROUP, and the dense/MoE families test_hf.py
# converts (only the round trip below saves them here).
GROUPS = [hf_families.GROUP, ("llama", "qwen3", "qwen3_moe")]


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """family -> (folder, reference): the folder holds every layout x writer checkpoint, the logits and
    the HF config; reference: the tensors transformers' ``save_pretrained`` writes for that config.
    One 2-process run per family, on first use."""
    done = {}

    def get(family):
        if family not in done:
            group = next((g for g in GROUPS if family in g), None)
            if group is not None:
                base = tmp_path_factory.mktemp("group")
                results = spawn(hf_families.save_and_forward_group, 2, str(base / "out"), str(base),
                                list(group), timeout_s=1800)
                bases = {f: base / f for f in group}
            else:
                base = tmp_path_factory.mktemp(family)
                results = spawn(hf_families.save_and_forward, 2, str(base / "out"), str(base), family, timeout_s=600)
                bases = {family: base}
            failed = [r for r in results if not r.get("ok")]
            assert not failed, "\n".join(f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}"
                                          for r in failed)
            for f, b in bases.items():
                done[f] = b, hf_families.hf_reference_tensors(str(b / "hf_config"), str(b / "save_pretrained"))
        return done[family]

    return get


def _expected(family, reference, config):
    """What the conversion writes: ``reference`` (save_pretrained's names), plus the family's MTP
    tensors in its official layout when the config declares them."""
    cfg = json.loads(open(config).read())
    cfg = {**cfg, **cfg.get("text_config", {})}
    if not (cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers")):
        return reference
    return {**reference, **hf_families.mtp_expected_tensors(family, reference, cfg["num_hidden_layers"])}


def _convert_and_compare(base, reference, ckpt, config, out, family=None, **kw):
    summary = shardwise.to_hf(str(ckpt), str(out), hf_config=str(config), max_shard_size="100KB", **kw)
    assert summary["files"] > 1, summary
    assert summary["args_check"] == "passed" and not summary["args_unchecked"], summary
    assert not summary["warnings"], summary
    if family is not None:
        assert hf_families.safetensors_tensors(str(out)) == _expected(family, reference, config)
    logits, info = hf_families.hf_load_and_logits(str(out))
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    # transformers' deepseek_v3, glm4_moe, deepseek_v32 and glm_moe_dsa ignore their MTP layer by the
    # released models' layer number (model.layers.61 / .92 / .46 / .78), so the small models' MTP
    # layer shows as unexpected: it is the only unexpected tensor allowed.
    cfg = json.loads(open(config).read())
    mtp_layer = f"model.layers.{cfg.get('text_config', cfg)['num_hidden_layers']}."
    assert all(k.startswith(mtp_layer) and family in MTP_AS_DECODER_LAYER for k in info["unexpected_keys"]), info
    # diff in HF mode rebuilds every HF tensor (value transforms included) from the checkpoint (the
    # vision tower copied from --base-hf is not the checkpoint's).
    report = shardwise.diff(str(ckpt), str(out), hf_config=str(config),
                            exclude=["model.visual.*"] if "base_hf" in kw else [])
    assert report["exit_code"] == 0 and report["different"] == 0 and report["equal"] > 0, report
    return logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", hf_families.LAYOUTS)
@pytest.mark.parametrize("writer", hf_families.WRITERS)
def test_converted_model_matches_megatron(saved, family, layout, writer, tmp_path):
    base, reference = saved(family)
    logits = _convert_and_compare(base, reference, base / layout / writer, base / "hf_config" / "config.json",
                                  tmp_path / "hf", family)
    expected = torch.load(base / layout / "logits.pt")
    assert logits.shape == expected.shape  # vocabulary padding trimmed: 256 -> 250
    rel = ((logits - expected).abs().max() / expected.abs().max()).item()
    print(f"{family} {layout} {writer}: max rel diff {rel:.2e}")
    assert rel <= MAX_REL_DIFF
    if family in hf_families.MTP_LAYOUT:
        # The MTP layer, by its published formula from the exported tensors, against Megatron's own
        # MTP forward (transformers does not run MTP layers).
        mtp = hf_families.hf_mtp_logits(str(tmp_path / "hf"), family)
        want = torch.load(base / layout / "mtp_logits.pt")[0]
        rel = ((mtp - want).abs().max() / want.abs().max()).item()
        print(f"{family} {layout} {writer}: MTP max rel diff {rel:.2e}")
        assert rel <= MAX_REL_DIFF
        if layout == "tp1":
            # Each exported MTP tensor that is its Megatron source as it is equals it exactly.
            cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
            cfg = {**cfg, **cfg.get("text_config", {})}
            t = hf_families._folder_tensors(str(tmp_path / "hf"))
            pairs = hf_families.mtp_source_pairs(family, torch.load(base / "tp1" / "mtp_sources.pt"),
                                                 cfg["num_hidden_layers"], cfg["vocab_size"], t)
            assert len(pairs) >= 7, [k for k, _, _ in pairs]
            for key, name, v in pairs:
                assert torch.equal(t[name], v), (key, name)


def _multimodal(base, tmp_path):
    """The multimodal config of the qwen3_5_moe family's text model (model_type qwen3_5_moe, the text
    model in text_config, a small vision tower), and an original release of it (``save_pretrained``
    of a randomly initialised ``Qwen3_5MoeForConditionalGeneration``: the vision tower to copy)."""
    import transformers

    text = json.loads((base / "hf_config" / "config.json").read_text())
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, tie_word_embeddings=False,
                                        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                                           out_hidden_size=text["hidden_size"]))
    cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    torch.manual_seed(3)
    transformers.Qwen3_5MoeForConditionalGeneration(cfg).save_pretrained(tmp_path / "release")
    return tmp_path / "release" / "config.json", tmp_path / "release"


def test_multimodal_qwen3_5_config_loads_with_its_declared_architecture(saved, tmp_path):
    """Qwen3.5's published config.json is the multimodal one (model_type qwen3_5_moe, architecture
    Qwen3_5MoeForConditionalGeneration). With --base-hf the folder holds what save_pretrained of that
    model writes: the text model as model.language_model.*, the vision tower copied byte for byte,
    the MTP layer as mtp.*; the declared class loads it with nothing missing and Megatron's logits.
    Without --base-hf the conversion is refused (--text-only: the next test)."""
    base, reference = saved("qwen3_5_moe")
    config, release = _multimodal(base, tmp_path)
    ckpt = base / "resharded" / "shardwise"
    with pytest.raises(shardwise.InvalidArgumentError,
                       match=r"declares Qwen3_5MoeForConditionalGeneration, a multimodal model whose vision tower "
                             r"\(model\.visual\.\*\) .* pass --base-hf DIR .* or --text-only"):
        shardwise.to_hf(str(ckpt), str(tmp_path / "refused"), hf_config=str(config))
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "hf"
    logits = _convert_and_compare(base, reference, ckpt, config, out, base_hf=str(release))
    torch.testing.assert_close(logits, torch.load(base / "resharded" / "logits.pt"), rtol=1e-4, atol=1e-5)
    want = hf_families.safetensors_tensors(str(release))
    got = hf_families.safetensors_tensors(str(out))
    assert got == {k: v for k, v in want.items()} | hf_families.mtp_expected_tensors(
        "qwen3_5_moe", reference, json.loads(config.read_text())["text_config"]["num_hidden_layers"])
    visual = [k for k in want if k.startswith("model.visual.")]
    assert visual
    orig, conv = hf_families._folder_tensors(str(release)), hf_families._folder_tensors(str(out))
    assert all(torch.equal(orig[k], conv[k]) for k in visual)
    # The MTP layer of the multimodal layout, by the formula, against Megatron's.
    mtp = hf_families.hf_mtp_logits(str(out), "qwen3_5_moe")
    torch.testing.assert_close(mtp, torch.load(base / "resharded" / "mtp_logits.pt")[0], rtol=1e-4, atol=1e-5)
    # A vision tower that is not the config's is refused before anything is written.
    bad = json.loads(config.read_text())
    bad["vision_config"]["depth"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(shardwise.InvalidArgumentError, match=r"vision_config.depth = 3, but --base-hf .* holds 2 "
                                                              r"vision blocks \(model.visual.blocks.\*\)"):
        shardwise.to_hf(str(ckpt), str(tmp_path / "bad"), hf_config=str(tmp_path / "bad.json"), base_hf=str(release))
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("family", ["deepseek_v32", "hybrid_glm_moe_dsa"])
def test_dsa_mtp_layers_take_the_names_of_their_release(saved, tmp_path, family):
    """The MTP layer of DeepSeek-V3.2 (a GPTModel's) and of GLM-5 (a HybridModel's, ``.../DE``) is
    written as its release holds it: decoder layer num_hidden_layers, a DSA layer with its own
    indexer (GLM's last decoder layer has none) and the module's tensors under the release's names,
    DeepSeek's copies of the embedding and head and no such copies for GLM. Without --drop-mtp a
    config declaring no MTP layer is refused; with it the folder is the model's alone."""
    base, reference = saved(family)
    config = base / "hf_config" / "config.json"
    out = tmp_path / "hf"
    shardwise.to_hf(str(base / "tp1" / "megatron"), str(out), hf_config=str(config))
    names = set(hf_families.safetensors_tensors(str(out)))
    L = str(json.loads(config.read_text())["num_hidden_layers"])
    mtp = {n for n in names if n.startswith(f"model.layers.{L}.")}
    decoder = {n.split(".", 3)[3] for n in names - mtp if n.startswith("model.layers.")}
    release = {n.replace("{L}", L) for n in hf_families.RELEASE_MTP_NAMES[family.removeprefix("hybrid_")]}
    assert release <= mtp, sorted(release - mtp)
    assert {n for n in mtp if n.split(".", 3)[3] not in decoder} == {n for n in release if ".indexer." not in n}
    assert f"model.layers.{L}.self_attn.indexer.wk.weight" in mtp
    assert f"model.layers.{L}.mlp.experts.0.down_proj.weight" in mtp
    if family == "hybrid_glm_moe_dsa":
        assert f"model.layers.{int(L) - 1}.self_attn.indexer.wk.weight" not in names
    with pytest.raises(shardwise.ValidationError, match=r"num_nextn_predict_layers says 0; pass --drop-mtp"):
        shardwise.to_hf(str(base / "tp1" / "megatron"), str(tmp_path / "refused"),
                        hf_config=str(_with(base, tmp_path, num_nextn_predict_layers=0)))
    summary = shardwise.to_hf(str(base / "tp1" / "megatron"), str(tmp_path / "dropped"), hf_config=str(config),
                              drop_mtp=True)
    assert summary["mtp_layers"] == 0
    assert hf_families.safetensors_tensors(str(tmp_path / "dropped")) == reference


def test_mtp_layers_the_config_does_not_declare_are_refused_unless_dropped(saved, tmp_path):
    """A checkpoint with an MTP layer and a config that declares none is refused, naming both sides,
    before anything is written; --drop-mtp converts without it, warns, and the config.json written
    says 0 (transformers' deepseek_v3 default would say 1)."""
    base, reference = saved("deepseek_v3")
    ckpt = base / "tp1" / "shardwise"
    with pytest.raises(shardwise.ValidationError,
                       match=r"the checkpoint holds 1 MTP layer\(s\) \(mtp\.layers\.\*\), but config\.json's "
                             r"num_nextn_predict_layers says 0; pass --drop-mtp"):
        shardwise.to_hf(str(ckpt), str(tmp_path / "refused"), hf_config=str(_with(base, tmp_path,
                                                                                 num_nextn_predict_layers=0)))
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "hf"
    summary = shardwise.to_hf(str(ckpt), str(out), hf_config=str(base / "hf_config" / "config.json"), drop_mtp=True)
    assert summary["mtp_layers"] == 0 and any("--drop-mtp" in w for w in summary["warnings"]), summary
    assert hf_families.safetensors_tensors(str(out)) == reference
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    logits, info = hf_families.hf_load_and_logits(str(out))
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


@pytest.mark.parametrize("family,config_class", MULTIMODAL)
def test_multimodal_qwen3_5_config_text_only_converts_its_text_model(saved, tmp_path, family, config_class):
    """Qwen3.5's published config.json is the multimodal one (model_type qwen3_5_moe or qwen3_5, the
    text model in text_config): with --text-only the conversion reads the text model's fields there
    and writes the text model's own config (its ForCausalLM class, no vision_config) and names, which
    that class loads with Megatron's logits."""
    import transformers

    base, reference = saved(family)
    text = json.loads((base / "hf_config" / "config.json").read_text())
    cfg = getattr(transformers, config_class)(text_config=text, tie_word_embeddings=False)
    cfg.save_pretrained(tmp_path / "vl")
    assert json.loads((tmp_path / "vl" / "config.json").read_text())["model_type"] == family
    out = tmp_path / "hf"
    summary = shardwise.to_hf(str(base / "tp1" / "shardwise"), str(out), hf_config=str(tmp_path / "vl" / "config.json"),
                              text_only=True)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == f"{family}_text" and "vision_config" not in written, written
    assert written["architectures"][0].endswith("ForCausalLM") and summary["vision_tensors"] == 0, summary
    assert hf_families.safetensors_tensors(str(out)) == _expected(family, reference, base / "hf_config" / "config.json")
    logits, info = hf_families.hf_load_and_logits(str(out))
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    torch.testing.assert_close(logits, torch.load(base / "tp1" / "logits.pt"), rtol=1e-4, atol=1e-5)


def _save_tokenizer(folder, words):
    """A word-level tokenizer of ``words`` (id = position), saved as transformers saves one."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0]).save_pretrained(folder)


def test_tokenizer_is_copied_from_the_checkpoint_or_given(saved, tmp_path):
    """The checkpoint's tokenizer/ (where Megatron-LM after 0.19 saves the run's tokenizer assets) is
    copied beside the weights, its tokenizer files only, so AutoTokenizer loads the converted folder
    and encodes as the original; --tokenizer DIR is copied instead; a --tokenizer folder without a
    tokenizer is refused before anything is written."""
    import shutil

    import transformers

    base, _ = saved("deepseek_v3")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base / "tp1" / "shardwise", ckpt)
    _save_tokenizer(ckpt / "tokenizer", ["<unk>", "hello", "world", "shard", "wise"])
    (ckpt / "tokenizer" / "config.json").write_text("{}")  # not a tokenizer file: not copied
    config = base / "hf_config" / "config.json"
    out = tmp_path / "hf"
    summary = shardwise.to_hf(str(ckpt), str(out), hf_config=str(config))
    copied = sorted(p.name for p in (ckpt / "tokenizer").iterdir() if p.name != "config.json")
    assert summary["tokenizer_files"] == len(copied) >= 2, summary
    assert all((out / n).read_bytes() == (ckpt / "tokenizer" / n).read_bytes() for n in copied)
    assert (out / "config.json").read_bytes() == config.read_bytes()
    got = transformers.AutoTokenizer.from_pretrained(str(out))("hello shard world")["input_ids"]
    assert got == transformers.AutoTokenizer.from_pretrained(str(ckpt / "tokenizer"))("hello shard world")["input_ids"]
    assert got == [1, 3, 2]
    given = tmp_path / "given"
    _save_tokenizer(given, ["<unk>", "world", "hello", "shard"])
    out2 = tmp_path / "hf2"
    shardwise.to_hf(str(ckpt), str(out2), hf_config=str(config), tokenizer=str(given))
    assert transformers.AutoTokenizer.from_pretrained(str(out2))("hello shard world")["input_ids"] == [2, 3, 1]
    (tmp_path / "empty").mkdir()
    with pytest.raises(shardwise.InvalidArgumentError, match="no tokenizer file there"):
        shardwise.to_hf(str(ckpt), str(tmp_path / "hf3"), hf_config=str(config), tokenizer=str(tmp_path / "empty"))
    assert not (tmp_path / "hf3").exists()


def _with(base, tmp_path, **changes):
    cfg = json.loads((base / "hf_config" / "config.json").read_text())
    cfg.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


# (config field, bad value, message): each field of the GDN families' mapping that the checkpoint's
# args also store, set wrong in config.json (qwen3_next: 2 key heads of dim 16, 4 value heads of
# dim 8, kernel 4, full attention every 2nd layer, shared expert 48).
WRONG_FIELDS = [
    ("linear_num_key_heads", 4, "linear_num_key_heads: config.json says 4, args.linear_num_key_heads says 2"),
    ("linear_num_value_heads", 8, "linear_num_value_heads: config.json says 8, args.linear_num_value_heads says 4"),
    ("linear_key_head_dim", 8, "linear_key_head_dim: config.json says 8, args.linear_key_head_dim says 16"),
    ("linear_value_head_dim", 16, "linear_value_head_dim: config.json says 16, args.linear_value_head_dim says 8"),
    ("linear_conv_kernel_dim", 3, "linear_conv_kernel_dim: config.json says 3, args.linear_conv_kernel_dim says 4"),
    ("layer_types", ["full_attention", "linear_attention"] * 2,
     "layer_types: config.json gives FLFL, args.linear_attention_freq .* gives LFLF"),
    ("shared_expert_intermediate_size", 32,
     "shared_expert_intermediate_size: config.json says 32, args.moe_shared_expert_intermediate_size says 48"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor: config.json says 0.5, args.rotary_percent says 0.25"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
     "rope_theta: config.json says 1000000, args.rotary_base says 10000"),
]


@pytest.mark.parametrize("field,value,message", WRONG_FIELDS, ids=[m.split(":")[0] for _, _, m in WRONG_FIELDS])
def test_config_field_disagreeing_with_the_args_is_refused(saved, tmp_path, field, value, message):
    base, _ = saved("qwen3_next")
    bad = _with(base, tmp_path, **{field: value})
    for writer in hf_families.WRITERS:  # args in common.pt (shardwise), in the common_state object (Megatron 0.19)
        with pytest.raises(shardwise.ValidationError, match=message):
            shardwise.to_hf(str(base / "tp1" / writer), str(tmp_path / writer), hf_config=str(bad))
        assert not (tmp_path / writer / "model.safetensors.index.json").exists()


def test_full_attention_interval_stands_for_layer_types(saved, tmp_path):
    """A config.json with `full_attention_interval` and no `layer_types` (earlier Qwen3-Next uploads)
    means the same pattern; a wrong interval is refused."""
    base, reference = saved("qwen3_next")
    cfg = json.loads((base / "hf_config" / "config.json").read_text())
    del cfg["layer_types"]
    for interval, ok in ((2, True), (4, False)):
        path = tmp_path / f"config{interval}.json"
        path.write_text(json.dumps({**cfg, "full_attention_interval": interval}))
        out = tmp_path / f"hf{interval}"
        if ok:
            shardwise.to_hf(str(base / "tp1" / "shardwise"), str(out), hf_config=str(path))
            assert hf_families.safetensors_tensors(str(out)) == reference
        else:
            with pytest.raises(shardwise.ValidationError, match="layer_types: config.json gives LLLF"):
                shardwise.to_hf(str(base / "tp1" / "shardwise"), str(out), hf_config=str(path))


def test_args_flags_the_architecture_implies_are_checked(saved, tmp_path):
    """Gated attention, zero-centred norms and the shared expert's gate are what transformers'
    qwen3_next computes; a checkpoint whose args say otherwise is refused, each flag named."""
    base, _ = saved("qwen3_next")
    with pytest.raises(shardwise.ValidationError) as e:
        shardwise.to_hf(str(base / "tp1" / "bad_args"), str(tmp_path / "o"),
                        hf_config=str(base / "hf_config" / "config.json"))
    for flag in ("args.attention_output_gate says false", "args.apply_layernorm_1p says false",
                 "args.moe_shared_expert_gate says false"):
        assert flag in str(e.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_args_alone_give_a_self_contained_folder(saved, tmp_path, family):
    """Without config.json, the sizes and the layer patterns (GDN, MoE, DSA indexer, hybrid numbering)
    come from the stored args (Megatron 0.19's common_state here): the same tensors as with the config
    (the padding beyond args.vocab_size trimmed), and a config.json built from the args that equals the
    config the test model was built from on every field the model reads, declares the weights' dtype
    and the text model's class, and loads: transformers' logits equal Megatron's. The tokenizer given
    (with its generation_config.json) is copied, and AutoTokenizer loads the folder."""
    import shutil

    import transformers

    base, reference = saved(family)
    given = base / "hf_config" / "config.json"
    arch = json.loads(given.read_text())["model_type"]
    out = tmp_path / "hf"
    tok = tmp_path / "tok"
    _save_tokenizer(tok, ["<unk>", "hello", "world"])
    transformers.GenerationConfig(max_new_tokens=7).save_pretrained(tok)
    summary = shardwise.to_hf(str(base / "resharded" / "megatron"), str(out), arch=arch, tokenizer=str(tok))
    assert summary["args_check"] == "passed" and summary["config_written"], summary
    assert hf_families.safetensors_tensors(str(out)) == _expected(family, reference, given)
    written = transformers.AutoConfig.from_pretrained(str(out))
    want = transformers.AutoConfig.from_pretrained(str(given.parent))
    assert type(written) is type(want)
    fields = hf_families.model_fields(want)
    assert len(fields) >= 10, fields
    diff = {f: (getattr(written, f, None), getattr(want, f, None)) for f in sorted(fields)
            if getattr(written, f, None) != getattr(want, f, None)}
    assert not diff, diff
    raw = json.loads((out / "config.json").read_text())
    mtp_field = "num_nextn_predict_layers" if family in MTP_AS_DECODER_LAYER else "mtp_num_hidden_layers"
    assert raw.get(mtp_field) == getattr(want, mtp_field, None), raw
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert raw["dtype"] == "float32" and raw["architectures"] == [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[want.model_type]]
    logits, info = hf_families.hf_load_and_logits(str(out))
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    expected = torch.load(base / "resharded" / "logits.pt")
    assert ((logits - expected).abs().max() / expected.abs().max()).item() <= MAX_REL_DIFF
    assert all((out / f.name).read_bytes() == f.read_bytes() for f in tok.iterdir())
    # transformers picks the tokenizer class by the config's model_type (Qwen2Tokenizer, which
    # rebuilds a BPE model from the files, for the Qwen families): the folder encodes as the given
    # tokenizer does beside the same config.json.
    shutil.copy(out / "config.json", tok / "config.json")
    ids = transformers.AutoTokenizer.from_pretrained(str(out))("hello world")["input_ids"]
    assert ids == transformers.AutoTokenizer.from_pretrained(str(tok))("hello world")["input_ids"]
    assert transformers.GenerationConfig.from_pretrained(str(out)).max_new_tokens == 7


# (family, config field, bad value, message): each field of the deepseek_v3 / glm4_moe / gpt_oss
# mappings that the checkpoint's args also store, set wrong in config.json (hf_families_moe's sizes).
MOE_WRONG_FIELDS = [
    ("deepseek_v3", "q_lora_rank", 24, "q_lora_rank: config.json says 24, args.q_lora_rank says 32"),
    ("deepseek_v3", "kv_lora_rank", 8, "kv_lora_rank: config.json says 8, args.kv_lora_rank says 16"),
    ("deepseek_v3", "qk_nope_head_dim", 8, "qk_nope_head_dim: config.json says 8, args.qk_head_dim says 16"),
    ("deepseek_v3", "qk_rope_head_dim", 16, "qk_rope_head_dim: config.json says 16, args.qk_pos_emb_head_dim says 8"),
    ("deepseek_v3", "v_head_dim", 16, "v_head_dim: config.json says 16, args.v_head_dim says 12"),
    ("deepseek_v3", "n_shared_experts", 1,
     "n_shared_experts: config.json says 1, args.moe_shared_expert_intermediate_size says 64 = 2 x moe_ffn_hidden_size 32"),
    ("deepseek_v3", "first_k_dense_replace", 2, "MoE layer pattern .*: config.json gives --E .*first_k_dense_replace 2"),
    ("deepseek_v3", "n_routed_experts", 16, "num_experts: config.json says 16, args.num_experts says 8"),
    ("deepseek_v3", "moe_intermediate_size", 16, "moe_intermediate_size: config.json says 16, args.moe_ffn_hidden_size"),
    ("deepseek_v3", "intermediate_size", 128, "intermediate_size: config.json says 128, args.ffn_hidden_size says 96"),
    ("glm4_moe", "first_k_dense_replace", 0, "MoE layer pattern .*: config.json gives EEE"),
    ("glm4_moe", "n_shared_experts", 2, "n_shared_experts: config.json says 2, args.moe_shared_expert_intermediate_size says 32 = 1 x"),
    ("glm4_moe", "use_qk_norm", False, "use_qk_norm: config.json says false, args.qk_layernorm says true"),
    ("glm4_moe", "attention_bias", False, "attention_bias: config.json says false, args.add_qkv_bias says true"),
    ("glm4_moe", "head_dim", 8, "head_dim: config.json says 8, args.kv_channels says 16"),
    ("gpt_oss", "num_local_experts", 8, "num_experts: config.json says 8, args.num_experts says 4"),
    ("gpt_oss", "intermediate_size", 64, "intermediate_size: config.json says 64, args.moe_ffn_hidden_size says 32"),
    ("glm4_moe", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
     "partial_rotary_factor: config.json says 1, args.rotary_percent says 0.5"),
    ("deepseek_v3", "rope_parameters", {"rope_type": "default", "rope_theta": 50000.0},
     "rope_theta: config.json says 50000, args.rotary_base says 10000"),
    ("gpt_oss", "sliding_window", 8,
     r"sliding_window: config.json gives windows \[8, full, 8\] .* give \[4, full, 4\]"),
    ("gpt_oss", "layer_types", ["full_attention", "sliding_attention", "full_attention"],
     r"sliding_window: config.json gives windows \[full, 4, full\] .* give \[4, full, 4\]"),
    # DeepSeek sparse attention: 4 indexer heads of 16, top 4; glm_moe_dsa's layer 2 shares layer 1's top-k.
    ("deepseek_v32", "index_n_heads", 8, "index_n_heads: config.json says 8, args.dsa_indexer_n_heads says 4"),
    ("deepseek_v32", "index_head_dim", 32, "index_head_dim: config.json says 32, args.dsa_indexer_head_dim says 16"),
    ("deepseek_v32", "index_topk", 8, "index_topk: config.json says 8, args.dsa_indexer_topk says 4"),
    ("deepseek_v32", "mlp_layer_types", ["dense", "dense", "sparse"], "MoE layer pattern .*: config.json gives --E"),
    ("hybrid_glm_moe_dsa", "indexer_types", ["full", "shared", "shared"],
     r"indexer_types: config.json gives FSS, args.dsa_indexer_topk_freq \d+ and dsa_indexer_skip_topk_offset \d+ "
     r"give FFS .*Megatron counts a HybridModel's layers"),
    ("hybrid_glm_moe_dsa", "mlp_layer_types", ["dense", "dense", "sparse"],
     "MoE layer pattern .*: config.json gives --E .* args.hybrid_layer_pattern gives -EE"),
    ("hybrid_glm_moe_dsa", "q_lora_rank", 32, "q_lora_rank: config.json says 32, args.q_lora_rank says 24"),
    # A HybridModel's args count attention and MLP layers apart: 6 layers are 3 HF layers.
    ("hybrid_qwen3", "num_hidden_layers", 4, "num_hidden_layers: config.json says 4, args.num_layers says 3"),
    ("hybrid_qwen3", "intermediate_size", 128, "intermediate_size: config.json says 128, args.ffn_hidden_size says 96"),
    ("minimax_m2", "head_dim", 8, "head_dim: config.json says 8, args.kv_channels says 16"),
    ("minimax_m2", "num_key_value_heads", 4, "num_key_value_heads: config.json says 4, args.num_query_groups says 2"),
    ("minimax_m2", "num_local_experts", 8, "num_experts: config.json says 8, args.num_experts says 4"),
    ("minimax_m2", "intermediate_size", 64, "intermediate_size: config.json says 64, args.moe_ffn_hidden_size says 32"),
    ("minimax_m2", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
     "partial_rotary_factor: config.json says 1, args.rotary_percent says 0.5"),
    ("qwen2", "intermediate_size", 128, "intermediate_size: config.json says 128, args.ffn_hidden_size says 96"),
    ("qwen2", "num_key_value_heads", 4, "num_key_value_heads: config.json says 4, args.num_query_groups says 2"),
    ("mixtral", "num_local_experts", 8, "num_experts: config.json says 8, args.num_experts says 4"),
    ("mixtral", "intermediate_size", 64, "intermediate_size: config.json says 64, args.moe_ffn_hidden_size says 32"),
]


@pytest.mark.parametrize("family,field,value,message", MOE_WRONG_FIELDS,
                         ids=[f"{f}-{k}" for f, k, _, _ in MOE_WRONG_FIELDS])
def test_moe_family_field_disagreeing_with_the_args_is_refused(saved, tmp_path, family, field, value, message):
    base, _ = saved(family)
    bad = _with(base, tmp_path, **{field: value})
    with pytest.raises(shardwise.ValidationError, match=message):
        shardwise.to_hf(str(base / "tp1" / "shardwise"), str(tmp_path / "o"), hf_config=str(bad))
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("family,flags", [
    ("deepseek_v32", ("non-interleaved indexer rope: deepseek_v32 implies it, args.dsa_indexer_rope_interleaved says true",
                      "ReLU on the indexer scores: deepseek_v32 implies it, args.dsa_indexer_scoring_relu says false")),
    ("hybrid_glm_moe_dsa",
     ("interleaved indexer rope: glm_moe_dsa implies it, args.dsa_indexer_rope_interleaved says false",)),
])
def test_dsa_flags_the_architecture_implies_are_checked(saved, tmp_path, family, flags):
    """transformers' deepseek_v32 indexer rotates its rope dims in halves, glm_moe_dsa's interleaved,
    and both put their scores through a ReLU; a checkpoint whose args say otherwise computes another
    model and is refused, each flag named."""
    base, _ = saved(family)
    with pytest.raises(shardwise.ValidationError) as e:
        shardwise.to_hf(str(base / "tp1" / "bad_args"), str(tmp_path / "o"),
                        hf_config=str(base / "hf_config" / "config.json"))
    for flag in flags:
        assert flag in str(e.value)
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()


def test_a_hybrid_pattern_that_does_not_pair_is_refused_naming_the_layers(saved, tmp_path):
    """An HF layer is an attention and its MLP: a stored pattern that breaks the pairs cannot be
    numbered, and the error names the layers instead of guessing."""
    base, _ = saved("hybrid_qwen3")
    for call in (lambda: shardwise.to_hf(str(base / "tp1" / "bad_args"), str(tmp_path / "o"),
                                         hf_config=str(base / "hf_config" / "config.json")),
                 lambda: shardwise.to_hf(str(base / "tp1" / "bad_args"), str(tmp_path / "o"), arch="qwen3")):
        with pytest.raises(shardwise.ValidationError,
                           match=r"hybrid layer pattern \"\*--\*\*-\" \(args.hybrid_layer_pattern\) does not pair"
                                 r".*layer 2 is '-' where an attention .*layer 3 is '\*' where an MLP"):
            call()
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("family", HYBRID)
def test_without_args_a_hybrid_checkpoint_is_numbered_from_its_keys(saved, tmp_path, family):
    """A HybridModel checkpoint with no stored args (``decoder.final_norm``, each layer an attention
    or an MLP) converts with the config alone, to the same tensors and logits."""
    base, reference = saved(family)
    out = tmp_path / "hf"
    config = base / "hf_config" / "config.json"
    summary = shardwise.to_hf(str(base / "tp1" / "noargs"), str(out), hf_config=str(config))
    assert summary["args_check"] == "skipped: no args stored", summary
    assert hf_families.safetensors_tensors(str(out)) == _expected(family, reference, config)
    logits, _ = hf_families.hf_load_and_logits(str(out))
    torch.testing.assert_close(logits, torch.load(base / "tp1" / "logits.pt"), rtol=1e-4, atol=1e-5)


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family", LOADED)
@pytest.mark.parametrize("writer", hf_families.WRITERS)
def test_load_at_another_tp_gives_the_tp1_logits(saved, family, writer):
    """``shardwise.megatron.load`` (no collective) fills the TP=2 (x EP=2) model's sharded state dict
    from the TP=1 checkpoint, Megatron's or shardwise's: its forward gives the TP=1 model's logits
    (and not its own, which the load replaced)."""
    base, _ = saved(family)
    loaded = torch.load(base / "resharded" / f"loaded_{writer}.pt")
    assert _rel(loaded, torch.load(base / "tp1" / "logits.pt")) <= MAX_REL_DIFF
    assert _rel(loaded, torch.load(base / "resharded" / "logits.pt")) > 1e-2


def test_a_gpt_checkpoint_loads_into_a_hybrid_model_as_megatron_translates_it(saved):
    """A GPTModel's checkpoint (Megatron's save, TP=1) loads into the HybridModel of the same config
    at TP=2 with ``shardwise.megatron.load(..., hybrid_layer_pattern=...)``: every tensor equals
    what Megatron's own load gives after its ``gpt_checkpoint_interop`` retargeting, and the hybrid
    model's logits are the GPT model's."""
    base, _ = saved("hybrid_qwen3")
    for rank in (0, 1):
        got = json.loads((base / f"gpt_load_rank{rank}.json").read_text())
        assert got["equal"] and got["tensors"] > 10, got
    assert _rel(torch.load(base / "resharded" / "loaded_gpt.pt"), torch.load(base / "gpt" / "logits.pt")) <= MAX_REL_DIFF


def test_a_gpt_checkpoint_is_refused_for_a_hybrid_request_it_cannot_fill(saved):
    """Without the pattern, a HybridModel request against a GPT checkpoint is refused (it would miss
    every key); a pattern Megatron's interop cannot pair (DSA layers) or one of another depth is refused
    before anything is read."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import shardwise.megatron as swm

    base, _ = saved("hybrid_qwen3")
    gpt = str(base / "gpt" / "megatron")

    def request():
        return {k: ShardedTensor.from_rank_offsets(k, torch.zeros(64)) for k in (
            "decoder.final_norm.weight", "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.1.mlp.linear_fc1.layer_norm_weight")}

    with pytest.raises(shardwise.InvalidArgumentError, match="saved by a GPTModel .* pass hybrid_layer_pattern"):
        swm.load(request(), gpt)
    with pytest.raises(shardwise.InvalidArgumentError, match=r"contains layer types \['D'\] that cannot be translated"):
        swm.load(request(), gpt, hybrid_layer_pattern="D-D-D-")
    with pytest.raises(shardwise.ValidationError, match="pairs with a GPT checkpoint of 2 layers; .* has num_layers=3"):
        swm.load(request(), gpt, hybrid_layer_pattern="*-*-")
    # The pattern of the right depth reads the GPT keys: the final norm from decoder.final_layernorm.
    req = request()
    state = swm.load(req, gpt, hybrid_layer_pattern="*-*-*-")
    for k in req:
        assert torch.count_nonzero(state[k]) > 0, k


def _readme_model_types() -> set:
    """The model types the to-hf families table of docs/hf.md claims (first cell of each row)."""
    import re
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| `model_type` | layout converted"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append(ln.split("|")[1])
    return {t for cell in rows for t in re.findall(r"`([a-z0-9_]+)`", cell)}


def _converted_model_types(ckpt, out) -> set:
    """The model types ``to-hf`` maps, as its own error for an unknown one lists them."""
    with pytest.raises(shardwise.InvalidArgumentError) as e:
        shardwise.to_hf(str(ckpt), str(out), arch="no_such_model")
    return set(str(e.value).split("shardwise maps ")[1].replace(",", " ").split())


def test_every_model_type_the_readme_claims_is_converted_and_has_a_logits_test(saved, tmp_path):
    """The families table of docs/hf.md (once the README's) is what ``to-hf`` maps, and each of its
    model types has a test comparing a converted megatron-core model's logits with Megatron's: this
    registry's families, ``test_hf``'s (llama, qwen3, qwen3_moe) and the multimodal Qwen3.5 configs."""
    import transformers

    import hf_workers
    from test_hf import ARCHS

    claimed = _readme_model_types()
    base, _ = saved("qwen2")
    assert claimed == _converted_model_types(base / "tp1" / "shardwise", tmp_path / "o")
    tested = {hf_families.FAMILIES[f].hf_config().model_type for f in FAMILIES}
    tested |= {hf_workers.hf_config(a).model_type for a in ARCHS}
    tested |= {getattr(transformers, c).model_type for _, c in MULTIMODAL}
    assert not claimed - tested, f"claimed by docs/hf.md without a logits test: {sorted(claimed - tested)}"


# --- to-hf --quantize (issue 22) -------------------------------------------------------------------
# The 2-D linear weights the block-FP8 releases keep unquantized (crates/shardwise-hf/src/quant.rs FP8_KEPT_SUFFIXES:
# Qwen3-Next-80B-A3B-Instruct-FP8's modules_to_not_convert, DeepSeek-V3's release).
FP8_KEPT = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", ".gate.weight", ".router.weight",
            "shared_expert_gate.weight", "linear_attn.in_proj_ba.weight", "linear_attn.in_proj_a.weight",
            "linear_attn.in_proj_b.weight", "mtp.fc.weight", ".eh_proj.weight", "indexer.weights_proj.weight")
# max |logits(quantized) - logits(bf16)| / max |logits(bf16)|. e4m3 keeps 3 mantissa bits: each weight
# moves by up to 1/16 of its magnitude (half an ulp), about 2 % RMS; through 4-5 random layers, and
# MoE routers whose top-k flips under such a change, the small models' logits moved by 7.0 %
# (deepseek_v3) and 11.7 % (qwen3_5_moe). MXFP4 (e2m1: 1 mantissa bit, a power-of-two scale per 32
# values) moves each expert weight by up to a quarter of its block's largest value; only gpt_oss's
# experts are quantized (1.9 % measured). The bounds leave about 2x headroom; the exactness of the
# formats is the bitwise checks'.
FP8_MAX_REL = 0.25
MXFP4_MAX_REL = 0.1


def _fp8_recipe(w):
    """DeepGEMM's ``per_block_cast_to_fp8`` (deepseek-ai/DeepGEMM, copied into SGLang and vLLM) in torch:
    a [r, c] weight -> (e4m3fn codes [r, c], float32 scale_inv [ceil(r/128), ceil(c/128)]), the edge
    blocks zero-padded to 128 x 128."""
    r, c = w.shape
    pr, pc = -(-r // 128) * 128, -(-c // 128) * 128
    padded = torch.zeros(pr, pc, dtype=w.dtype)
    padded[:r, :c] = w
    view = padded.view(-1, 128, pc // 128, 128)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    codes = (view * (448.0 / amax)).to(torch.float8_e4m3fn)
    return codes.view(pr, pc)[:r, :c].contiguous(), (amax / 448.0).view(pr // 128, pc // 128)


def _fp8_dequantize(codes, scale_inv):
    full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: codes.shape[0], : codes.shape[1]]
    return codes.float() * full


def _mxfp4_recipe(w):
    """triton_kernels' ``downcast_to_mxfp_torch`` (what transformers' ``quantize_to_mxfp4`` calls) in
    torch, for a bf16 [.., n] tensor: per 32 values the scale 2^s is amax / 6 rounded up to a power of
    two (e8m0 byte s + 127), each value / 2^s rounded to the nearest e2m1 value (ties away from zero),
    two codes per byte, the even element in the low nibble. Returns (blocks [.., n/32, 16], scales
    [.., n/32]), uint8."""
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    bits = ((amax / 6.0).view(torch.int32) + 0x7FFFFF) & 0x7F800000
    scale = bits.view(torch.float32)
    q = torch.where(scale > 0, x / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(x))
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    dist = (q.abs().unsqueeze(-1) - grid).abs()
    # Nearest grid value; on a tie the larger one (the last minimum).
    code = (dist.shape[-1] - 1 - dist.flip(-1).argmin(-1)).to(torch.uint8)
    code = code | ((q < 0) | ((q == 0) & torch.signbit(q))).to(torch.uint8) << 3
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, (bits >> 23).to(torch.uint8).squeeze(-1)


def _mxfp4_dequantize(blocks, scales):
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    return (vals * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)


def _dequantized_folder(folder, out, dequantize):
    """``folder`` with every quantized weight replaced by ``dequantize(stored tensors)`` under its own
    name, in float32, and no quantization_config: what transformers then loads as a plain model."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir()
    t = hf_families._folder_tensors(str(folder))
    plain = dequantize(t)
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("family", ["qwen3_5_moe", "deepseek_v3"])
def test_fp8_block_export_is_deepgemms_recipe_and_loads_within_fp8_tolerance(saved, tmp_path, monkeypatch, family):
    """--quantize fp8-block: every 2-D linear weight but those the releases keep is stored as e4m3 codes
    with float32 weight_scale_inv [ceil(r/128), ceil(c/128)], bitwise what DeepGEMM's recipe (written
    here in torch) gives for the bf16 conversion's tensor (the small models' blocks are all partial
    edge blocks); every other tensor is the bf16 conversion's, byte for byte; quantization_config is
    the release's (DeepSeek-V3: no modules_to_not_convert; Qwen: the kept modules, MTP's included).
    The dequantized model's logits are within FP8_MAX_REL of the bf16 conversion's, and transformers'
    own FP8 loading (``FineGrainedFP8Config(dequantize=True)``, on CPU) gives the same logits."""
    import transformers

    base, _ = saved(family)
    ckpt, config = base / "tp1" / "shardwise", base / "hf_config" / "config.json"
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    shardwise.to_hf(str(ckpt), str(bf16), hf_config=str(config), dtype="bf16")
    summary = shardwise.to_hf(str(ckpt), str(fp8), hf_config=str(config), dtype="bf16", quantize="fp8-block",
                              max_shard_size="100KB", workers=2)
    assert summary["files"] > 1, summary
    plain, quant = hf_families._folder_tensors(str(bf16)), hf_families._folder_tensors(str(fp8))
    scaled = {k[: -len("_scale_inv")] for k in quant if k.endswith("_scale_inv")}
    assert summary["quantized"] == len(scaled) > 10, summary
    assert set(quant) == set(plain) | {f"{k}_scale_inv" for k in scaled}
    for name, w in plain.items():
        if name in scaled:
            codes, scale = _fp8_recipe(w)
            assert quant[name].dtype == torch.float8_e4m3fn and quant[f"{name}_scale_inv"].dtype == torch.float32
            assert torch.equal(quant[name].view(torch.uint8), codes.view(torch.uint8)), name
            assert torch.equal(quant[f"{name}_scale_inv"], scale), name
            assert torch.equal(_fp8_dequantize(quant[name], quant[f"{name}_scale_inv"]), _fp8_dequantize(codes, scale))
        else:
            assert torch.equal(quant[name], w), name
            assert w.dim() != 2 or name.endswith(FP8_KEPT), name
    kept_linear = {n for n, w in plain.items() if w.dim() == 2 and n not in scaled}
    assert any(n.endswith(".gate.weight") for n in kept_linear) and "lm_head.weight" in kept_linear
    mtp_proj = "mtp.fc.weight" if family == "qwen3_5_moe" else "model.layers.3.eh_proj.weight"
    assert mtp_proj in kept_linear, sorted(kept_linear)
    q = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    release = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    if family == "deepseek_v3":
        assert q == release
    else:
        mods = q.pop("modules_to_not_convert")
        assert q == release
        assert {"lm_head", "mtp.fc", "mtp.norm", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate",
                "model.layers.0.input_layernorm", "model.layers.0.linear_attn.in_proj_a"} <= set(mods), mods
        assert not any(m + ".weight" in scaled for m in mods) and "model.embed_tokens" not in mods

    def dequantize(t):
        return {k: (_fp8_dequantize(v, t[f"{k}_scale_inv"]) if f"{k}_scale_inv" in t else v.float())
                for k, v in t.items() if not k.endswith("_scale_inv")}

    deq = _dequantized_folder(fp8, tmp_path / "deq", dequantize)
    want, _ = hf_families.hf_load_and_logits(str(bf16))
    got, info = hf_families.hf_load_and_logits(str(deq))
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{family} fp8-block: max rel diff of the logits to the bf16 conversion {rel:.3e}")
    assert 0 < rel <= FP8_MAX_REL
    # transformers 5.25's FineGrainedFP8 quantizer requires accelerate before it looks at
    # `dequantize`, a path that does not use it (accelerate is not in this venv): the check is lifted.
    monkeypatch.setattr(transformers.quantizers.quantizer_finegrained_fp8, "is_accelerate_available", lambda: True)
    model = hf_families.declared_class(str(fp8)).from_pretrained(
        str(fp8), dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    with torch.no_grad():
        tf = model.eval()(hf_families.TOKENS).logits[0]
    torch.testing.assert_close(tf, got, rtol=1e-4, atol=1e-5)


def test_mxfp4_export_is_gpt_oss_layout_and_loads_in_transformers(saved, tmp_path):
    """--quantize mxfp4 (gpt_oss): each layer's fused experts are stored as gpt-oss stores them,
    ``*_blocks`` [E, out, in/32, 16] and ``*_scales`` [E, out, in/32] of the transposed parameter,
    bitwise what triton_kernels' ``downcast_to_mxfp_torch`` (written here in torch) gives for the bf16
    conversion's experts; everything else is the bf16 conversion's, and quantization_config is
    gpt-oss's. transformers loads the folder with ``Mxfp4Config(dequantize=True)`` on CPU: its logits
    equal those of the model with the experts dequantized here, within MXFP4_MAX_REL of the bf16
    conversion's. A family without an MXFP4 release is refused before anything is written."""
    import transformers

    base, _ = saved("gpt_oss")
    ckpt, config = base / "tp1" / "shardwise", base / "hf_config" / "config.json"
    bf16, mx = tmp_path / "bf16", tmp_path / "mx"
    shardwise.to_hf(str(ckpt), str(bf16), hf_config=str(config), dtype="bf16")
    summary = shardwise.to_hf(str(ckpt), str(mx), hf_config=str(config), dtype="bf16", quantize="mxfp4",
                              max_shard_size="100KB")
    plain, quant = hf_families._folder_tensors(str(bf16)), hf_families._folder_tensors(str(mx))
    experts = [k for k in plain if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert summary["quantized"] == len(experts) == 6, (summary, experts)
    assert set(quant) == (set(plain) - set(experts)) | {f"{k}_{s}" for k in experts for s in ("blocks", "scales")}
    for name, w in plain.items():
        if name in experts:
            blocks, scales = _mxfp4_recipe(w.transpose(-1, -2).contiguous())
            assert quant[f"{name}_blocks"].dtype == quant[f"{name}_scales"].dtype == torch.uint8
            assert torch.equal(quant[f"{name}_blocks"], blocks), name
            assert torch.equal(quant[f"{name}_scales"], scales), name
        else:
            assert torch.equal(quant[name], w), name
    assert json.loads((mx / "config.json").read_text())["quantization_config"] == {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"], "quant_method": "mxfp4"}

    def dequantize(t):
        out = {k: v.float() for k, v in t.items() if not k.endswith(("_blocks", "_scales"))}
        for k in experts:
            out[k] = _mxfp4_dequantize(t[f"{k}_blocks"], t[f"{k}_scales"]).transpose(-1, -2).contiguous()
        return out

    deq = _dequantized_folder(mx, tmp_path / "deq", dequantize)
    want, _ = hf_families.hf_load_and_logits(str(bf16))
    got, _ = hf_families.hf_load_and_logits(str(deq))
    model, info = transformers.GptOssForCausalLM.from_pretrained(
        str(mx), dtype=torch.float32, output_loading_info=True,
        quantization_config=transformers.Mxfp4Config(dequantize=True))
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        tf = model.eval()(hf_families.TOKENS).logits[0]
    torch.testing.assert_close(tf, got, rtol=1e-4, atol=1e-5)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"gpt_oss mxfp4: max rel diff of the logits to the bf16 conversion {rel:.3e}")
    assert 0 < rel <= MXFP4_MAX_REL
    other, _ = saved("deepseek_v3")
    with pytest.raises(shardwise.InvalidArgumentError, match="deepseek_v3 has no MXFP4 release"):
        shardwise.to_hf(str(other / "tp1" / "shardwise"), str(tmp_path / "no"), quantize="mxfp4",
                        hf_config=str(other / "hf_config" / "config.json"))
    with pytest.raises(shardwise.InvalidArgumentError, match="--quantize \"int4\": use fp8-block, mxfp4, nvfp4 or mxfp8"):
        shardwise.to_hf(str(ckpt), str(tmp_path / "no"), hf_config=str(config), quantize="int4")
    assert not (tmp_path / "no").exists()


# --- from-hf of every family's export, MTP layers and a multimodal folder included: the round trip -----
# Every family from-hf writes (a GPTModel's keys: the HybridModel variants are the same HF families).
ROUND_TRIP = [f for f in hf_families.FAMILIES if f not in HYBRID]


@pytest.fixture(scope="session")
def round_trip(saved, tmp_path_factory):
    """For each family: to-hf of its TP=1 shardwise checkpoint (with its MTP layer where the family has
    one) into ``<family>/hf``, then from-hf of that (fp32, TP=2) into ``<family>/ckpt``; for qwen3_5_moe
    also the multimodal release layout (``multimodal/hf``: vision tower from ``--base-hf``, text model
    under model.language_model.*) through from-hf into ``multimodal/ckpt``. One 2-process run then
    loads each checkpoint into a megatron-core model (with its MTP layers) beside the original
    (``hf_families.round_trip_load``)."""
    base = tmp_path_factory.mktemp("round_trip")
    jobs, summaries = [], {}

    def convert(name, family, hf, original):
        fam = hf_families.FAMILIES[family]
        summaries[name] = shardwise.from_hf(str(hf), str(base / name / "ckpt"), dtype="fp32",
                                            transformer_impl=fam.transformer_impl, tensor_model_parallel_size=2)
        jobs.append((name, family, str(base / name / "ckpt"), str(original), str(base / name)))

    for family in ROUND_TRIP:
        fam_base, _ = saved(family)
        shardwise.to_hf(str(fam_base / "tp1" / "shardwise"), str(base / family / "hf"),
                        hf_config=str(fam_base / "hf_config" / "config.json"))
        convert(family, family, base / family / "hf", fam_base / "tp1" / "megatron")
    fam_base, _ = saved("qwen3_5_moe")
    config, release = _multimodal(fam_base, base / "multimodal")
    shardwise.to_hf(str(fam_base / "tp1" / "shardwise"), str(base / "multimodal" / "hf"), hf_config=str(config),
                    base_hf=str(release))
    convert("multimodal", "qwen3_5_moe", base / "multimodal" / "hf", fam_base / "tp1" / "megatron")
    results = spawn(hf_families.round_trip_load, 2, str(base / "out"), jobs, timeout_s=1200)
    failed = [r for r in results if not r.get("ok")]
    assert not failed, "\n".join(f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}" for r in failed)
    return base, summaries, results, release


@pytest.mark.parametrize("name", [*ROUND_TRIP, "multimodal"])
def test_megatron_hf_megatron_gives_back_every_tensor_bitwise(saved, round_trip, name):
    """Megatron -> HF -> Megatron: megatron-core 0.19.2 loads from-hf's output (with its MTP layer,
    ``mtp_num_layers=1``, where the family has one) at TP=2 (x EP=2) with no key mismatch, every
    tensor equal to the original checkpoint's (the vocabulary padding rows aside; the GDN output
    norm through HF's ``w + 1``), and the logits (and MTP logits) equal Megatron's."""
    base, summaries, results, _ = round_trip
    family = "qwen3_5_moe" if name == "multimodal" else name
    fam_base, _ = saved(family)
    mtp = family in hf_families.MTP_LAYOUT
    s = summaries[name]
    assert s["mtp_layers"] == mtp and s["dropped_mtp"] == 0 and not s["skipped"] and not s["warnings"], s
    assert (s["vision_tensors"] > 0) == (name == "multimodal"), s
    for r in results:
        res = r[name]
        assert res["mismatch"] == [[], []], (r["rank"], res["mismatch"])
        assert res["differ"] == [] and res["tensors"] > 0, (r["rank"], res["differ"])
    torch.testing.assert_close(torch.load(base / name / "logits.pt"), torch.load(fam_base / "tp1" / "logits.pt"),
                               rtol=1e-4, atol=1e-5)
    if mtp:
        torch.testing.assert_close(torch.load(base / name / "mtp_logits.pt"),
                                   torch.load(fam_base / "tp1" / "mtp_logits.pt"), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [*ROUND_TRIP, "multimodal"])
def test_hf_megatron_hf_gives_back_every_tensor_bitwise(round_trip, name, tmp_path):
    """HF -> Megatron -> HF: to-hf of from-hf's output, with the folder's own config.json (and for the
    multimodal folder ``--base-hf``, which puts the vision tower back), gives back every tensor of the
    folder bitwise, under the same names and dtypes: MTP layer and vision tower included."""
    base, summaries, _, release = round_trip
    hf = base / name / "hf"
    kw = {"base_hf": str(release)} if name == "multimodal" else {}
    summary = shardwise.to_hf(str(base / name / "ckpt"), str(tmp_path / "back"), hf_config=str(hf / "config.json"), **kw)
    family = "qwen3_5_moe" if name == "multimodal" else name
    assert summary["args_check"] == "passed" and not summary["warnings"], summary
    assert summary["mtp_layers"] == (family in hf_families.MTP_LAYOUT), summary
    want, got = hf_families._folder_tensors(str(hf)), hf_families._folder_tensors(str(tmp_path / "back"))
    assert sorted(got) == sorted(want)
    assert any(k.startswith("model.visual.") for k in want) == (name == "multimodal")
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), k


def test_slime_1908_job_hf_release_to_training_to_hf_release(round_trip, tmp_path):
    """The job of slime #1908 (Qwen3.5-35B-A3B at TP=2 x EP=8 with async saves, whose Megatron save hung
    in ``gather_object``), scaled down, end to end: (1) a Qwen3.5-MoE multimodal release with a vision
    tower and an MTP layer goes through from-hf (the ``round_trip`` fixture); (2) 4 gloo ranks at TP=2 x
    EP=2 load it with megatron-core, train 2 steps, and save each with
    ``shardwise.megatron.save(async_save=True)`` while their process groups disagree and one rank is
    late (``hf_families.train_and_save``); every save commits; (3) to-hf --base-hf of the last save;
    (4) ``Qwen3_5MoeForConditionalGeneration`` loads it with no missing, unexpected or mismatched
    weight, its logits equal the trained Megatron model's, the MTP layer's (by its formula) equal
    Megatron's MTP logits, and the vision tower is the release's, byte for byte."""
    base, _, _, release = round_trip
    results = spawn(hf_families.train_and_save, 4, str(tmp_path / "out"), "qwen3_5_moe",
                    str(base / "multimodal" / "ckpt"), str(tmp_path), 2, timeout_s=900)
    failed = [r for r in results if not r.get("ok")]
    assert not failed, "\n".join(f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}" for r in failed)
    for r in results:
        assert [s["committed"] for s in r["reports"]] == [True, True], r
    out = tmp_path / "hf"
    summary = shardwise.to_hf(str(tmp_path / "iter_0000002"), str(out),
                              hf_config=str(base / "multimodal" / "hf" / "config.json"), base_hf=str(release))
    assert summary["args_check"] == "passed" and summary["mtp_layers"] == 1 and not summary["warnings"], summary
    logits, info = hf_families.hf_load_and_logits(str(out))
    assert type(info).__name__ == "dict" and not any(info[k] for k in ("missing_keys", "unexpected_keys",
                                                                          "mismatched_keys")), info
    assert hf_families.declared_class(str(out)).__name__ == "Qwen3_5MoeForConditionalGeneration"
    torch.testing.assert_close(logits, torch.load(tmp_path / "logits.pt"), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hf_families.hf_mtp_logits(str(out), "qwen3_5_moe"),
                               torch.load(tmp_path / "mtp_logits.pt")[0], rtol=1e-4, atol=1e-5)
    start, trained = (hf_families._folder_tensors(str(d)) for d in (base / "multimodal" / "hf", out))
    assert sorted(start) == sorted(trained)
    changed = [k for k in start if not torch.equal(start[k], trained[k])]
    assert any(k.startswith("mtp.") for k in changed) and any(".mlp.experts." in k for k in changed), changed
    assert not any(k.startswith("model.visual.") for k in changed)


# --- to-hf --quantize nvfp4 / mxfp8 (issue 38) -----------------------------------------------------
# The reference is llm-compressor's model_free_ptq on the bf16 folder to-hf writes without --quantize,
# with `ignore` the modules the quantized folder keeps (its quantization_config's; model-free matching
# otherwise takes every `.weight` whose module name does not end in `norm`). llm-compressor fuses the
# NVFP4 global scale of q/k/v, a dense MLP's gate/up and w1/w3 only; shardwise also of every expert's
# and shared expert's gate/up and MLA's q_a/kv_a (vLLM fuses them, crates/shardwise-hf/src/quant.rs SCALE_GROUPS). With
# those sets added to llm-compressor's own fused-name list the outputs are identical byte for byte;
# without, only those sets' tensors differ.
LLMC_FUSED = [
    [r"re:.*self_attn\.q_proj\.weight$", r"re:.*self_attn\.k_proj\.weight$", r"re:.*self_attn\.v_proj\.weight$"],
    [r"re:.*self_attn\.q_a_proj\.weight$", r"re:.*self_attn\.kv_a_proj_with_mqa\.weight$"],
    [r"re:.*\.gate_proj\.weight$", r"re:.*\.up_proj\.weight$"],
    [r"re:.*\.w1\.weight$", r"re:.*\.w3\.weight$"],
]
# The groups llm-compressor does not fuse, by weight-name suffix.
LLMC_UNFUSED = ("experts.", "shared_expert.", "shared_experts.", "q_a_proj.", "kv_a_proj_with_mqa.")
# max |logits(quantized) - logits(bf16)| / max |logits(bf16)| of the folder dequantized by compressed-tensors,
# measured on these small random models. NVFP4 moves each weight by about 9.5 % RMS (e2m1 keeps one
# mantissa bit), MXFP8 by about 2 %; the dense model's logits moved 4.5 % (NVFP4) and 2.4 % (MXFP8); in the
# MoE models the routers' top-k flips under such changes and dominate (qwen3_5_moe NVFP4: 87 %). The bounds
# leave about 2x headroom; the exactness of the formats is the bitwise checks'.
QUANT_MAX_REL = {("qwen3_5", "nvfp4"): 0.1, ("qwen3_5", "mxfp8"): 0.05, ("qwen3_5_moe", "nvfp4"): 1.75,
                 ("deepseek_v3", "nvfp4"): 1.0}


def _model_free_ptq(src, out, preset, ignore, monkeypatch=None):
    from llmcompressor import model_free_ptq
    from llmcompressor.entrypoints.model_free import microscale

    if monkeypatch is not None:
        monkeypatch.setattr(microscale, "_DEFAULT_FUSED_MAPPINGS_LIST", LLMC_FUSED)
    model_free_ptq(str(src), str(out), scheme=preset, ignore=ignore, device="cpu")
    if monkeypatch is not None:
        monkeypatch.undo()
    return hf_families._folder_tensors(str(out)), json.loads((out / "config.json").read_text())["quantization_config"]


def _fused_sets(names):
    """Our scale groups, by name (crates/shardwise-hf/src/quant.rs SCALE_GROUPS, written again): weight name -> key."""
    import re

    out = {}
    for k, members in enumerate([("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                 ("gate_proj", "up_proj"), ("w1", "w3"),
                                 ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")]):
        for n in names:
            for m in members:
                hit = re.fullmatch(rf"(.*\.){re.escape(m)}\.weight_global_scale", n)
                if hit:
                    out[n] = (hit.group(1), k)
    return out


def _bitwise(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "deepseek_v3"])
@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp8"])
def test_nvfp4_and_mxfp8_exports_are_llm_compressors_bytes_and_load_in_transformers(saved, tmp_path, monkeypatch,
                                                                                      family, scheme):
    """--quantize nvfp4 / mxfp8 of a dense (qwen3_5), an MoE (qwen3_5_moe) and an MLA (deepseek_v3) family:
    every tensor (quantized or kept) and quantization_config equal llm-compressor's model_free_ptq output
    for the bf16 conversion, byte for byte (NVFP4: with shardwise's fused sets given to llm-compressor;
    with its own, only the sets it does not fuse differ); each fused set shares one global scale; the
    MTP layers, routers, shared-expert gates, embedding and lm_head are kept; transformers loads the
    folder (CompressedTensorsConfig(dequantize=True)) with no missing keys, its logits within the stated
    bound of the bf16 conversion's. Split over two parts and 3 workers, the files are the same."""
    import transformers

    base, _ = saved(family)
    ckpt, config = base / "tp1" / "shardwise", base / "hf_config" / "config.json"
    bf16, q = tmp_path / "bf16", tmp_path / "q"
    refused = {"qwen3_5_moe": r"model\.layers\.0\.mlp\.shared_expert\.down_proj\.weight \[64, 48\]: its input "
                              r"dimension 48",  # the shared expert's intermediate size
               "deepseek_v3": r"model\.layers\.0\.self_attn\.kv_b_proj\.weight \[112, 16\]: its input dimension 16"}
    if scheme == "mxfp8" and family in refused:
        # An input dimension that is not a multiple of MXFP8's 32-value group: refused, named.
        with pytest.raises(shardwise.InvalidArgumentError, match=rf"--quantize mxfp8: {refused[family]} is not a "
                           r"multiple of the 32-element scale group"):
            shardwise.to_hf(str(ckpt), str(q), hf_config=str(config), dtype="bf16", quantize=scheme)
        assert not q.exists()
        return
    shardwise.to_hf(str(ckpt), str(bf16), hf_config=str(config), dtype="bf16")
    summary = shardwise.to_hf(str(ckpt), str(q), hf_config=str(config), dtype="bf16", quantize=scheme,
                              max_shard_size="100KB", workers=3)
    assert summary["files"] > 1 and summary["quantized"] > 10, summary
    ours = hf_families._folder_tensors(str(q))
    qc = json.loads((q / "config.json").read_text())["quantization_config"]
    ignore = qc["ignore"]
    assert {"lm_head", "model.embed_tokens"} <= set(ignore), ignore
    assert any(m.endswith("mlp.gate") for m in ignore) == (family != "qwen3_5"), ignore
    mtp = "mtp." if family.startswith("qwen") else "model.layers.3."
    assert not any(k.startswith(mtp) and k.endswith(("_packed", "_scale")) for k in ours)
    preset = {"nvfp4": "NVFP4A16", "mxfp8": "MXFP8"}[scheme]
    ref, ref_qc = _model_free_ptq(bf16, tmp_path / "ref", preset, ignore, monkeypatch if scheme == "nvfp4" else None)
    assert qc == ref_qc
    assert set(ours) == set(ref)
    different = sorted(k for k in ref if not _bitwise(ours[k], ref[k]))
    assert not different, different[:10]
    # Parts and workers give the same files.
    parts = tmp_path / "parts"
    for i in range(2):
        shardwise.to_hf(str(ckpt), str(parts), hf_config=str(config), dtype="bf16", quantize=scheme,
                        max_shard_size="100KB", workers=1, part=f"{i}/2")
    for f in sorted(q.glob("*.safetensors")):
        assert f.read_bytes() == (parts / f.name).read_bytes(), f.name
    if scheme == "nvfp4":
        groups = {}
        for n, key in _fused_sets(ours).items():
            groups.setdefault(key, []).append(n)
        assert sum(len(g) > 1 for g in groups.values()) >= 4, groups
        for names in groups.values():
            assert len({ours[n].item() for n in names}) == 1, names
        # llm-compressor's own fused sets: only the sets it does not fuse differ.
        own, _ = _model_free_ptq(bf16, tmp_path / "own", preset, ignore)
        differ = {k for k in own if not _bitwise(ours[k], own[k])}
        assert all(any(s in k for s in LLMC_UNFUSED) for k in differ), sorted(differ)[:10]
        assert bool(differ) == (family != "qwen3_5"), sorted(differ)[:10]
    # The logits: the folder dequantized by compressed-tensors' own compressor, against the bf16
    # conversion's. transformers 5.25 loads the folder with no missing keys; its dequantization equals
    # compressed-tensors' for a dense model, but its MoE-experts path drops NVFP4's global scale and
    # multiplies MXFP8 codes by the raw e8m0 byte (integrations/compressed_tensors.py
    # CompressedTensorsDequantize), so for MoE families only its loading is checked.
    deq = _dequantized_folder(q, tmp_path / "deq", lambda t: _ct_dequantize(t, qc))
    want, _ = hf_families.hf_load_and_logits(str(bf16))
    got, _ = hf_families.hf_load_and_logits(str(deq))
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{family} {scheme}: max rel diff of the logits to the bf16 conversion {rel:.3e}")
    assert 0 < rel <= QUANT_MAX_REL[family, scheme]
    model, info = hf_families.declared_class(str(q)).from_pretrained(
        str(q), dtype=torch.float32, output_loading_info=True,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    if family == "qwen3_5":
        with torch.no_grad():
            tf = model.eval()(hf_families.TOKENS).logits[0]
        # transformers dequantizes into bfloat16 first (compressed-tensors' unpacked dtype).
        tf_rel = ((tf - got).abs().max() / got.abs().max()).item()
        print(f"{family} {scheme}: transformers' dequantization vs compressed-tensors' {tf_rel:.3e}")
        assert tf_rel <= 0.05


def _ct_dequantize(t, qc):
    """Every quantized module of folder tensors ``t`` decompressed by compressed-tensors' own
    compressor for ``qc`` (the folder's quantization_config), in float32; other tensors as they are."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k not in ("version", "transform_config")})
    (scheme,) = cfg.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(cfg.format)
    params = compressor.compression_param_names(scheme)
    modules = {k[: -len("weight_scale")] for k in t if k.endswith(".weight_scale")}
    out = {k: v.float() for k, v in t.items() if k.rsplit(".", 1)[0] + "." not in modules}
    for m in modules:
        state = compressor.decompress({p: t[m + p] for p in params}, scheme)
        out[m + "weight"] = state["weight"].float()
    return out


def test_nvfp4_modelopt_layout_is_nvfp4qtensors_bytes(saved, tmp_path):
    """--quantize nvfp4 --quantize-format modelopt: each quantized linear is stored as ModelOpt's
    W4A16_NVFP4 export stores it (weight uint8 [out, in/2], weight_scale e4m3 [out, in/16],
    weight_scale_2 float32 []), bitwise what nvidia-modelopt's own NVFP4QTensor functions give on CPU
    for the bf16 conversion's weight, with the fused sets' largest amax (ModelOpt's
    preprocess_linear_fusion); hf_quant_config.json is ModelOpt's and config.json's
    quantization_config is what its convert_hf_quant_config_format makes of it."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    base, _ = saved("qwen3_5_moe")
    ckpt, config = base / "tp1" / "shardwise", base / "hf_config" / "config.json"
    bf16, q = tmp_path / "bf16", tmp_path / "q"
    shardwise.to_hf(str(ckpt), str(bf16), hf_config=str(config), dtype="bf16")
    summary = shardwise.to_hf(str(ckpt), str(q), hf_config=str(config), dtype="bf16", quantize="nvfp4",
                              quantize_format="modelopt", max_shard_size="100KB", workers=2)
    plain, ours = hf_families._folder_tensors(str(bf16)), hf_families._folder_tensors(str(q))
    quantized = sorted(k[: -len("_scale_2")] for k in ours if k.endswith("_scale_2"))
    assert summary["quantized"] == len(quantized) > 10
    hf_quant = json.loads((q / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "modelopt"
    assert {k: v for k, v in hf_quant["quantization"].items() if k != "exclude_modules"} == {
        "quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16}
    assert json.loads((q / "config.json").read_text())["quantization_config"] == convert_hf_quant_config_format(hf_quant)
    keys = {n: key for n, key in _fused_sets({f"{k}_global_scale" for k in quantized}).items()}
    amax = {}
    for n, key in keys.items():
        amax[key] = max(amax.get(key, 0.0), plain[n[: -len("_global_scale")]].abs().max().float().item())
    for name in quantized:
        w = plain[name]
        key = keys.get(f"{name}_global_scale")
        sf2 = (torch.tensor(amax[key]) if key else w.abs().max().float()) / (6.0 * 448.0)
        qt, scale, scale_2 = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=sf2)
        assert ours[name].dtype == torch.uint8 and torch.equal(ours[name], qt._quantized_data), name
        assert _bitwise(ours[f"{name}_scale"], scale), name
        assert ours[f"{name}_scale_2"].shape == () and _bitwise(ours[f"{name}_scale_2"], scale_2.float()), name
    for k, v in ours.items():
        if not k.endswith(("_scale", "_scale_2")) and k not in quantized:
            assert _bitwise(v, plain[k]), k


def test_quantizations_that_need_calibration_are_refused(saved, tmp_path):
    """NVFP4 W4A4 needs input_scale, an activation statistic: refused before anything is written,
    naming calibration; a layout other than the scheme's, a --quantize-format without --quantize and
    NVFP4 / MXFP8 of gpt_oss (3-D fused experts) are refused too."""
    base, _ = saved("qwen3_5_moe")
    ckpt, config = str(base / "tp1" / "shardwise"), str(base / "hf_config" / "config.json")
    out = tmp_path / "no"
    with pytest.raises(shardwise.InvalidArgumentError, match="needs calibration data: NVFP4 W4A4 stores input_scale"):
        shardwise.to_hf(ckpt, str(out), hf_config=config, quantize="nvfp4-w4a4")
    with pytest.raises(shardwise.InvalidArgumentError, match="--quantize-format \"modelopt\" with --quantize mxfp8"):
        shardwise.to_hf(ckpt, str(out), hf_config=config, quantize="mxfp8", quantize_format="modelopt")
    with pytest.raises(shardwise.InvalidArgumentError, match="without --quantize"):
        shardwise.to_hf(ckpt, str(out), hf_config=config, quantize_format="modelopt")
    gpt, _ = saved("gpt_oss")
    with pytest.raises(shardwise.InvalidArgumentError, match="gpt_oss's experts are 3-D fused parameters"):
        shardwise.to_hf(str(gpt / "tp1" / "shardwise"), str(out), quantize="nvfp4",
                        hf_config=str(gpt / "hf_config" / "config.json"))
    assert not out.exists()
