"""What torch's own reader reads from torch.save archives: the oracle of the differential test
(torch_reader_diff.py). Runs in any torch 2.3+ (the main venv's 2.15 and the 2.3.1 side venv) and
imports nothing of shardwise.

    python torch_reader_oracle.py DIR   # one JSON line per file of DIR, in name order

Per file: whether torch.load would treat it as a zip at all (``_is_zipfile``: it starts with
``PK\\3\\4``; otherwise it unpickles the file's start); what ``PyTorchFileReader`` opens, lists
(``get_all_records``, which ``torch.load`` calls) and returns by name; whether ``torch.load`` hands
it to ``torch.jit.load`` (a ``constants.pkl`` record); the tensor ``torch.load`` returns as DCP
reads a tensor item (``weights_only=True`` from torch 2.4, the default ``False`` in 2.3); and, as
Megatron and DCP read a byte object (``weights_only=False``), which globals the unpickler imports
(the ``pickle.find_class`` audit events), with imports outside a harmless set refused by the hook
so that nothing but fuzz_marker.touch can run.
"""

from __future__ import annotations

import io
import json
import os
import sys
import warnings

import torch

# The reads torch.load makes by name (torch/serialization.py _load; PyTorchStreamReader::init).
TORCH_READS = ("data.pkl", "byteorder", "version", ".data/version", ".data/serialization_id", ".format_version", ".storage_alignment")
# Modules a generated pickle may import while torch unpickles it; anything else is refused by the
# audit hook before it is imported (random byte flips could name any module).
HARMLESS = {"collections", "argparse", "types", "torch", "torch._utils", "torch.storage", "torch._tensor", "fuzz_marker", "builtins", "__builtin__", "copyreg", "copy_reg"}
WEIGHTS_ONLY_TENSORS = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 4)

_imports: list[str] | None = None


def _hook(event, args):
    if event == "pickle.find_class" and _imports is not None:
        module, name = args[0], args[1]
        _imports.append(f"{module}.{name}")
        builtin = module in {"builtins", "__builtin__"} and name not in {"object", "dict", "list", "set"}
        if module not in HARMLESS or builtin or (module in {"copyreg", "copy_reg"} and name != "_reconstructor"):
            raise RuntimeError(f"oracle refuses to import {module}.{name}")


sys.addaudithook(_hook)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _tensor_view(t) -> dict:
    if not isinstance(t, torch.Tensor):
        return {"error": f"not a tensor: {type(t).__name__}"}
    storage = t.untyped_storage()
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "storage_offset": t.storage_offset(),
        "storage": bytes(storage.tolist()).hex(),
    }


def view(blob: bytes) -> dict:
    global _imports
    if blob[:4] != b"PK\x03\x04":
        return {"legacy": True}
    out: dict = {}
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(blob))
    except Exception as e:  # noqa: BLE001 - any refusal is an outcome
        return {"open_error": _err(e)}
    try:
        out["names"] = list(reader.get_all_records())
    except Exception as e:  # noqa: BLE001
        out["names_error"] = _err(e)
    records = {}
    for n in TORCH_READS:
        try:
            records[n] = reader.get_record(n).hex() if reader.has_record(n) else None
        except Exception as e:  # noqa: BLE001
            records[n] = {"error": _err(e)}
    out["records"] = records
    if "names" in out and "constants.pkl" in out["names"]:
        out["torchscript"] = True  # torch.load would call torch.jit.load: never run it here
        return out
    if "names_error" in out:
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            kw = {"weights_only": True} if WEIGHTS_ONLY_TENSORS else {}
            out["tensor"] = _tensor_view(torch.load(io.BytesIO(blob), map_location="cpu", **kw))
        except Exception as e:  # noqa: BLE001
            out["tensor"] = {"error": _err(e)}
        _imports = []
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
            out["object"] = {"imported": sorted(set(_imports))}
        except Exception as e:  # noqa: BLE001
            out["object"] = {"imported": sorted(set(_imports)), "error": _err(e)}
        finally:
            _imports = None
    return out


def main(directory: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fuzz_marker
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            blob = f.read()
        print(json.dumps({"file": name, "torch": torch.__version__, "view": view(blob)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
