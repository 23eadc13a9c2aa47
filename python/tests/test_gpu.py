"""The GPU path (run on a machine with NVIDIA GPUs; skipped cleanly elsewhere, e.g. in CI).

Real CUDA tensors are copied by shardwise's side stream straight into pinned staging memory (no
``.cpu()``), saved, and read back with plain torch DCP and with Megatron: bitwise equal."""

from __future__ import annotations

import os

import pytest
import torch

import shardwise
import shardwise.megatron as swm
from dcp_util import bits, read_all
from mcore import spawn

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and shardwise.cuda_available()), reason="needs a CUDA GPU and driver"
)

DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _cuda_state(world: int, rank: int, rows: int = 1024, cols: int = 4096):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    state = {}
    for dt in DTYPES:
        x = torch.randn(rows, cols, device="cuda", generator=g)
        x = x.to(dt) if dt.itemsize > 1 else x.clamp(-100, 100).to(dt)
        state[str(dt)] = ShardedTensor.from_rank_offsets(f"w_{str(dt)[6:]}", x, (0, rank, world), replica_id=0)
    return state


@pytest.mark.parametrize("async_save", [False, True])
def test_cuda_tensors_round_trip(tmp_path, async_save):
    state = _cuda_state(1, 0)
    expected = {sh.key: sh.data.cpu() for sh in state.values()}
    out = swm.save(state, str(tmp_path), rank=0, world_size=1, async_save=async_save)
    if async_save:
        for sh in state.values():
            sh.data.zero_()  # the caller may reuse its tensors as soon as save returned
        out = out.wait(120)
    assert out["committed"]
    tensors, _ = read_all(str(tmp_path))
    for k, v in expected.items():
        assert tensors[k].dtype == v.dtype and torch.equal(bits(tensors[k]), bits(v)), k


@pytest.mark.parametrize("async_save", [False, True])
def test_cuda_tensors_to_an_object_store(async_save):
    """The object-store writer fed by the GPU staging path (memory:// is an in-process store: the
    same code as s3:// up to the HTTP client): windows copied out of pinned buffers, parts gathered,
    archive tails filled in order; read back bitwise."""
    import uuid

    state = _cuda_state(1, 0)
    expected = {sh.key: sh.data.cpu() for sh in state.values()}
    url = f"memory://gpu/{uuid.uuid4().hex}"
    out = swm.save(state, url, rank=0, world_size=1, async_save=async_save)
    if async_save:
        for sh in state.values():
            sh.data.zero_()
        out = out.wait(120)
    assert out["committed"]
    ckpt = shardwise.open(url)
    for k, v in expected.items():
        assert torch.equal(bits(ckpt.read(k)), bits(v)), k


@pytest.mark.parametrize("async_save", [False, True])
def test_a_kernel_still_writing_is_not_torn(tmp_path, async_save):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    x = torch.zeros(64 << 20, device="cuda")  # 256 MiB
    torch.cuda._sleep(200_000_000)  # keeps the current stream busy for ~0.1 s
    x.fill_(3.0)  # queued behind the sleep: not run yet when save() is called
    out = swm.save({"x": ShardedTensor.from_rank_offsets("x", x, replica_id=0)}, str(tmp_path), rank=0, world_size=1,
                   async_save=async_save)
    if async_save:
        out.wait(120)
    tensors, _ = read_all(str(tmp_path))
    assert bool((tensors["x"] == 3.0).all()), "the copy ran before the pending kernel finished"


def _tp2_worker(rank, world, port, base):
    import torch.distributed as dist

    from mcore import build_gpt, model_tensors

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = build_gpt(1).cuda().to(torch.bfloat16)
    report = swm.save(model.sharded_state_dict(), os.path.join(base, "ckpt"), timeout_s=120)
    fresh = build_gpt(2).cuda().to(torch.bfloat16)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), os.path.join(base, "ckpt")))
    a, b = model_tensors(model), model_tensors(fresh)
    return {"compared": len(a), "not_equal": [k for k in a if not torch.equal(a[k], b[k])], "report": report}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_megatron_gpt_tp2_on_two_gpus_with_nccl(tmp_path):
    results = spawn(_tp2_worker, 2, str(tmp_path / "out"), str(tmp_path), timeout_s=300)
    for r in results:
        assert r.get("ok"), r.get("error", "") + r.get("traceback", "")
        assert r["compared"] >= 10 and r["not_equal"] == [], r


def test_load_into_cuda_tensors(tmp_path):
    """``Checkpoint.load_into`` into CUDA tensors (pinned staging, 2-d host-to-device copies on a side
    stream ordered before the caller's stream): whole tensors of every dtype, regions across chunks,
    strided column bands, host and device destinations in one call, and a 1 MiB staging budget
    (buffers reused while their copies may still run): bitwise equal to torch DCP's load on the CPU."""
    from load_util import dcp_tensors, request, save_grid
    from shardwise import _native

    d = tmp_path / "ckpt"
    save_grid(d)
    full = dcp_tensors(d)
    ck = _native.open_checkpoint(str(d))
    wanted = [(k, ()) for k in full] + [
        (k, idx)
        for k in full
        if k != "big"
        for idx in [(slice(3, 15), slice(4, 17)), (slice(None), slice(7, 13)), (slice(17, 18), slice(19, 20))]
    ] + [("big", (slice(1000, 3100),)), ("big", (slice(None), slice(3, 1000)))]
    for budget in (None, 1 << 20):
        reqs, outs = [], []
        for n, (key, idx) in enumerate(wanted):
            r, o = request(key, idx, full[key], device="cpu" if n % 5 == 4 else "cuda")
            reqs.append(r)
            outs.append(o)
        torch.cuda._sleep(100_000_000)  # the caller's stream is busy: copies must wait for it
        stats = ck.load_into(reqs, staging_budget_bytes=budget, cuda_stream=torch.cuda.current_stream().cuda_stream)
        assert stats["items_checked"] > 0
        for o, (key, idx) in zip(outs, wanted):
            want = full[key][idx] if idx else full[key]
            assert torch.equal(bits(o.cpu()), bits(want)), (key, idx, budget)


def test_reserve_staging_then_async_save_round_trips(tmp_path):
    """A save that arrives while the reservation is still pinning uses the buffers pinned so far
    and pins the rest itself; the bytes are the tensors' as they were at the call."""
    state = _cuda_state(1, 0, rows=4096, cols=4096)  # 64 MiB per key
    r = swm.reserve_staging(state)
    assert r["pinned"] and r["buffers"] >= 2
    want = {sh.key: sh.data.cpu().clone() for sh in state.values()}
    h = swm.save(state, str(tmp_path), rank=0, world_size=1, async_save=True)
    for v in state.values():
        v.data.zero_()
    h.wait(120)
    tensors, _ = read_all(str(tmp_path))
    for k, v in want.items():
        assert torch.equal(tensors[k].cpu(), v), k
