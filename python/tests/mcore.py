"""Helpers for real multi-process megatron-core runs on CPU with gloo (used by the tests and the demo).

Megatron's torch_dist save calls two CUDA helpers unconditionally, so workers that run Megatron's own
save or load patch them (``patch_cuda_for_cpu``, as ``tools/fixtures/make_megatron_fixtures.py`` does
for the golden fixtures): ``torch.cuda.synchronize`` becomes a no-op and ``torch.cuda.current_device``
returns ``'cpu'``.
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def patch_cuda_for_cpu() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 120.0) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    patch_cuda_for_cpu()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def build_moe(seed: int, gated: bool = False):
    """A 2-layer MoE GPT (4 experts, top-2, SwiGLU when ``gated``) at the current EP size; each EP
    rank's experts get other values (equal within the expert-DP group), the rest is equal on every
    rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    ep = ps.get_expert_model_parallel_world_size()
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, moe_ffn_hidden_size=128,
        num_moe_experts=4, expert_model_parallel_size=ep, moe_router_topk=2, use_cpu_initialization=True,
        add_bias_linear=False, normalization="RMSNorm", params_dtype=torch.float32, gated_linear_unit=gated,
    )
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False),
                     vocab_size=256, max_sequence_length=64)
    g = torch.Generator().manual_seed(seed + 7 * ps.get_expert_model_parallel_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def build_gpt(seed: int, pp_stage_layers: bool = True, heads: int = 4, query_groups: int = 2):
    """A tiny megatron-core GPTModel: local layer spec, SwiGLU, GQA (4 heads, 2 query groups by
    default; TP must divide ``query_groups``), RMSNorm."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)  # same seed on every rank: DP replicas must hold identical weights
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=heads,
        num_query_groups=query_groups,
        ffn_hidden_size=128,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
    )
    torch.manual_seed(seed + 1000 * ps.get_pipeline_model_parallel_rank())
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=256,
        max_sequence_length=64,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )


def model_tensors(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _entry(fn, rank, world, port, out_dir, args):
    result = {"rank": rank}
    try:
        result.update(fn(rank, world, port, *args) or {})
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the parent as data
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # os._exit skips the finalizers that would stop this process's own children, such as the
    # Manager process behind megatron-core's write-results queue (filesystem_async.py): left
    # alive, each one (~0.5 GB) outlives the test run.
    for child in mp.active_children():
        child.kill()
    # Leave without tearing down process groups: a peer may still be blocked in a collective.
    os._exit(0)


def spawn(fn, world: int, out_dir: str, *args, timeout_s: float = 600.0) -> list[dict]:
    """Runs ``fn(rank, world, port, *args)`` in ``world`` processes; returns each rank's result dict.

    A process still alive after ``timeout_s`` is killed and reported with ``ok: False``.
    """
    os.makedirs(out_dir, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out_dir, args)) for r in range(world)]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    results = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append({"rank": r, "ok": False, "error": f"no result (exit code {p.exitcode})"})
    return results
