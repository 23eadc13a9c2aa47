"""Rank bodies for the torch DCP ``use_collectives=False`` tests (run by ``mcore.spawn`` on gloo/CPU).

The state dict is that of a small FSDP2-style job: DTensors sharded on dim 0 over a 1-D mesh of
all ranks (rows that do not divide evenly, so the last rank holds fewer or none), one sharded on
dim 1 in bfloat16, a plain tensor every rank holds in full (replicated), and byte objects (a
step counter every rank saves, and a per-rank dataloader state). Every value is a function of the
key and ``step`` alone, so any world size can build the expected full tensors.
"""

from __future__ import annotations

import torch

SHAPES = {"model.w": ((10, 6), torch.float32, 0), "model.b": ((7,), torch.float32, 0),
          "model.emb": ((4, 9), torch.bfloat16, 1), "optim.exp_avg.w": ((10, 6), torch.float32, 0)}


def full(key: str, step: int) -> torch.Tensor:
    shape, dtype, _ = SHAPES[key]
    n = 1
    for s in shape:
        n *= s
    seed = sum(map(ord, key)) * 1000 + step
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.25 + seed).to(dtype)


def replicated(step: int) -> torch.Tensor:
    return torch.tensor([1.5, -2.0, float(step)])


def state(mesh, rank: int, step: int, empty: bool = False) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    sd = {}
    for key, (shape, dtype, dim) in SHAPES.items():
        t = torch.zeros(shape, dtype=dtype) if empty else full(key, step)
        sd[key] = distribute_tensor(t, mesh, [Shard(dim)])
    sd["model.scale"] = torch.zeros(3) if empty else replicated(step)
    sd["step"] = -1 if empty else step
    sd[f"dataloader.rank{rank}"] = {"pos": -1 if empty else 100 * rank + step}
    return sd


def save(rank: int, world: int, port: int, ckpt: str, step: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from mcore import init_gloo

    init_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(state(mesh, rank, step), checkpoint_id=ckpt, use_collectives=False)
    return {}


def load(rank: int, world: int, port: int, ckpt: str, step: int) -> dict:
    """Plain DCP load at this world size; checks every local shard bitwise against the expected
    full tensor's rows, the replicated tensor and the byte objects."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from mcore import init_gloo

    init_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    sd = state(mesh, rank, step, empty=True)
    del sd[f"dataloader.rank{rank}"]
    sd["dataloader.rank3"] = {"pos": -1}
    dcp.load(sd, checkpoint_id=ckpt)
    from dcp_util import bits

    wrong = [k for k in SHAPES if not torch.equal(bits(sd[k].full_tensor()), bits(full(k, step)))]
    if not torch.equal(sd["model.scale"], replicated(step)):
        wrong.append("model.scale")
    if sd["step"] != step or sd["dataloader.rank3"] != {"pos": 300 + step}:
        wrong.append(f"objects {sd['step']} {sd['dataloader.rank3']}")
    return {"wrong": wrong}
