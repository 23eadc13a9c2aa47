"""Hostile or careless input to the CLI and the Python API (issue 36): each case, driven the way the
input arrives (a sparse file, a FIFO, absurd numbers in config.json or on the command line, an output
folder that is an input), gets a one-line error with a documented exit code within seconds, never an
abort (exit 134), a panic (101) or a hang, commits nothing, and leaves every input byte-identical.
``docs/guarantees.md`` ("Hostile and careless input") lists each kind with the test here that proves it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardwise
import shardwise.megatron
from dcp_util import row_shard, save_ranks

CLI = [sys.executable, "-m", "shardwise.cli"]

# A llama of 2 layers (hidden 64, 4 heads, 2 KV heads, FFN 128, vocabulary 250): 21 HF tensors.
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 250, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "dtype": "bfloat16"}


def _llama_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": [250, 64], "model.norm.weight": [64], "lm_head.weight": [250, 64]}
    for l in range(2):
        p = f"model.layers.{l}."
        shapes |= {p + "input_layernorm.weight": [64], p + "post_attention_layernorm.weight": [64],
                   p + "self_attn.q_proj.weight": [64, 64], p + "self_attn.k_proj.weight": [32, 64],
                   p + "self_attn.v_proj.weight": [32, 64], p + "self_attn.o_proj.weight": [64, 64],
                   p + "mlp.gate_proj.weight": [128, 64], p + "mlp.up_proj.weight": [128, 64],
                   p + "mlp.down_proj.weight": [64, 128]}
    return {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}


def _hf_folder(d: Path, config: dict = CONFIG) -> Path:
    d.mkdir(parents=True)
    save_file(_llama_tensors(), str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One HF folder, its from-hf checkpoint, and a 2-rank shardwise save, made once."""
    base = tmp_path_factory.mktemp("careless")
    hf = _hf_folder(base / "hf")
    ckpt = base / "ckpt"
    assert shardwise.from_hf(str(hf), str(ckpt), transformer_impl="local")["committed"]
    saved = base / "saved"
    save_ranks(str(saved), [{"w": row_shard("w", r, 2)} for r in range(2)])
    return hf, ckpt, saved


@pytest.fixture()
def inputs(shared, tmp_path):
    """Fresh copies of the shared inputs, for a test that may damage them."""
    return tuple(Path(shutil.copytree(p, tmp_path / p.name, symlinks=True)) for p in shared)


def _digests(paths) -> dict:
    """Every regular file's sha256 below each path; special files (FIFOs) and sparse files by kind and
    size only (reading them would hang or take minutes)."""
    out = {}
    for root in paths:
        for p in sorted(Path(root).rglob("*")):
            st = p.lstat()
            if p.is_file() and not p.is_symlink() and st.st_size < (1 << 30):
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[str(p)] = (st.st_mode, st.st_size)
    return out


def refused(args, inputs, match: str, code: int = 1, out: Path | None = None):
    """Runs the CLI and asserts the four promises: a one-line error matching ``match`` with exit
    ``code`` within 10 s (never 134, an abort, or 101, a panic); nothing committed in ``out``; every
    input byte-identical."""
    before = _digests(inputs)
    t0 = time.monotonic()
    r = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), r.stderr
    assert match in lines[0], lines[0]
    assert took < 10, f"took {took:.1f}s"
    if out is not None:
        assert not (out / ".metadata").exists() and not (out / "model.safetensors.index.json").exists()
    assert _digests(inputs) == before, "an input changed"
    return lines[0]


def _with_config(hf: Path, **fields) -> Path:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(fields)
    for k, v in list(cfg.items()):
        if v is None:
            del cfg[k]
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


# --- 1. aborts: a number from the input sizes an allocation ----------------------------------------


def test_a_sparse_metadata_of_64_gib_is_an_error_not_an_abort(inputs, tmp_path):
    _, _, saved = inputs
    meta = saved / ".metadata"
    meta.unlink()
    with open(meta, "wb") as f:
        f.truncate(64 << 30)  # sparse: no disk used; its decode once reserved memory by its size
    for cmd in ("inspect", "verify"):
        refused([cmd, saved], [saved], "not a readable pickle")
    # The Python API raises instead of killing the interpreter (in a child: an abort would end it).
    code = f"import shardwise\ntry:\n    shardwise.open({str(saved)!r})\nexcept shardwise.CorruptFileError as e:\n    print('raised', e)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "raised" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


def test_a_region_larger_than_memory_is_refused_before_it_is_allocated(inputs):
    from torch.distributed.checkpoint import FileSystemReader
    import pickle

    _, _, saved = inputs
    md = FileSystemReader(str(saved)).read_metadata()
    md.state_dict_metadata["w"].size = torch.Size([3, 400_000_000_000])  # 1.2e12 elements
    (saved / ".metadata").write_bytes(pickle.dumps(md))
    shutil.rmtree(saved / ".shardwise")  # as another writer left it: shardwise refuses a .metadata its commit did not write
    t0 = time.monotonic()
    with pytest.raises(shardwise.ValidationError, match="not covered by the saved chunks"):
        shardwise.open(saved).read("w")
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("layers, match", [
    (10**12, "more than any model holds"),
    (10**9, "more than any model holds"),
    (1000, "num_hidden_layers = 1000, but the HF folder holds only 21 tensors"),
])
def test_absurd_layer_counts_in_config_json(inputs, tmp_path, layers, match):
    hf, ckpt, _ = inputs
    _with_config(hf, num_hidden_layers=layers)
    out = tmp_path / "out"
    refused(["from-hf", hf, out, "--transformer-impl", "local"], [hf], match, out=out)
    with pytest.raises(shardwise.InvalidArgumentError, match=match.split(",")[0]):
        shardwise.from_hf(str(hf), str(out), transformer_impl="local")
    # to-hf with the same config: checked against the checkpoint's chunks (15 of them).
    m = "more than any model holds" if layers > 10**6 else "but the checkpoint holds only"
    refused(["to-hf", ckpt, tmp_path / "hf_out", "--hf-config", hf / "config.json"], [hf, ckpt], m)


@pytest.mark.parametrize("fields, match", [
    ({"hidden_size": -64}, "hidden_size is -64, not a non-negative integer"),
    ({"num_attention_heads": 2.5}, "num_attention_heads is 2.5, not a non-negative integer"),
    ({"model_type": None}, "config.json has no model_type: pass --arch"),
])
def test_misleading_config_messages_name_what_is_wrong(inputs, tmp_path, fields, match):
    hf, _, _ = inputs
    _with_config(hf, **fields)
    refused(["from-hf", hf, tmp_path / "out"], [hf], match, out=tmp_path / "out")


# --- 2. hangs: a FIFO where a file is read; unbounded threads ---------------------------------------


def test_a_fifo_as_metadata_or_config_is_refused_at_once(inputs, tmp_path):
    hf, ckpt, saved = inputs
    (saved / ".metadata").unlink()
    os.mkfifo(saved / ".metadata")
    for cmd in (["inspect", saved], ["verify", saved], ["diff", saved, ckpt]):
        refused(cmd, [saved, ckpt], "not a regular file (a FIFO)", code=2 if cmd[0] == "diff" else 1)
    with pytest.raises(shardwise.StorageError, match="not a regular file"):
        shardwise.open(saved)
    (hf / "config.json").unlink()
    os.mkfifo(hf / "config.json")
    refused(["from-hf", hf, tmp_path / "out"], [hf], "not a regular file (a FIFO)", out=tmp_path / "out")
    refused(["to-hf", ckpt, tmp_path / "out2", "--hf-config", hf / "config.json"], [hf, ckpt],
            "not a regular file (a FIFO)")


def test_worker_counts_are_bounded(inputs, tmp_path):
    hf, ckpt, saved = inputs
    refused(["from-hf", hf, tmp_path / "o", "--workers", "100000"], [hf], "--workers 100000: at most")
    refused(["to-hf", ckpt, tmp_path / "h", "--hf-config", hf / "config.json", "--workers", "100000"],
            [ckpt], "--workers 100000: at most")
    refused(["diff", saved, saved, "--threads", "0"], [saved], "--threads 0: at least one worker", code=2)
    with pytest.raises(shardwise.InvalidArgumentError, match="at most"):
        shardwise.from_hf(str(hf), str(tmp_path / "o"), workers=100000)


# --- 3. inputs destroyed: an output folder that is, holds or lies in an input ------------------------


def test_an_output_folder_that_is_an_input_is_refused_even_with_overwrite(inputs, tmp_path):
    hf, ckpt, _ = inputs
    (ckpt / "tokenizer").mkdir()
    (ckpt / "tokenizer" / "tokenizer.json").write_text("{}")
    cfg = hf / "config.json"
    cases = [
        (["to-hf", ckpt, hf, "--hf-config", cfg, "--overwrite"], "is the --base-hf folder", ["--base-hf", hf]),
        (["to-hf", ckpt, hf, "--hf-config", cfg, "--overwrite"], "contains the --hf-config file", []),
        (["to-hf", ckpt, ckpt / "tokenizer", "--hf-config", cfg], "is inside the checkpoint directory", []),
        (["to-hf", ckpt, tmp_path, "--hf-config", cfg, "--overwrite"], "contains the checkpoint directory", []),
        (["from-hf", hf, hf / "ckpt"], "is inside the HF folder", []),
        (["from-hf", hf, tmp_path, "--overwrite"], "contains the HF folder", []),
    ]
    for args, match, extra in cases:
        refused([*args, *extra], [hf, ckpt], match)
    with pytest.raises(shardwise.InvalidArgumentError, match="is the --base-hf folder"):
        shardwise.to_hf(str(ckpt), str(hf), hf_config=str(cfg), base_hf=str(hf), overwrite=True)


# --- 5. silent nonsense: values that must be >= 1 ----------------------------------------------------


@pytest.mark.parametrize("flag, value, match", [
    ("--tensor-model-parallel-size", 0, "--tensor-model-parallel-size 0: Megatron needs"),
    ("--tensor-model-parallel-size", 4294967295, "divides num_attention_heads (4)"),
    ("--tensor-model-parallel-size", 3, "divides num_attention_heads (4)"),
    ("--make-vocab-size-divisible-by", 0, "--make-vocab-size-divisible-by 0: it must be at least 1"),
    # Megatron's rule pads 250 to 10^12 rows: refused as more memory than the machine has, not aborted.
    ("--make-vocab-size-divisible-by", 10**12, "the padded vocabulary of 1000000000000 rows makes an embedding"),
])
def test_parallel_sizes_megatron_would_refuse_are_refused(inputs, tmp_path, flag, value, match):
    hf, _, _ = inputs
    out = tmp_path / "out"
    refused(["from-hf", hf, out, flag, value], [hf], match, out=out)
    assert not out.exists()


# --- smaller points ----------------------------------------------------------------------------------


def test_a_missing_key_raises_missing_key_error(shared):
    with pytest.raises(shardwise.MissingKeyError, match='no key "missing"'):
        shardwise.open(shared[2]).read("missing")


def test_a_keys_pattern_that_matches_nothing_is_an_error(shared):
    saved = shared[2]
    refused(["diff", saved, saved, "--keys", "no.such.*"], [saved], '--keys "no.such.*" matches no key', code=2)
    r = subprocess.run([*CLI, "diff", saved, saved, "--keys", "w"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_written_config_declares_the_written_dtype(shared, tmp_path):
    hf, ckpt, _ = shared
    for dtype, want in [(None, "bfloat16"), ("fp32", "float32")]:
        out = tmp_path / f"out_{dtype}"
        shardwise.to_hf(str(ckpt), str(out), arch="llama", dtype=dtype)
        assert json.loads((out / "config.json").read_text())["dtype"] == want
        out2 = tmp_path / f"given_{dtype}"
        shardwise.to_hf(str(ckpt), str(out2), hf_config=str(hf / "config.json"), dtype=dtype)
        assert json.loads((out2 / "config.json").read_text())["dtype"] == want


def test_keys_with_control_bytes_are_printed_escaped(tmp_path):
    key = "w\x1b[2J\x07\nforged line"
    save_ranks(str(tmp_path / "c"), [{key: row_shard(key, 0, 1)}])
    r = subprocess.run([*CLI, "inspect", tmp_path / "c"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\\u{1b}[2J\\u{7}\\nforged line" in r.stdout
    assert not any(line.startswith("forged line") for line in r.stdout.splitlines())


# --- found by a hostile pass after the first fixes -----------------------------------------------


def test_an_absurd_world_size_is_refused_not_an_abort(shared, tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    with pytest.raises(shardwise.InvalidArgumentError, match="world_size 1000000000 is not in"):
        shardwise.megatron.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3, 4))}, str(tmp_path / "c"),
                                rank=0, world_size=10**9, timeout_s=1)
    saved = shared[2]
    refused(["merge", saved, "--world-size", "1000000000", "--timeout", "1"], [saved], "world_size 1000000000")


def test_an_output_folder_holding_a_symlinked_weight_file_is_refused(shared, tmp_path):
    hf = shared[0]
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"  # the HF cache's layout
    blobs.mkdir()
    snap.mkdir()
    shutil.copy(hf / "model.safetensors", blobs / "__0_0.distcp")
    (snap / "model.safetensors").symlink_to(blobs / "__0_0.distcp")
    shutil.copy(hf / "config.json", snap / "config.json")
    refused(["from-hf", snap, blobs, "--overwrite"], [blobs, snap], "contains the HF file")


def test_command_line_errors_and_hostile_names_stay_one_line(shared, tmp_path):
    hf, ckpt, saved = shared
    refused(["to-hf", ckpt, tmp_path / "o", "--workers", "-1"], [ckpt], "(see --help)", code=2)
    refused(["diff", saved, saved, "--exclude", "*"], [saved], "--exclude leaves no key", code=2)
    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    from safetensors.torch import load_file
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["evil\x1b[2J\x07\nshardwise: ok"] = torch.zeros(2)
    save_file(tensors, str(bad / "model.safetensors"))
    line = refused(["from-hf", bad, tmp_path / "o2"], [bad], "no rule reads these HF tensors")
    assert "\x1b" not in line and "\\u{1b}[2J" in line


def test_an_empty_checkpoint_path_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    # An empty directory variable (`save(sd, os.environ.get("CKPT", ""))`) used to write a checkpoint
    # into the current directory, then fail on its directory fsync with a message naming no path.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(shardwise.InvalidArgumentError, match="empty checkpoint path"):
        shardwise.megatron.save({"w": torch.ones(4)}, "", rank=0, world_size=1)
    with pytest.raises(shardwise.InvalidArgumentError, match="empty checkpoint path"):
        shardwise.megatron.save({"w": torch.ones(4)}, "file://", rank=0, world_size=1)
    r = subprocess.run([*CLI, "status", ""], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "a value is required for '<DIR>'" in r.stderr, r  # clap: a bad command line
    assert list(tmp_path.iterdir()) == []
