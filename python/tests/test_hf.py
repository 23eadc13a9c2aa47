"""`shardwise to-hf`: real megatron-core models (llama, qwen3, qwen3_moe shapes) saved at TP=2 (EP=2
for MoE) by Megatron's own torch_dist and by shardwise, converted, and loaded by `transformers`:
the logits on fixed tokens equal the Megatron model's forward output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import hf_workers
import shardwise
from dcp_util import row_shard, save_ranks
from mcore import spawn

ARCHS = ["llama", "qwen3", "qwen3_moe"]


@pytest.fixture(scope="session", params=ARCHS)
def saved(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(request.param)
    world = 2
    results = spawn(hf_workers.save_and_forward, world, str(base / "out"), str(base), request.param, timeout_s=600)
    failed = [r for r in results if not r.get("ok")]
    assert not failed, "\n".join(f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}" for r in failed)
    return request.param, base


def _hf_logits(out_dir):
    """Logits of the folder loaded with the class its config.json declares (what serving engines use)."""
    import hf_families

    model = hf_families.declared_class(str(out_dir)).from_pretrained(str(out_dir), torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(hf_workers.TOKENS).logits[0]


@pytest.mark.parametrize("writer", ["megatron", "shardwise"])
def test_converted_model_matches_megatron_logits(saved, writer, tmp_path):
    arch, base = saved
    out = tmp_path / "hf"
    summary = shardwise.to_hf(str(base / writer), str(out), hf_config=str(base / "hf_config" / "config.json"),
                              max_shard_size="100KB")
    assert summary["files"] > 1 and summary["tensors"] >= 20
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == summary["tensors"]
    expected = torch.load(base / "logits.pt")
    got = _hf_logits(out)
    assert got.shape == expected.shape  # vocabulary padding trimmed: 256 -> 250
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_cli_to_hf_with_dtype_and_json(saved, tmp_path):
    arch, base = saved
    if arch != "llama":
        pytest.skip("one architecture is enough for the CLI")
    out = tmp_path / "hf16"
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "to-hf", str(base / "shardwise"), str(out), "--hf-config",
                        str(base / "hf_config" / "config.json"), "--dtype", "bf16", "--threads", "2", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tensors"] >= 20
    from safetensors import safe_open

    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())


def _bad_config(base, tmp_path, **changes):
    cfg = json.loads((base / "hf_config" / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    bad = tmp_path / "bad_config.json"
    bad.write_text(json.dumps(cfg))
    return str(bad)


# Each field the mapping uses, changed in config.json, against the args that Megatron 0.19 stores
# inside the .distcp files (no common.pt) and shardwise stores in common.pt. The error names the
# field and both values. The wrong head split (8 heads of 8 in 4 groups for 4 of 16 in 2) gives
# the same tensor shapes: only the args can refuse it.
FIELD_CASES = {
    "llama": [
        (dict(num_hidden_layers=3), r"num_hidden_layers: config.json says 3, args.num_layers says 2"),
        (dict(hidden_size=32), r"hidden_size: config.json says 32, args.hidden_size says 64"),
        (dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8),
         r"num_attention_heads: config.json says 8, args.num_attention_heads says 4"),
        (dict(num_key_value_heads=4), r"num_key_value_heads: config.json says 4, args.num_query_groups says 2"),
        (dict(head_dim=8), r"head_dim: config.json says 8, args.kv_channels says 16"),
        (dict(intermediate_size=96), r"intermediate_size: config.json says 96, args.ffn_hidden_size says 128"),
        (dict(vocab_size=300), r"vocab_size: config.json says 300, the checkpoint's embedding has 256 rows"),
        (dict(vocab_size=200), r"vocab_size: config.json says 200, args.vocab_size says 250"),
        (dict(tie_word_embeddings=True),
         r"tie_word_embeddings: config.json says true, args.untie_embeddings_and_output_weights says true"),
        (dict(rms_norm_eps=1e-6), r"rms_norm_eps: config.json says 0.000001, args.norm_epsilon says 0.00001"),
    ],
    "qwen3_moe": [
        (dict(num_experts=8), r"num_experts: config.json says 8, args.num_experts says 4"),
        (dict(moe_intermediate_size=16), r"moe_intermediate_size: config.json says 16, args.moe_ffn_hidden_size says 32"),
        (dict(mlp_only_layers=[1]), r"MoE layer pattern .*: config.json gives E- .*args.moe_layer_freq gives EE"),
        (dict(decoder_sparse_step=2), r"MoE layer pattern .*: config.json gives -E .*args.moe_layer_freq gives EE"),
    ],
}


@pytest.mark.parametrize("writer", ["megatron", "shardwise"])
def test_every_config_field_is_checked_against_the_stored_args(saved, writer, tmp_path):
    arch, base = saved
    if arch not in FIELD_CASES:
        pytest.skip("fields of llama and qwen3_moe cover every check row")
    ok = shardwise.to_hf(str(base / writer), str(tmp_path / "ok"), hf_config=str(base / "hf_config" / "config.json"))
    assert ok["args_check"] == "passed" and ok["args_unchecked"] == []
    for i, (changes, message) in enumerate(FIELD_CASES[arch]):
        with pytest.raises(shardwise.ValidationError, match=message):
            shardwise.to_hf(str(base / writer), str(tmp_path / f"o{i}"), hf_config=_bad_config(base, tmp_path, **changes))
        assert not (tmp_path / f"o{i}").exists(), "nothing is written before every check passes"


def test_without_args_the_check_is_skipped_and_said_but_shapes_still_refuse(saved, tmp_path):
    arch, base = saved
    if arch != "llama":
        pytest.skip("one architecture is enough")
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "to-hf", str(base / "noargs"), str(tmp_path / "o"),
                        "--hf-config", str(base / "hf_config" / "config.json"), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["args_check"] == "skipped: no args stored"
    assert "skipped: no args stored" in r.stderr
    # Without args, every field that shapes a tensor is still checked against the tensors.
    for i, (changes, message) in enumerate([
        (dict(intermediate_size=96), r"mlp.gate_proj.weight: the checkpoint's .* gives shape \[128, 64\]; "
                                     r"the config implies \[intermediate_size = 96, hidden_size = 64\]"),
        (dict(hidden_size=32), r"hidden_size = 32"),
        (dict(num_hidden_layers=3), r"num_hidden_layers: config.json says 3, the checkpoint stacks 2 layers"),
        (dict(vocab_size=300), r"vocab_size: config.json says 300, the checkpoint's embedding has 256 rows"),
    ]):
        with pytest.raises(shardwise.ValidationError, match=message):
            shardwise.to_hf(str(base / "noargs"), str(tmp_path / f"o{i}"), hf_config=_bad_config(base, tmp_path, **changes))


def test_a_tensor_the_config_requires_but_never_produced_is_an_error(saved, tmp_path):
    arch, base = saved
    if arch != "llama":
        pytest.skip("one architecture is enough")
    cfg = json.loads((base / "hf_config" / "config.json").read_text())
    cfg["model_type"] = "qwen3"  # qwen3 needs q_norm / k_norm, which a llama checkpoint lacks
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(cfg))
    # The stored args say so first (llama's args: no qk_layernorm); allowed, the tensors still do.
    with pytest.raises(shardwise.ValidationError, match=r"q_norm and k_norm: qwen3 implies it, args.qk_layernorm says false"):
        shardwise.to_hf(str(base / "shardwise"), str(tmp_path / "o"), hf_config=str(bad))
    with pytest.raises(shardwise.ValidationError, match=r"HF tensors the config requires were not produced: .*q_norm"):
        shardwise.to_hf(str(base / "shardwise"), str(tmp_path / "o"), hf_config=str(bad),
                        allow_config_mismatch=["qk_layernorm"])
    assert not list((tmp_path / "o").glob("*.safetensors")) if (tmp_path / "o").exists() else True


def test_unmapped_key_is_an_error_unless_allowed(tmp_path):
    ck = tmp_path / "ck"
    save_ranks(str(ck), [{"m": row_shard("decoder.layers.0.mystery.weight", 0, 1)}])
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
                               "num_key_value_heads": 2, "vocab_size": 4}))
    with pytest.raises(shardwise.ValidationError, match=r"no rule maps these checkpoint keys .*decoder\.layers\.0\.mystery\.weight"):
        shardwise.to_hf(str(ck), str(tmp_path / "o"), hf_config=str(cfg))
    with pytest.raises(shardwise.ValidationError, match="were not produced"):
        shardwise.to_hf(str(ck), str(tmp_path / "o"), hf_config=str(cfg), allow_unmapped=True)


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_output_folder_is_refused_unless_overwrite_which_leaves_nothing_stale(saved, tmp_path):
    arch, base = saved
    if arch != "llama":
        pytest.skip("one architecture is enough")
    ck, cfg = str(base / "shardwise"), str(base / "hf_config" / "config.json")
    # Never into the checkpoint, even with --overwrite, nor into a folder inside it (new or not).
    before = sorted(os.listdir(ck))
    for inside, overwrite in ((ck, True), (os.path.join(ck, "hf", "sub"), False), (ck + "/.shardwise", True)):
        with pytest.raises(shardwise.InvalidArgumentError, match="(is|is inside) the checkpoint directory"):
            shardwise.to_hf(ck, inside, hf_config=cfg, overwrite=overwrite)
    assert sorted(os.listdir(ck)) == before
    out = tmp_path / "hf"
    first = shardwise.to_hf(ck, str(out), hf_config=cfg, max_shard_size="100KB")
    assert first["config_written"] and first["committed"] and first["files"] > 2
    with pytest.raises(shardwise.InvalidArgumentError, match="is not empty .*pass --overwrite"):
        shardwise.to_hf(ck, str(out), hf_config=cfg)
    # The user's own files stay; the earlier conversion's shards (more of them) all go.
    (out / "tokenizer.json").write_text("{}")
    (out / "adapter_model.safetensors").write_bytes(b"mine")
    second = shardwise.to_hf(ck, str(out), hf_config=cfg, max_shard_size="5GB", overwrite=True)
    assert second["files"] == 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted(
        {"model.safetensors.index.json", "config.json", "tokenizer.json", "adapter_model.safetensors",
         *index["weight_map"].values()})
    assert (out / "adapter_model.safetensors").read_bytes() == b"mine"
    # Without --hf-config: the config.json built from the stored args replaces the earlier one.
    (out / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "to-hf", ck, str(out), "--arch", "llama",
                        "--overwrite", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config_written"] is True
    assert "config.json built from the checkpoint's stored args" in r.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (out / "tokenizer.json").exists()


def test_parts_and_workers_write_the_same_bytes_and_commit_once(saved, tmp_path):
    arch, base = saved
    if arch != "qwen3_moe":
        pytest.skip("one architecture is enough")
    ck, cfg = str(base / "megatron"), str(base / "hf_config" / "config.json")
    one = tmp_path / "one"
    shardwise.to_hf(ck, str(one), hf_config=cfg, max_shard_size="50KB", workers=1)
    want = _files(one)
    assert len(want) > 6
    many = tmp_path / "many"
    shardwise.to_hf(ck, str(many), hf_config=cfg, max_shard_size="50KB", workers=4)
    assert _files(many) == want
    split = tmp_path / "split"
    for i in (2, 0):
        s = shardwise.to_hf(ck, str(split), hf_config=cfg, max_shard_size="50KB", part=f"{i}/3")
        assert s["part"] == f"{i}/3" and not s["committed"] and not s["config_written"]
        assert not (split / "model.safetensors.index.json").exists(), "no index before every part is done"
    s = shardwise.to_hf(ck, str(split), hf_config=cfg, max_shard_size="50KB", part="1/3")
    assert s["committed"] and s["config_written"]
    assert _files(split) == want
    assert sorted(p.name for p in split.iterdir()) == sorted(want), "markers and temporary files are gone"
    # Quantized in the same streaming pass (block FP8): the same bytes for any worker count or split,
    # each weight's scale in its weight's file.
    q = dict(hf_config=cfg, max_shard_size="50KB", quantize="fp8-block")
    shardwise.to_hf(ck, str(tmp_path / "q1"), workers=1, **q)
    qwant = _files(tmp_path / "q1")
    shardwise.to_hf(ck, str(tmp_path / "q4"), workers=4, **q)
    assert _files(tmp_path / "q4") == qwant
    for i in (1, 0):
        shardwise.to_hf(ck, str(tmp_path / "qsplit"), part=f"{i}/2", **q)
    assert _files(tmp_path / "qsplit") == qwant
    weight_map = json.loads(qwant["model.safetensors.index.json"])["weight_map"]
    scales = [k for k in weight_map if k.endswith("_scale_inv")]
    assert len(scales) > 10 and all(weight_map[k] == weight_map[k[: -len("_scale_inv")]] for k in scales)
    # A part run again after the commit has nothing to do; a different conversion is refused.
    assert shardwise.to_hf(ck, str(split), hf_config=cfg, max_shard_size="50KB", part="0/3")["files"] == 0
    with pytest.raises(shardwise.InvalidArgumentError, match="not empty"):
        shardwise.to_hf(ck, str(split), hf_config=cfg, max_shard_size="80KB", part="0/2")
    # Parts of two conversions never make one: another checkpoint with the same shapes (another
    # iteration), or a part rerun with other options.
    mixed = tmp_path / "mixed"
    shardwise.to_hf(ck, str(mixed), hf_config=cfg, max_shard_size="50KB", part="0/2")
    with pytest.raises(shardwise.ValidationError, match="another conversion"):
        shardwise.to_hf(str(base / "shardwise"), str(mixed), hf_config=cfg, max_shard_size="50KB", part="1/2")
    assert not (mixed / "model.safetensors.index.json").exists()
    rerun = tmp_path / "rerun"
    other_cfg = tmp_path / "other_config.json"
    other_cfg.write_text(json.dumps({**json.loads(open(cfg).read()), "_name_or_path": "another run"}))
    shardwise.to_hf(ck, str(rerun), hf_config=cfg, max_shard_size="50KB", part="0/2")
    shardwise.to_hf(ck, str(rerun), hf_config=str(other_cfg), max_shard_size="50KB", part="0/2")
    with pytest.raises(shardwise.ValidationError, match="another conversion"):
        shardwise.to_hf(ck, str(rerun), hf_config=cfg, max_shard_size="50KB", part="1/2")
    assert not (rerun / "model.safetensors.index.json").exists()
    # Parts as concurrent processes (as on several machines sharing the folder).
    par = tmp_path / "par"
    procs = [subprocess.Popen([sys.executable, "-m", "shardwise.cli", "to-hf", ck, str(par), "--hf-config", cfg,
                               "--max-shard-size", "50KB", "--part", f"{i}/3", "--workers", "1", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert sum(json.loads(o[0])["files"] for o in outs) == len(want) - 2  # less index and config
    assert _files(par) == want


def test_workers_0_and_more_parts_than_shards_are_refused(saved, tmp_path):
    arch, base = saved
    if arch != "llama":
        pytest.skip("one architecture is enough")
    ck, cfg = str(base / "shardwise"), str(base / "hf_config" / "config.json")
    with pytest.raises(shardwise.InvalidArgumentError, match="workers must be a whole number >= 1, got 0"):
        shardwise.to_hf(ck, str(tmp_path / "w"), hf_config=cfg, workers=0)
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "to-hf", ck, str(tmp_path / "w"), "--hf-config", cfg,
                        "--workers", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--workers 0" in r.stderr, r.stderr
    # 5 GB shards: one file, which two parts cannot share (part 1 would write nothing and wait forever).
    with pytest.raises(shardwise.InvalidArgumentError, match=r"--part 1/2: this conversion has 1 shard file"):
        shardwise.to_hf(ck, str(tmp_path / "p"), hf_config=cfg, part="1/2")
    assert not (tmp_path / "w").exists() and not (tmp_path / "p").exists()


def _big_llama(path, layers=8, hidden=1024, ffn=4096, vocab=1024):
    """A synthetic llama checkpoint of about 540 MB (float32), for the Ctrl-C test: long enough to
    convert that an interrupt lands in the middle."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator().manual_seed(0)

    def t(key, *shape):
        return ShardedTensor.from_rank_offsets(key, torch.randn(*shape, generator=g), replica_id=0)

    sd = {"emb": t("embedding.word_embeddings.weight", vocab, hidden), "out": t("output_layer.weight", vocab, hidden),
          "norm": t("decoder.final_layernorm.weight", hidden)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        sd.update({p + "qkv": t(p + "self_attention.linear_qkv.weight", 3 * hidden, hidden),
                   p + "proj": t(p + "self_attention.linear_proj.weight", hidden, hidden),
                   p + "ln1": t(p + "input_layernorm.weight", hidden), p + "ln2": t(p + "pre_mlp_layernorm.weight", hidden),
                   p + "fc1": t(p + "mlp.linear_fc1.weight", 2 * ffn, hidden),
                   p + "fc2": t(p + "mlp.linear_fc2.weight", hidden, ffn)})
    save_ranks(str(path), [sd])
    cfg = path.parent / "big_config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
                               "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": ffn,
                               "vocab_size": vocab, "tie_word_embeddings": False}))
    return cfg


@pytest.mark.parametrize("how", ["cli", "python"])
def test_ctrl_c_during_to_hf_stops_within_a_second_and_commits_nothing(tmp_path, how):
    """A real SIGINT to a running conversion (the CLI, and shardwise.to_hf in a Python process): it
    stops within a second, commits no index, and leaves no staged shards."""
    import signal
    import time

    ck = tmp_path / "ck"
    cfg = _big_llama(ck)
    out = tmp_path / "hf"
    args = [str(ck), str(out), "--hf-config", str(cfg), "--dtype", "bf16", "--workers", "1",
            "--max-shard-size", "50MB"]
    cmd = ([sys.executable, "-m", "shardwise.cli", "to-hf", *args] if how == "cli" else
           [sys.executable, "-c", "import shardwise, sys; shardwise.to_hf(sys.argv[1], sys.argv[2], hf_config=sys.argv[3], "
            "dtype='bf16', workers=1, max_shard_size='50MB')", str(ck), str(out), str(cfg)])
    # SIGINT as a terminal gives it, whatever this test run inherited (background jobs ignore it).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    staging = out / ".to-hf-staging"
    deadline = time.monotonic() + 120
    while not (staging.exists() and any(staging.iterdir())):  # the shard files exist: tensors are moving
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    stopped = time.monotonic() - t0
    print(f"{how}: stopped {stopped:.3f} s after SIGINT")
    assert proc.returncode != 0, "the conversion finished before the interrupt: make the checkpoint larger"
    assert ("interrupted; nothing committed" if how == "cli" else "KeyboardInterrupt") in err, err
    assert stopped < 1.0
    assert not (out / "model.safetensors.index.json").exists() and not (out / "config.json").exists()
    assert not staging.exists() and not list(out.glob("*.safetensors"))
