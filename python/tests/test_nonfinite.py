"""Non-finite weights (issue 44): ``to-hf --quantize`` refuses a NaN or an infinity in any weight it
quantizes, in every format, naming the tensor and the count, with nothing written and the checkpoint
unchanged; ``--allow-nonfinite`` writes it as before, with a warning per tensor whose claim is checked
with compressed-tensors' own decompressor; plain ``to-hf`` and ``from-hf`` report each tensor's count
(summary, ``--json``, the CLI's stderr), which the files themselves confirm (safetensors, torch DCP's
own load of the checkpoint). Measured on main before the change: the NaN became a finite NVFP4 code,
the infinity gave the fused q/k/v a global scale of 0 (q_proj and v_proj dequantized to NaN), block
FP8 wrote ``weight_scale_inv = inf``, and every run exited 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_families
import shardwise
from dcp_util import tree_digest

CLI = [sys.executable, "-m", "shardwise.cli"]
Q0 = "model.layers.0.self_attn.q_proj.weight"
K1 = "model.layers.1.self_attn.k_proj.weight"
# Every --quantize format that llama's linears can be written in (mxfp4 is gpt_oss's experts: its
# own case below), as (quantize, quantize_format).
FORMATS = [("fp8-block", None), ("nvfp4", None), ("nvfp4", "modelopt"), ("mxfp8", None)]


def _hf_tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _poison(hf: Path, values: dict) -> None:
    """Sets ``values`` ({name: [(row, col, value)]}) in the HF folder's weights."""
    (f,) = hf.glob("*.safetensors")
    t = load_file(str(f))
    for name, cells in values.items():
        for r, c, v in cells:
            t[name][r, c] = v
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random llama folder with a NaN in layer 0's q_proj and +Inf, -Inf in layer 1's k_proj,
    converted by from-hf (bf16); its summary."""
    base = tmp_path_factory.mktemp("nonfinite")
    fam = hf_families.FAMILIES["llama"]
    hf_families.random_hf_model(fam.hf_config(), str(base / "hf"))
    _poison(base / "hf", {Q0: [(3, 5, float("nan"))], K1: [(0, 0, float("inf")), (7, 1, float("-inf"))]})
    summary = shardwise.from_hf(str(base / "hf"), str(base / "ckpt"), dtype="bf16",
                                transformer_impl=fam.transformer_impl)
    return base, summary


def test_from_hf_reports_each_tensor_and_torch_loads_what_it_says(llama, tmp_path):
    base, summary = llama
    assert summary["committed"] and summary["nonfinite"] == {Q0: 1, K1: 2}, summary["nonfinite"]
    # The CLI prints them on stderr and --json carries them; not refused (exit 0).
    r = subprocess.run([*CLI, "from-hf", str(base / "hf"), str(tmp_path / "c"), "--dtype", "bf16", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["nonfinite"] == {Q0: 1, K1: 2}
    assert f"2 tensors hold NaN or infinite values, written as they are: {Q0} (1), {K1} (2)" in r.stderr, r.stderr
    # torch DCP's own load of the checkpoint finds those values in the fused linear_qkv weights.
    import torch.distributed.checkpoint as dcp

    key = "decoder.layers.self_attention.linear_qkv.weight"  # stacked: [layers, qkv rows, hidden]
    state = {key: torch.empty(shardwise.open(base / "ckpt").metadata(key)["global_shape"], dtype=torch.bfloat16)}
    dcp.load(state, checkpoint_id=str(base / "ckpt"), no_dist=True)
    counts = [(int(w.isnan().sum()), int(w.isinf().sum())) for w in state[key]]
    assert counts == [(1, 0), (0, 2)], counts


@pytest.mark.parametrize("quantize, layout", FORMATS)
def test_quantize_refuses_nonfinite_weights_before_writing(llama, tmp_path, quantize, layout):
    base, _ = llama
    ckpt, config = base / "ckpt", base / "hf" / "config.json"
    before = tree_digest(ckpt)
    out = tmp_path / "out"
    kw = {} if layout is None else {"quantize_format": layout}
    with pytest.raises(shardwise.ValidationError) as e:
        shardwise.to_hf(str(ckpt), str(out), hf_config=str(config), quantize=quantize, workers=1, **kw)
    msg = str(e.value)
    # Layer 0's q_proj comes first in the tensor order; with one worker it is the one named.
    assert f"--quantize {quantize}: {Q0} holds 1 non-finite value (1 NaN, 0 infinite) as bfloat16" in msg, msg
    assert "--allow-nonfinite" in msg and "nothing was written" in msg
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    # Through the CLI: exit 1, the same message, nothing written; into an existing empty folder too.
    out.mkdir()
    args = [*CLI, "to-hf", str(ckpt), str(out), "--hf-config", str(config), "--quantize", quantize, "--workers", "1"]
    r = subprocess.run(args + ([] if layout is None else ["--quantize-format", layout]),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and f"{Q0} holds 1 non-finite value" in r.stderr, (r.returncode, r.stderr)
    assert list(out.iterdir()) == []
    assert tree_digest(ckpt) == before, "the checkpoint changed"


def test_an_infinity_alone_is_refused_too_and_named(llama, tmp_path):
    """The infinity in k_proj (whose clean q_proj and v_proj would dequantize to NaN under NVFP4's
    shared tensor scale) is named, with its count, once the NaN is out of the way."""
    base, _ = llama
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in (base / "hf").iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    _poison(hf, {Q0: [(3, 5, 0.0)]})
    fam = hf_families.FAMILIES["llama"]
    s = shardwise.from_hf(str(hf), str(tmp_path / "ckpt"), dtype="bf16", transformer_impl=fam.transformer_impl)
    assert s["nonfinite"] == {K1: 2}
    with pytest.raises(shardwise.ValidationError, match=f"--quantize nvfp4: {K1} holds 2 non-finite values "
                                                        r"\(0 NaN, 2 infinite\)"):
        shardwise.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), hf_config=str(hf / "config.json"),
                        quantize="nvfp4")
    assert not (tmp_path / "out").exists()


def test_allow_nonfinite_writes_as_before_and_warns_truly(llama, tmp_path):
    base, _ = llama
    ckpt, config = str(base / "ckpt"), str(base / "hf" / "config.json")
    out = tmp_path / "nvfp4"
    s = shardwise.to_hf(ckpt, str(out), hf_config=config, quantize="nvfp4", allow_nonfinite=True)
    assert s["committed"] and s["nonfinite"] == {Q0: 1, K1: 2}, s["nonfinite"]
    warned = [w for w in s["warnings"] if "--allow-nonfinite" in w]
    assert len(warned) == 2 and warned[0].startswith(f"{Q0} holds 1 non-finite value (1 NaN, 0 infinite)")
    assert warned[1].startswith(f"{K1} holds 2 non-finite values (0 NaN, 2 infinite)"), warned
    # What the warning says, by compressed-tensors' own decompressor: the infinity gave layer 1's
    # fused q/k/v a global scale of 0, so its clean q_proj and v_proj dequantize to NaN too, and the
    # NaN of layer 0's q_proj became finite codes.
    from test_hf_families import _ct_dequantize

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    deq = _ct_dequantize(_hf_tensors(out), qc)
    layer1 = "model.layers.1.self_attn."
    assert all(deq[layer1 + p].isnan().all() for p in ("q_proj.weight", "v_proj.weight"))
    assert not deq[Q0].isnan().any() and deq[Q0].isfinite().all()
    # Block FP8: the infinity's block gets weight_scale_inv = inf.
    fp8 = tmp_path / "fp8"
    s = shardwise.to_hf(ckpt, str(fp8), hf_config=config, quantize="fp8-block", allow_nonfinite=True)
    assert s["nonfinite"] == {Q0: 1, K1: 2}
    assert _hf_tensors(fp8)[K1 + "_scale_inv"].isinf().any()
    # The CLI: exit 0, a warning per tensor on stderr.
    r = subprocess.run([*CLI, "to-hf", ckpt, str(tmp_path / "cli"), "--hf-config", config, "--quantize", "mxfp8",
                        "--allow-nonfinite", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["nonfinite"] == {Q0: 1, K1: 2}
    assert r.stderr.count("quantized anyway (--allow-nonfinite, mxfp8)") == 2, r.stderr


def test_plain_to_hf_reports_what_the_files_hold(llama, tmp_path):
    base, _ = llama
    ckpt, config = str(base / "ckpt"), str(base / "hf" / "config.json")
    for dtype in ("bf16", "fp32"):
        out = tmp_path / dtype
        s = shardwise.to_hf(ckpt, str(out), hf_config=config, dtype=dtype)
        assert s["committed"] and s["nonfinite"] == {Q0: 1, K1: 2}, s["nonfinite"]
        files = _hf_tensors(out)
        found = {k: int((~v.isfinite()).sum()) for k, v in files.items() if not v.isfinite().all()}
        assert found == s["nonfinite"]
    r = subprocess.run([*CLI, "to-hf", ckpt, str(tmp_path / "cli"), "--hf-config", config, "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["nonfinite"] == {Q0: 1, K1: 2}, r.stderr
    assert f"written as they are: {Q0} (1), {K1} (2)" in r.stderr, r.stderr
    # A clean checkpoint reports none.
    clean = tmp_path / "clean"
    fam = hf_families.FAMILIES["llama"]
    hf_families.random_hf_model(fam.hf_config(), str(clean / "hf"))
    s = shardwise.from_hf(str(clean / "hf"), str(clean / "ckpt"), transformer_impl=fam.transformer_impl)
    assert s["nonfinite"] == {}
    s = shardwise.to_hf(str(clean / "ckpt"), str(clean / "out"), quantize="nvfp4",
                        hf_config=str(clean / "hf" / "config.json"))
    assert s["nonfinite"] == {} and not any("non-finite" in w for w in s["warnings"])


def test_mxfp4_refuses_a_nan_in_gpt_oss_experts(tmp_path):
    fam = hf_families.FAMILIES["gpt_oss"]
    hf = tmp_path / "hf"
    hf_families.random_hf_model(fam.hf_config(), str(hf))
    (f,) = hf.glob("*.safetensors")
    t = load_file(str(f))
    name = next(k for k in sorted(t) if k.endswith("mlp.experts.down_proj"))
    t[name][1, 2, 3] = float("nan")
    save_file(t, str(f), metadata={"format": "pt"})
    s = shardwise.from_hf(str(hf), str(tmp_path / "ckpt"), dtype="bf16", transformer_impl=fam.transformer_impl)
    assert s["nonfinite"] == {name: 1}
    before = tree_digest(tmp_path / "ckpt")
    with pytest.raises(shardwise.ValidationError, match=f"--quantize mxfp4: {name} holds 1 non-finite value"):
        shardwise.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), hf_config=str(hf / "config.json"),
                        quantize="mxfp4")
    assert not (tmp_path / "out").exists() and tree_digest(tmp_path / "ckpt") == before
