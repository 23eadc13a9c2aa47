"""pytest plugin: run Megatron-LM's tests/unit_tests (core_v0.16.1) on a CPU-only machine with gloo.

Load with `-p mlm_cpu_plugin` (this directory on PYTHONPATH). The patches are applied when pytest
imports this module (before the conftest files and any test module are imported).

Patches (all CPU artefacts; none touches megatron.core.dist_checkpointing itself):
  * tests.test_utils.python_scripts.download_unit_tests_dataset: stubbed (the top-level conftest
    imports it; its fixture catches the ImportError the stub raises and goes on, no network use).
  * torch.cuda.synchronize -> no-op; torch.cuda.current_device -> 'cpu' (as shardwise's own
    python/tests/mcore.py does for Megatron's torch_dist save/load on gloo).
  * torch.cuda.get_rng_state / torch.cuda.random.get_rng_state -> the CPU generator's state;
    torch.cuda.set_rng_state -> no-op (model_parallel_cuda_manual_seed, megatron.training's
    get_rng_state / load_checkpoint).
  * Utils.initialize_distributed: backend 'gloo', no torch.cuda.set_device; otherwise the same
    TCP rendezvous (MASTER_ADDR/MASTER_PORT, timeout 1 min).
  * Utils.set_world_size(None): WORLD_SIZE from the environment instead of torch.cuda.device_count().
  * megatron.core.utils.is_te_min_version -> False when transformer-engine is not installed (the
    top-level conftest's autouse set_env fixture calls it; unpatched it raises TypeError).
  * torch.distributed.init_process_group / new_group: a backend 'nccl' request becomes 'gloo'.
  * After each test (pytest_runtest_teardown, after the test's own teardown): every process group is
    destroyed, the default one included, and a new default group is made over the same TCPStore
    under a new key prefix (test index, init count), so the next test starts as it would have. Two reasons, both
    artefacts of running many gloo tests in one process on a small CPU machine: (1) Megatron's
    destroy_model_parallel only drops its references, torch keeps every group alive and a gloo group
    keeps its threads: 8 ranks grew by ~65 threads per test (2,500 per rank after 38 tests, a load
    average in the thousands on 2 cores); (2) one test whose ranks desync (a race on a loaded
    machine) left the default group broken ("Connection closed by peer") and failed every later test
    of the file; now it fails that test only.
  * torch.empty ignores a ``strides`` keyword (only where torch's TensorProperties has that field,
    torch 2.15). megatron-core 0.16.1-0.19.2 ``strategies/torch.py`` ``load_tensors_metadata`` calls
    ``torch.empty(tp.size, **tp.properties.__dict__, device='meta')``, and the new field made every
    load with a strict mode other than ``assume_ok_unexpected`` (and ``load_tensors_metadata``,
    ``load_sharded_metadata``) a TypeError in both runs. A torch/megatron version skew, not a CPU
    artefact; without it the baseline fails every test that uses those modes.
"""
import os
import sys
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed


# The rendezvous TCPStore (made once), the index of the running test and its count of inits: together
# the key prefix of each default group, equal on every rank as they run the same tests in order.
_STATE = {'store': None, 'test': 0, 'inits': 0}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    from tests.unit_tests.test_utilities import Utils

    _STATE['test'] += 1
    _STATE['inits'] = 0
    if torch.distributed.is_initialized():
        inited = Utils.inited
        torch.distributed.destroy_process_group()
        # Tests that use the group without initialising it (test_broadcast_sharded_objects) rely on
        # an earlier test's: the next test finds a fresh one, as if this test had kept it.
        Utils.initialize_distributed()
        Utils.inited = inited


def _stub_dataset_downloader():
    name = "tests.test_utils.python_scripts.download_unit_tests_dataset"
    if name in sys.modules:
        return
    import tests  # the real package from the extracted tree

    def download_and_extract_asset(*a, **k):
        raise ImportError("download_unit_tests_dataset stubbed by mlm_cpu_plugin (no network, no /opt/data)")

    for part in ("tests.test_utils", "tests.test_utils.python_scripts", name):
        if part not in sys.modules:
            m = types.ModuleType(part)
            m.__path__ = []  # package-like
            sys.modules[part] = m
    sys.modules[name].download_and_extract_asset = download_and_extract_asset


def _patch_cuda():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"

    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.random.set_rng_state = lambda *a, **k: None


def _patch_backends():
    orig_init = torch.distributed.init_process_group
    orig_new_group = torch.distributed.new_group

    def init_process_group(*args, **kwargs):
        if args and args[0] == "nccl":
            args = ("gloo",) + tuple(args[1:])
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        return orig_init(*args, **kwargs)

    def new_group(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        kwargs.pop("pg_options", None) if kwargs.get("backend") in (None, "gloo") else None
        return orig_new_group(*args, **kwargs)

    torch.distributed.init_process_group = init_process_group
    torch.distributed.new_group = new_group


def _patch_utils():
    from torch._C._distributed_c10d import PrefixStore
    from torch.distributed import rendezvous

    from tests.unit_tests.test_utilities import Utils

    def initialize_distributed():
        os.environ.pop('NVTE_FLASH_ATTN', None)
        os.environ.pop('NVTE_FUSED_ATTN', None)
        os.environ.pop('NVTE_UNFUSED_ATTN', None)
        if not torch.distributed.is_initialized() and Utils.rank >= 0:
            print(f'[mlm_cpu_plugin] init gloo rank {Utils.rank} world_size {Utils.world_size}')
            if _STATE['store'] is None:
                init_method = 'tcp://' + os.getenv('MASTER_ADDR', 'localhost') + ':' + os.getenv('MASTER_PORT', '6000')
                store, rank, world_size = next(rendezvous(init_method, Utils.rank, Utils.world_size, timeout=timedelta(minutes=5)))
                store.set_timeout(timedelta(minutes=5))
                _STATE['store'] = store
            _STATE['inits'] += 1
            store = PrefixStore(f"default_pg_t{_STATE['test']}_i{_STATE['inits']}", _STATE['store'])
            Utils.store = store
            torch.distributed.init_process_group(
                backend='gloo', world_size=Utils.world_size, rank=Utils.rank, store=store,
                timeout=timedelta(seconds=float(os.environ.get('MLM_CPU_PG_TIMEOUT_S', '120'))),
            )
            torch.distributed.barrier()
        Utils.inited = True

    orig_set_world_size = Utils.set_world_size

    def set_world_size(world_size=None, rank=None):
        if world_size is None:
            world_size = int(os.environ.get('WORLD_SIZE', '1'))
        return orig_set_world_size(world_size, rank)

    Utils.initialize_distributed = staticmethod(initialize_distributed)
    Utils.set_world_size = staticmethod(set_world_size)


def _patch_te_version():
    import megatron.core.utils as mcu

    orig = mcu.is_te_min_version

    def is_te_min_version(version, check_equality=True):
        if mcu.get_te_version() is None:  # no transformer-engine installed
            return False
        return orig(version, check_equality)

    mcu.is_te_min_version = is_te_min_version


def _patch_empty_strides():
    from torch.distributed.checkpoint.metadata import TensorProperties

    if 'strides' not in getattr(TensorProperties, '__dataclass_fields__', {}):
        return
    orig_empty = torch.empty

    def empty(*args, **kwargs):
        kwargs.pop('strides', None)
        return orig_empty(*args, **kwargs)

    torch.empty = empty


def _apply():
    os.environ.setdefault('LOCAL_RANK', '0')
    os.environ.setdefault('WORLD_SIZE', '1')
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    torch.set_num_threads(1)
    _stub_dataset_downloader()
    _patch_cuda()
    _patch_backends()
    _patch_utils()
    _patch_te_version()
    _patch_empty_strides()


_apply()
