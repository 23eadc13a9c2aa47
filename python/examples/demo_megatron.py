"""Demo: 4 CPU ranks (TP=2 x DP=2, gloo) save a real megatron-core GPT with shardwise, the
`shardwise` CLI shows the layout (`status --keys`, `inspect`) and checks it (`verify`), and
unmodified Megatron loads it back into a freshly initialised model and reports equality. Then the
round trip users live in: an HF release (a small random Qwen3 from transformers) goes through
`shardwise from-hf`, 4 Megatron ranks load it, train 2 steps and save each with shardwise (async),
`shardwise to-hf` exports the last save, and transformers' logits on it equal the trained Megatron
model's. The checkpoint is kept; the last lines say where it is and what to try on it.

Run: make demo   (or: python python/examples/demo_megatron.py [CHECKPOINT_DIR])
"""

import os
import subprocess
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
warnings.filterwarnings("ignore")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

from mcore import build_gpt, init_gloo, model_tensors, spawn  # noqa: E402


def save_rank(rank, world, port, ckpt):
    init_gloo(rank, world, port)
    from megatron.core import parallel_state as ps

    import shardwise.megatron

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = build_gpt(seed=1)
    report = shardwise.megatron.save(model.sharded_state_dict(), ckpt, timeout_s=120)
    return {"report": report}


def load_rank(rank, world, port, ckpt):
    init_gloo(rank, world, port)
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    original = model_tensors(build_gpt(seed=1))
    fresh = build_gpt(seed=2)
    differed = sum(not torch.equal(original[k], v) for k, v in model_tensors(fresh).items())
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt))
    loaded = model_tensors(fresh)
    equal = sum(torch.equal(original[k], loaded[k]) for k in original)
    return {"tensors": len(original), "equal": equal, "differed_before": differed}


def hf_round_trip(work) -> bool:
    """HF release -> from-hf -> Megatron training (4 ranks, shardwise async saves) -> to-hf ->
    transformers; True when transformers' logits equal the trained Megatron model's."""
    import torch

    import hf_families

    fam = hf_families.FAMILIES["qwen3"]
    release, ckpt, run, out = (os.path.join(work, d) for d in ("hf_release", "from_hf", "run", "hf_trained"))
    print(f"== 6. An HF release (a random Qwen3 from transformers' save_pretrained) into a Megatron checkpoint: "
          f"shardwise from-hf {release} {ckpt}")
    hf_families.random_hf_model(fam.hf_config(), release)
    shardwise_cli("from-hf", release, ckpt, "--dtype", "fp32", "--transformer-impl", fam.transformer_impl,
                  "--tensor-model-parallel-size", "2")
    print("== 7. 4 ranks (TP=2 x DP=2) load it with megatron-core, train 2 steps, save each with "
          "shardwise.megatron.save(async_save=True)")
    results = spawn(hf_families.train_and_save, 4, os.path.join(work, "train"), "qwen3", ckpt, run, 2, timeout_s=600)
    for r in results:
        if not r.get("ok"):
            sys.exit(f"rank {r['rank']} failed: {r.get('error')}\n{r.get('traceback', '')}")
    print(f"   saves committed: {[s['committed'] for s in results[0]['reports']]}")
    last = os.path.join(run, "iter_0000002")
    print(f"== 8. shardwise to-hf {last} {out} --hf-config {release}/config.json")
    shardwise_cli("to-hf", last, out, "--hf-config", os.path.join(release, "config.json"))
    print("== 9. transformers loads the export; its logits against the trained Megatron model's")
    logits, info = hf_families.hf_load_and_logits(out)
    want = torch.load(os.path.join(run, "logits.pt"))
    diff = ((logits - want).abs().max() / want.abs().max()).item()
    missing = len(info["missing_keys"]) + len(info["mismatched_keys"])
    print(f"   missing or mismatched weights: {missing}; max relative logit difference {diff:.1e}")
    return missing == 0 and diff <= 1e-4


def shardwise_cli(*args):
    """Runs the installed `shardwise` command, as a user would."""
    sys.stdout.flush()
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "shardwise"), *args], check=True)


def human(n: int) -> str:
    """Bytes for people (binary units, as the CLI prints them)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def main():
    ckpt = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(prefix="shardwise_demo_"), "iter_0000001")
    work = tempfile.mkdtemp(prefix="shardwise_demo_run_")
    print(f"== 1. Saving a megatron-core GPTModel (TP=2 x DP=2, 4 gloo CPU ranks) with shardwise into {ckpt}")
    results = spawn(save_rank, 4, os.path.join(work, "save"), ckpt, timeout_s=300)
    for r in results:
        if not r.get("ok"):
            sys.exit(f"rank {r['rank']} failed: {r.get('error')}\n{r.get('traceback', '')}")
        rep = r["report"]
        wrote = (f"wrote {human(rep['data_bytes'])} to {rep['data_file']}" if rep["data_file"]
                 else "wrote no data file (a DP replica: its tensors' main replicas are on other ranks)")
        print(f"   rank {r['rank']}: {wrote}; {'committed' if rep['committed'] else 'not committed'}")
    print(f"   files: {', '.join(sorted(os.listdir(ckpt)))}")

    print("== 2. shardwise status --keys (the save's per-rank parts and the layout they describe)")
    shardwise_cli("status", "--keys", ckpt)
    print("== 3. shardwise inspect (the committed .metadata, as torch and Megatron will read it)")
    shardwise_cli("inspect", ckpt)
    print("== 4. shardwise verify (bounds, coverage, decoding, every CRC-32)")
    shardwise_cli("verify", ckpt)

    print("== 5. Loading with unmodified megatron.core.dist_checkpointing.load into a fresh model (same layout)")
    results = spawn(load_rank, 4, os.path.join(work, "load"), ckpt, timeout_s=300)
    ok = True
    for r in results:
        if not r.get("ok"):
            sys.exit(f"rank {r['rank']} failed: {r.get('error')}\n{r.get('traceback', '')}")
        same = r["equal"] == r["tensors"]
        ok &= same and r["differed_before"] > 0
        print(f"   rank {r['rank']}: {r['equal']}/{r['tensors']} tensors bitwise equal after load "
              f"({r['differed_before']} differed before loading)")
    hf_ok = hf_round_trip(work)
    print("RESULT:", "all tensors equal" if ok else "MISMATCH", "|",
          "HF -> Megatron -> trained -> HF logits equal" if hf_ok else "HF ROUND TRIP MISMATCH")
    ok &= hf_ok
    print(f"""
The checkpoint is in {ckpt}. Try:
  .venv/bin/shardwise inspect --json {ckpt} | head -30
  .venv/bin/shardwise status {ckpt}
  .venv/bin/python -c "import shardwise; r = shardwise.open('{ckpt}'); print(r); print(r.read('embedding.word_embeddings.weight').shape)"
  make test        # every test: cargo test + pytest (torch, megatron-core, gloo processes)
The README has a quick start; docs/megatron.md covers the Python API (shardwise.megatron.save, the drop-in install()), docs/hf.md to-hf and from-hf, docs/object-storage.md object stores.""")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
