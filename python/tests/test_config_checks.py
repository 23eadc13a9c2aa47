"""What every check says is what torch, Megatron and serving will see (issue 44, parts 3 and 4, and the
vocabulary padding of part 6), on real from-hf checkpoints of transformers' random models:

* every row of docs/hf.md's "Compared pairs" table: its config field (or, for what the architecture
  implies, its args field) flipped, to-hf refuses naming it before anything is written, and
  ``--allow-config-mismatch`` lets it through with a warning and config.json's value written (or, for a
  size the tensors show, the tensor check still refuses);
* a routing contradiction (top-k, ``norm_topk_prob``) through the real CLI, and the model the
  contradicting config makes routes differently;
* values Megatron and serving cannot use (epsilon, context length, router top-k and groups, MTP count)
  refused by from-hf and to-hf before anything is written or committed;
* a ``vision_config.depth`` of 10^9 fails within a second with bounded memory;
* Megatron's vocabulary padding, nothing more (250 at TP 4 is 512).

Each refusal names the field, leaves no output, and leaves every input byte-identical."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hf_families
import shardwise

CLI = [sys.executable, "-m", "shardwise.cli"]
DOC = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text()


def _doc_rows() -> list[tuple[str, str]]:
    """(config field, args field) of each row of docs/hf.md's "Compared pairs" table."""
    table = DOC[DOC.index("#### Compared pairs"):DOC.index("\nNot compared")]
    rows = []
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [c.strip().strip("`") for c in line.split("|")]
            rows.append((cells[1], cells[2]))
    return rows


# Per row: the family whose checkpoint shows it, the change (config fields; ``args``: stored args
# fields, for what the architecture implies and no config field says), the name given to
# --allow-config-mismatch, and what the escape gives: "written" (converts, config.json's value
# written) or "shape" (a size or layout the tensors contradict: still refused, by the tensor check).
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
FLIPS = {
    ("num_hidden_layers", "num_layers"): ("llama", {"num_hidden_layers": 4}, "shape"),
    ("hidden_size", "hidden_size"): ("llama", {"hidden_size": 32}, "shape"),
    ("num_attention_heads", "num_attention_heads"): ("llama", {"num_attention_heads": 8}, "shape"),
    ("vocab_size", "vocab_size"): ("llama", {"vocab_size": 200}, "written"),
    ("tie_word_embeddings", "untie_embeddings_and_output_weights"): ("llama", {"tie_word_embeddings": True}, "written"),
    ("rms_norm_eps", "norm_epsilon"): ("llama", {"rms_norm_eps": 1e-3}, "written"),
    ("num_key_value_heads", "num_query_groups"): ("llama", {"num_key_value_heads": 4}, "shape"),
    ("head_dim", "kv_channels"): ("llama", {"head_dim": 8}, "shape"),
    ("intermediate_size", "ffn_hidden_size"): ("llama", {"intermediate_size": 96}, "shape"),
    ("max_position_embeddings", "max_position_embeddings"): ("llama", {"max_position_embeddings": 128}, "written"),
    ("rope_parameters", "rope_type"): ("llama", {"rope_parameters": YARN}, "written"),
    ("hidden_act", "swiglu"): ("llama", {"hidden_act": "gelu"}, "written"),
    ("rope_theta", "rotary_base"): ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "written"),
    ("partial_rotary_factor", "rotary_percent"): (
        "qwen3_next", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
        "written"),
    ("q_norm and k_norm", "qk_layernorm"): ("qwen3", {"args": {"qk_layernorm": False}}, "written"),
    ("num_experts", "num_experts"): ("qwen3_moe", {"num_experts": 8}, "shape"),
    ("moe_intermediate_size", "moe_ffn_hidden_size"): ("qwen3_moe", {"moe_intermediate_size": 64}, "shape"),
    ("intermediate_size", "moe_ffn_hidden_size"): ("mixtral", {"intermediate_size": 64}, "shape"),
    ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"): (
        "qwen3_next", {"shared_expert_intermediate_size": 32}, "shape"),
    ("n_shared_experts", "moe_shared_expert_intermediate_size"): ("deepseek_v3", {"n_shared_experts": 1}, "shape"),
    ("num_experts", "moe_layer_freq"): ("qwen3_moe", {"mlp_only_layers": [0]}, "shape"),
    ("first_k_dense_replace", "moe_layer_freq"): ("deepseek_v3", {"first_k_dense_replace": 2}, "shape"),
    ("num_experts_per_tok", "moe_router_topk"): ("qwen3_moe", {"num_experts_per_tok": 3}, "written"),
    ("router scoring", "moe_router_score_function"): (
        "qwen3_moe", {"args": {"moe_router_score_function": "sigmoid"}}, "written"),
    ("norm_topk_prob", "moe_router_score_function"): ("qwen3_moe", {"norm_topk_prob": False}, "written"),
    ("routed_scaling_factor", "moe_router_topk_scaling_factor"): ("deepseek_v3", {"routed_scaling_factor": 1.0}, "written"),
    ("n_group", "moe_router_num_groups"): ("deepseek_v3", {"n_group": 2}, "written"),
    ("topk_group", "moe_router_group_topk"): ("deepseek_v3", {"args": {"moe_router_group_topk": 1}}, "written"),
    ("q_lora_rank", "q_lora_rank"): ("deepseek_v3", {"q_lora_rank": 16}, "shape"),
    ("kv_lora_rank", "kv_lora_rank"): ("deepseek_v3", {"kv_lora_rank": 32}, "shape"),
    ("qk_nope_head_dim", "qk_head_dim"): ("deepseek_v3", {"qk_nope_head_dim": 8}, "shape"),
    ("qk_rope_head_dim", "qk_pos_emb_head_dim"): ("deepseek_v3", {"qk_rope_head_dim": 4}, "shape"),
    ("v_head_dim", "v_head_dim"): ("deepseek_v3", {"v_head_dim": 8}, "shape"),
    ("use_qk_norm", "qk_layernorm"): ("glm4_moe", {"use_qk_norm": False}, "shape"),
    ("attention_bias", "add_qkv_bias"): ("glm4_moe", {"attention_bias": False}, "shape"),
    ("sliding_window", "window_size"): ("gpt_oss", {"sliding_window": 8}, "written"),
    ("swiglu_limit", "activation_func_clamp_value"): ("gpt_oss", {"swiglu_limit": 5.0}, "written"),
    ("linear_num_key_heads", "linear_num_key_heads"): ("qwen3_next", {"linear_num_key_heads": 4}, "shape"),
    ("linear_num_value_heads", "linear_num_value_heads"): ("qwen3_next", {"linear_num_value_heads": 8}, "shape"),
    ("linear_key_head_dim", "linear_key_head_dim"): ("qwen3_next", {"linear_key_head_dim": 8}, "shape"),
    ("linear_value_head_dim", "linear_value_head_dim"): ("qwen3_next", {"linear_value_head_dim": 16}, "shape"),
    ("linear_conv_kernel_dim", "linear_conv_kernel_dim"): ("qwen3_next", {"linear_conv_kernel_dim": 3}, "shape"),
    ("layer_types", "linear_attention_freq"): (
        "qwen3_next", {"layer_types": ["full_attention", "linear_attention"] * 2}, "shape"),
    ("attention_output_gate", "attention_output_gate"): (
        "qwen3_next", {"args": {"attention_output_gate": False}}, "written"),
    ("layernorm_zero_centered_gamma", "apply_layernorm_1p"): (
        "qwen3_next", {"args": {"apply_layernorm_1p": False}}, "written"),
    ("shared_expert_gate", "moe_shared_expert_gate"): ("qwen3_next", {"args": {"moe_shared_expert_gate": False}}, "written"),
    ("index_n_heads", "dsa_indexer_n_heads"): ("deepseek_v32", {"index_n_heads": 8}, "shape"),
    ("index_head_dim", "dsa_indexer_head_dim"): ("deepseek_v32", {"index_head_dim": 32}, "shape"),
    ("index_topk", "dsa_indexer_topk"): ("deepseek_v32", {"index_topk": 8}, "written"),
    ("indexer_types", "dsa_indexer_topk_freq"): ("deepseek_v32", {"indexer_types": ["full", "shared", "full"]}, "shape"),
    ("ReLU on the indexer scores", "dsa_indexer_scoring_relu"): (
        "deepseek_v32", {"args": {"dsa_indexer_scoring_relu": False}}, "written"),
    ("non-interleaved indexer rope", "dsa_indexer_rope_interleaved"): (
        "deepseek_v32", {"args": {"dsa_indexer_rope_interleaved": True}}, "written"),
    ("interleaved indexer rope", "dsa_indexer_rope_interleaved"): (
        "hybrid_glm_moe_dsa", {"args": {"dsa_indexer_rope_interleaved": False}}, "written"),
}


def _digests(paths) -> dict:
    """Every file's sha256 below each path (a missing path as None)."""
    out = {}
    for root in map(Path, paths):
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        out[str(root)] = None if not root.exists() else {
            str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (HF folder of transformers' random model, its from-hf checkpoint), made on first use."""
    base = tmp_path_factory.mktemp("config_checks")
    done = {}

    def get(family):
        if family not in done:
            fam = hf_families.FAMILIES[family]
            hf, ckpt = base / family / "hf", base / family / "ckpt"
            hf_families.random_hf_model(fam.hf_config(), str(hf))
            assert shardwise.from_hf(str(hf), str(ckpt), dtype="fp32", transformer_impl=fam.transformer_impl,
                                     tensor_model_parallel_size=2)["committed"]
            done[family] = hf, ckpt
        return done[family]

    return get


def _config(hf: Path, tmp_path: Path, changes: dict) -> Path:
    """config.json of ``hf`` with ``changes`` (a None value removes the field), written beside."""
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _with_args(ckpt: Path, tmp_path: Path, changes: dict) -> Path:
    """A copy of checkpoint ``ckpt`` whose stored args (common.pt) have ``changes``."""
    torch.serialization.add_safe_globals([argparse.Namespace])
    copy = Path(shutil.copytree(ckpt, tmp_path / "ckpt"))
    state = torch.load(copy / "common.pt", weights_only=True)
    for k, v in changes.items():
        setattr(state["args"], k, v)
    torch.save(state, copy / "common.pt")
    return copy


def _flipped(converted, row, tmp_path):
    """(checkpoint, config path, the change) of ``row``'s flip."""
    family, change, _ = FLIPS[row]
    hf, ckpt = converted(family)
    change = dict(change)
    args = change.pop("args", None)
    if args:
        ckpt = _with_args(ckpt, tmp_path, args)
    return ckpt, _config(hf, tmp_path, change), change


def test_the_table_has_a_flip_for_every_row():
    assert set(FLIPS) == set(_doc_rows()), set(FLIPS) ^ set(_doc_rows())


@pytest.mark.parametrize("row", _doc_rows(), ids=[f"{h}-{a}".replace(" ", "_") for h, a in _doc_rows()])
def test_each_compared_pair_refuses_a_difference_naming_it_and_the_escape_works(converted, row, tmp_path):
    hf_field, args_field = row
    ckpt, config, change = _flipped(converted, row, tmp_path)
    inputs = [ckpt, config, converted(FLIPS[row][0])[0]]
    before = _digests(inputs)
    out = tmp_path / "out"
    with pytest.raises(shardwise.ValidationError, match="disagrees with the checkpoint") as e:
        shardwise.to_hf(str(ckpt), str(out), hf_config=str(config))
    msg = str(e.value)
    # The field by name (a MoE layer pattern by the config fields that make it), and the args field.
    named = "MoE layer pattern" if args_field == "moe_layer_freq" else f"{hf_field}:"
    assert named in msg and args_field in msg, msg
    assert next(iter(change), hf_field) in msg or hf_field in msg, msg
    assert not out.exists()
    # The escape, by the config field's name.
    if FLIPS[row][2] == "written":
        summary = shardwise.to_hf(str(ckpt), str(out), hf_config=str(config), allow_config_mismatch=[hf_field])
        assert summary["committed"], summary
        allowed = [w for w in summary["warnings"] if f"--allow-config-mismatch {hf_field}:" in w]
        assert len(allowed) == 1 and args_field in allowed[0], summary["warnings"]
        written = json.loads((out / "config.json").read_text())
        for k, v in change.items():
            assert written[k] == v, (k, written[k])  # config.json's value is the one written
    else:
        with pytest.raises((shardwise.ValidationError, shardwise.InvalidArgumentError)) as e:
            shardwise.to_hf(str(ckpt), str(out), hf_config=str(config), allow_config_mismatch=[hf_field])
        assert "disagrees with the checkpoint" not in str(e.value), str(e.value)
        assert not (out / "model.safetensors.index.json").exists()
    assert _digests(inputs) == before


def _cli(*args, timeout=120):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def _refused(args, inputs, match, out=None, code=1):
    """The CLI refuses with a one-line error naming ``match``, writes nothing to ``out`` and leaves
    ``inputs`` byte-identical."""
    before = _digests(inputs)
    r = _cli(*args)
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), r.stderr
    assert re.search(match, lines[0]), lines[0]
    if out is not None:
        assert not out.exists(), list(out.iterdir())
    assert _digests(inputs) == before
    return lines[0]


@pytest.mark.parametrize("field, value, message", [
    ("num_experts_per_tok", 3, "num_experts_per_tok: config.json says 3, args.moe_router_topk says 2"),
    ("norm_topk_prob", False, "norm_topk_prob: config.json says false, but args.moe_router_score_function "
                              "\"softmax\" with moe_router_pre_softmax false renormalises the top-k: true"),
])
def test_a_config_that_routes_otherwise_than_the_trained_model_is_refused(converted, tmp_path, field, value, message):
    """A Qwen3-MoE release (4 experts, top-2, renormalised) through from-hf; to-hf with a config.json
    routing otherwise is refused before anything is written, through the CLI; with
    --allow-config-mismatch it converts, says so, and writes the config's value, and the model that
    config makes computes other logits than the trained one."""
    hf, ckpt = converted("qwen3_moe")
    config = _config(hf, tmp_path, {field: value})
    out = tmp_path / "out"
    _refused(["to-hf", ckpt, out, "--hf-config", config], [hf, ckpt, config], re.escape(message), out=out)
    r = _cli("to-hf", ckpt, out, "--hf-config", config, "--allow-config-mismatch", field, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert any(w.startswith(message) and "--allow-config-mismatch" in w for w in summary["warnings"]), summary
    assert message in r.stderr
    assert json.loads((out / "config.json").read_text())[field] == value
    # The consequence is real: the same weights under the contradicting config route differently.
    trained, _ = hf_families.hf_load_and_logits(str(hf))
    exported, _ = hf_families.hf_load_and_logits(str(out))
    assert not torch.allclose(trained, exported, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("family, field, value, message", [
    ("qwen3_moe", "rms_norm_eps", -1, "rms_norm_eps = -1: the norms' epsilon must be a positive number"),
    ("qwen3_moe", "rms_norm_eps", 0, "rms_norm_eps = 0: the norms' epsilon must be a positive number"),
    ("qwen3_moe", "max_position_embeddings", -5, "max_position_embeddings = -5: the context length must be a positive"),
    ("qwen3_moe", "num_experts_per_tok", 0, "num_experts_per_tok = 0: a router picks 1 to 4 experts per token"),
    ("qwen3_moe", "num_experts_per_tok", 5, "num_experts_per_tok = 5: a router picks 1 to 4 experts per token"),
    ("deepseek_v3", "n_group", 3, "n_group = 3: the groups must split num_experts 8 evenly"),
    ("deepseek_v3", "topk_group", 5, "topk_group = 5: a router keeps 1 to n_group = 4 groups"),
    ("deepseek_v3", "num_nextn_predict_layers", -1, "num_nextn_predict_layers = -1: an MTP layer count must be"),
    ("deepseek_v3", "num_nextn_predict_layers", "1", "num_nextn_predict_layers = \"1\": an MTP layer count must be"),
    ("deepseek_v3", "num_nextn_predict_layers", None, "num_nextn_predict_layers = null: an MTP layer count must be"),
    ("deepseek_v3", "num_nextn_predict_layers", 1.5, "num_nextn_predict_layers = 1.5: an MTP layer count must be"),
    ("deepseek_v3", "num_nextn_predict_layers", True, "num_nextn_predict_layers = true: an MTP layer count must be"),
])
def test_values_megatron_and_serving_cannot_use_are_refused_before_anything_is_written(
        converted, tmp_path, family, field, value, message):
    hf, ckpt = converted(family)
    bad = Path(shutil.copytree(hf, tmp_path / "hf"))
    cfg = json.loads((bad / "config.json").read_text())
    cfg[field] = value  # null kept: a present null is refused, not read as absent
    (bad / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    _refused(["from-hf", bad, out], [bad], re.escape(message), out=out)
    with pytest.raises(shardwise.InvalidArgumentError, match=re.escape(message)):
        shardwise.from_hf(str(bad), str(out))
    assert not out.exists()
    # to-hf with that config, of a checkpoint of the valid folder: refused before writing, whatever
    # --allow-config-mismatch says.
    extra = ["--allow-config-mismatch", field] if field != "num_nextn_predict_layers" else []
    _refused(["to-hf", ckpt, out, "--hf-config", bad / "config.json", *extra], [bad, ckpt], re.escape(message), out=out)


def _multimodal_release(converted, tmp_path) -> Path:
    """A Qwen3.5-MoE multimodal release (``save_pretrained`` of a random
    ``Qwen3_5MoeForConditionalGeneration``: text model of the qwen3_5_moe family, a vision tower of 2
    blocks)."""
    import transformers

    text = hf_families.FAMILIES["qwen3_5_moe"].hf_config().to_dict()
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, tie_word_embeddings=False,
                                        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                                           out_hidden_size=text["hidden_size"]))
    cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    torch.manual_seed(3)
    transformers.Qwen3_5MoeForConditionalGeneration(cfg).save_pretrained(tmp_path / "release")
    return tmp_path / "release"


@pytest.mark.parametrize("depth", [10**9, 10**6, 3])
def test_a_vision_depth_the_release_does_not_hold_fails_at_once_in_bounded_memory(converted, tmp_path, depth):
    """to-hf --base-hf with vision_config.depth of 10^9 (it grew to 17 GB in 60 s) or 10^6 fails
    within a second, in bounded memory, naming the field and the blocks the release holds."""
    release = _multimodal_release(converted, tmp_path)
    ckpt = tmp_path / "ckpt"
    assert shardwise.from_hf(str(release), str(ckpt), dtype="fp32")["committed"]
    cfg = json.loads((release / "config.json").read_text())
    cfg["vision_config"]["depth"] = depth
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(cfg))
    out = tmp_path / "out"
    code = (f"import resource, time, sys, shardwise\nt = time.monotonic()\n"
            f"try:\n    shardwise.to_hf({str(ckpt)!r}, {str(out)!r}, hf_config={str(bad)!r}, base_hf={str(release)!r})\n"
            f"except shardwise.InvalidArgumentError as e:\n    print(time.monotonic() - t, e)\n"
            f"print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    before = _digests([release, ckpt, bad])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    took, message = r.stdout.splitlines()[0].split(" ", 1)
    rss_kib = int(r.stdout.splitlines()[1])
    assert f"vision_config.depth = {depth}, but --base-hf {release} holds 2 vision blocks (model.visual.blocks.*)" \
        in message, message
    assert float(took) < 1.0, took
    assert rss_kib < 2 << 20, f"{rss_kib} KiB"  # the interpreter with torch: well under 2 GiB
    assert not out.exists() and _digests([release, ckpt, bad]) == before
    _refused(["to-hf", ckpt, out, "--hf-config", bad, "--base-hf", release], [release, ckpt, bad],
             re.escape(f"vision_config.depth = {depth}"), out=out)


def test_megatrons_vocabulary_padding_is_the_rule_and_no_more(converted, tmp_path):
    """250 tokens at TP 4 pad to 512 (Megatron's ceil(250 / (128 x 4)) x 512, more padding rows than
    tokens): from-hf converts it, records it, and to-hf gives the input back bitwise."""
    hf, _ = converted("llama")
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    r = _cli("from-hf", hf, ckpt, "--dtype", "fp32", "--tensor-model-parallel-size", 4, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["committed"] and summary["padded_vocab_size"] == 512, summary
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    assert md.state_dict_metadata["embedding.word_embeddings.weight"].size[0] == 512
    s = shardwise.to_hf(str(ckpt), str(back), hf_config=str(hf / "config.json"))
    assert s["args_check"] == "passed" and s["padding_rows_dropped"] == 262, s
    want, got = hf_families._folder_tensors(str(hf)), hf_families._folder_tensors(str(back))
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)


def test_allow_config_mismatch_is_validated(converted, tmp_path):
    """A list of str, each a field the family compares: anything else is refused before anything is
    read or written, in Python and on the command line."""
    hf, ckpt = converted("llama")
    out = tmp_path / "out"
    for bad in ("rms_norm_eps", [1], ["rms_norm_eps", None], {"rms_norm_eps": 1}):
        with pytest.raises(shardwise.InvalidArgumentError, match="allow_config_mismatch must be a list of str"):
            shardwise.to_hf(str(ckpt), str(out), hf_config=str(hf / "config.json"), allow_config_mismatch=bad)
    with pytest.raises(shardwise.InvalidArgumentError, match="--allow-config-mismatch \"num_expert_per_tok\": llama "
                                                             "compares no such field"):
        shardwise.to_hf(str(ckpt), str(out), hf_config=str(hf / "config.json"),
                        allow_config_mismatch=["num_expert_per_tok"])
    _refused(["to-hf", ckpt, out, "--hf-config", hf / "config.json", "--allow-config-mismatch", "rms_norm_epsilon"],
             [hf, ckpt], "llama compares no such field .*rms_norm_eps", out=out)
    assert not out.exists()


def test_the_defaults_compared_for_a_missing_field_are_transformers():
    """The defaults shardwise reads a config.json's missing field as (``ArchSpec::defaults`` in
    crates/shardwise-hf/src/families.rs) are those of the installed transformers' config classes."""
    from transformers import CONFIG_MAPPING

    src = (Path(__file__).resolve().parents[2] / "crates/shardwise-hf/src/families.rs").read_text()
    specs = re.findall(r'model_types: &\[([^\]]*)\].*?defaults: r#"(.*?)"#', src, re.S)
    assert len(specs) == 14, len(specs)
    for types, defaults in specs:
        names = re.findall(r'"([a-z0-9_]+)"', types)
        model_type = names[-1]  # the text model's config class of a multimodal family
        cfg = CONFIG_MAPPING[model_type]()
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        for k, want in json.loads(defaults).items():
            if k == "rope_parameters":
                got = {f: rope.get(f) for f in want}
            elif k in ("rope_theta", "partial_rotary_factor"):
                got = rope.get(k, 1.0 if k == "partial_rotary_factor" else None)
            elif k == "index_topk" or hasattr(cfg, k):
                got = getattr(cfg, k)
            else:
                got = None
            assert got == want, (model_type, k, got, want)
