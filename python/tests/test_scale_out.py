"""Conversions split over the engines users run (issue 37 item 4): the Slurm array recipe
(``python/examples/slurm_to_hf.sbatch``, run as Slurm runs each array task), and Ray tasks
(``shardwise.ray``) on a local Ray cluster: 4 parts give the one-process output byte for byte, and a
part whose worker is SIGKILLed mid-write is retried by Ray and the folder committed is still
identical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardwise

SBATCH = Path(__file__).parents[1] / "examples" / "slurm_to_hf.sbatch"


def _files(d: Path) -> dict:
    """Every file of a conversion's output, by name (the save machinery's state aside)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and ".shardwise" not in p.parts}


def _llama(d: Path, hidden: int, ffn: int, layers: int, vocab: int) -> Path:
    g = torch.Generator().manual_seed(1)
    t = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden], "lm_head.weight": [vocab, hidden]}
    for l in range(layers):
        p = f"model.layers.{l}."
        t |= {p + "input_layernorm.weight": [hidden], p + "post_attention_layernorm.weight": [hidden],
              p + "self_attn.q_proj.weight": [hidden, hidden], p + "self_attn.k_proj.weight": [hidden // 2, hidden],
              p + "self_attn.v_proj.weight": [hidden // 2, hidden], p + "self_attn.o_proj.weight": [hidden, hidden],
              p + "mlp.gate_proj.weight": [ffn, hidden], p + "mlp.up_proj.weight": [ffn, hidden],
              p + "mlp.down_proj.weight": [hidden, ffn]}
    d.mkdir(parents=True)
    save_file({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in t.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "dtype": "bfloat16"}))
    return d


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small HF folder and its one-process from-hf checkpoint."""
    base = tmp_path_factory.mktemp("scale_out")
    hf = _llama(base / "hf", hidden=64, ffn=128, layers=2, vocab=256)
    shardwise.from_hf(str(hf), str(base / "ck1"), transformer_impl="local")
    return hf, base / "ck1"


def test_the_slurm_array_recipe_writes_the_one_process_output(small, tmp_path):
    hf, ckpt = small
    one, arr = tmp_path / "one", tmp_path / "array"
    shardwise.to_hf(str(ckpt), str(one), hf_config=str(hf / "config.json"), max_shard_size="40KB")
    bin_dir = str(Path(sys.executable).parent)  # the venv's `shardwise` command, as a job's PATH has it

    def task(i: int, count: int):  # Slurm's variables for array task i of an array of `count` tasks
        env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"], "SLURM_ARRAY_TASK_ID": str(i),
               "SLURM_ARRAY_TASK_COUNT": str(count), "SLURM_CPUS_PER_TASK": "1"}
        r = subprocess.run(["bash", str(SBATCH), ckpt, arr, hf / "config.json", "4", "--max-shard-size", "40KB"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr

    for i in (2, 0, 3):  # `--array=0-3`: tasks start in any order; task 1 is lost
        task(i, 4)
    assert not (arr / "model.safetensors.index.json").exists()
    task(1, 1)  # resubmitted alone (`--array=1`): Slurm says 1 task, the part count is still 4
    assert len(_files(one)) > 4 and _files(arr) == _files(one)


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_four_ray_tasks_write_the_one_process_output_byte_for_byte(cluster, small, tmp_path):
    import shardwise.ray as swray

    hf, one = small
    four = tmp_path / "ck4"
    done = swray.from_hf(str(hf), str(four), parts=4, transformer_impl="local")
    assert [s["part"] for s in done] == ["0/4", "1/4", "2/4", "3/4"] and any(s["committed"] for s in done)
    assert _files(four) == _files(one)
    h1, h4 = tmp_path / "h1", tmp_path / "h4"
    shardwise.to_hf(str(one), str(h1), hf_config=str(hf / "config.json"), max_shard_size="40KB")
    swray.to_hf(str(one), str(h4), parts=4, hf_config=str(hf / "config.json"), max_shard_size="40KB")
    assert len(_files(h1)) > 4 and _files(h4) == _files(h1)
    with pytest.raises(shardwise.InvalidArgumentError, match="parts must be"):
        swray.to_hf(str(one), str(tmp_path / "h0"), parts=0)


def _writers(out: Path) -> set[int]:
    """Processes (other than this one) with a file open under ``out``."""
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(out) + "/") for fd in fds):
                pids.add(int(pid))
        except OSError:
            continue
    return pids


def test_a_task_killed_mid_write_is_retried_and_the_folder_is_identical(cluster, tmp_path):
    import shardwise.ray as swray

    hf = _llama(tmp_path / "hf", hidden=512, ffn=2048, layers=4, vocab=16384)  # 64 MB of bf16
    ckpt = tmp_path / "ckpt"
    shardwise.from_hf(str(hf), str(ckpt), transformer_impl="local", dtype="fp32")
    one = tmp_path / "one"
    opts = dict(hf_config=str(hf / "config.json"), dtype="bf16", max_shard_size="4MB", workers=1)
    shardwise.to_hf(str(ckpt), str(one), **opts)
    out = tmp_path / "out"
    result = {}
    run = threading.Thread(target=lambda: result.update(done=swray.to_hf(str(ckpt), str(out), parts=4, **opts)))
    run.start()
    killed, t0 = None, time.monotonic()
    while killed is None and run.is_alive() and time.monotonic() - t0 < 120:
        for pid in _writers(out):
            os.kill(pid, signal.SIGKILL)  # a Ray worker writing its part's shard files
            killed = pid
            break
    run.join(timeout=300)
    assert killed is not None, "no task was caught writing"
    assert "done" in result and any(s["committed"] for s in result["done"]), result
    assert _files(out) == _files(one)
