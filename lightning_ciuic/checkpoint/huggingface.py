"""Hugging Face weights in and out: directories of ``config.json`` and ``*.safetensors`` files (a sharded index
included), read into a model as it is laid out, and written from a full state dict.

Contract:

* :func:`read_config` gives ``(model_type, config)`` from a directory's ``config.json`` (the keys a config takes,
  without transformers' bookkeeping such as ``architectures`` or ``transformers_version``).
* :func:`load_weights` fills ``tensors`` (Hugging Face names, as a transformers model's ``state_dict()`` gives them)
  from the directory, in place. A tensor may be a DTensor (tensor parallelism, FSDP2 shards): each rank reads only
  the slices it holds (torch DCP's ``HuggingFaceStorageReader`` over safetensors' lazy slices), and a name that is
  not there (a block of another pipeline stage) is not read at all. transformers' packed mixture-of-experts
  tensors (``...experts.gate_up_proj`` [E, 2I, H], ``...experts.down_proj`` [E, H, I], what the model holds) are
  assembled from the files' per-expert tensors (``...experts.<e>.{gate,up,down}_proj.weight``), reading only the
  experts this rank holds. A tensor the files lack, or with another shape, is an error naming it. Collective when
  torch.distributed is initialised: every rank calls it.
* :func:`save_pretrained` writes a full state dict (Hugging Face names, CPU tensors) with transformers' own
  ``save_pretrained`` (its file layout, per-expert conversion and config), so ``from_pretrained(out)`` loads it.
* :func:`save_safetensors` writes any full state dict's tensors as one safetensors file.

No Lightning imports.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_ciuic import compat

CONFIG = "config.json"
_BOOKKEEPING = ("architectures", "transformers_version", "_name_or_path", "auto_map", "dtype", "torch_dtype")
_PACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def read_config(path: str | Path) -> tuple[str, dict[str, Any]]:
    """``(model_type, config)`` of the Hugging Face directory ``path``."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise FileNotFoundError(
            f"{path!s} has no {CONFIG}: give a directory in Hugging Face layout (config.json and *.safetensors, as"
            " transformers' save_pretrained writes it)."
        )
    config = json.loads(file.read_text())
    if "model_type" not in config:
        raise ValueError(f"{file} has no 'model_type'; it is not a transformers model config.")
    model_type = config.pop("model_type")
    return model_type, {k: v for k, v in config.items() if k not in _BOOKKEEPING}


def _stored_names(path: Path) -> dict[str, Path]:
    """Every tensor name in the directory's safetensors files, with its file."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files; Hugging Face weights are expected there.")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update((name, file) for name in f.keys())
    return names


def _expert_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The experts (dim 0) this rank holds of a packed expert tensor: ``(first, count)``; every other dim whole."""
    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0]
    shape, offset = compat.local_shape_and_offset(tensor)
    if any(offset[1:]) or tuple(shape[1:]) != tuple(tensor.shape[1:]):
        raise ValueError(
            f"a packed expert tensor of shape {tuple(tensor.shape)} is split along a dimension other than the experts'"
            f" ({tensor.placements}); only expert-wise shards can be read from per-expert files."
        )
    return offset[0], shape[0]


@torch.no_grad()
def _load_packed(name: str, tensor: torch.Tensor, stored: Mapping[str, Path]) -> None:
    from safetensors import safe_open

    match = _PACKED.match(name)
    assert match is not None
    prefix, kind = match["prefix"], match["kind"]
    parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    first, count = _expert_range(tensor)
    for i in range(count):
        pieces = []
        for part in parts:
            key = f"{prefix}.{first + i}.{part}.weight"
            if key not in stored:
                raise KeyError(f"{name} is built from per-expert tensors, but the Hugging Face files lack {key}.")
            with safe_open(str(stored[key]), framework="pt") as f:
                pieces.append(f.get_tensor(key))
        expert = torch.cat(pieces, dim=0)
        if expert.shape != local.shape[1:]:
            raise ValueError(f"{name}: expert {first + i} has shape {tuple(expert.shape)} in the files, the model {tuple(local.shape[1:])}.")
        local[i].copy_(expert)


@torch.no_grad()
def load_weights(tensors: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Fill ``tensors`` from the Hugging Face directory ``path`` (see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = Path(path)
    stored = _stored_names(path)
    direct: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in stored:
            direct[name] = tensor.detach()
        elif _PACKED.match(name):
            _load_packed(name, tensor, stored)
        else:
            raise KeyError(
                f"the model has {name}, which the Hugging Face files in {path} lack (they hold e.g."
                f" {sorted(stored)[:4]}); is it the same architecture and config?"
            )
    try:
        dcp.load(direct, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=not dist.is_initialized())
    except Exception as err:  # DCP wraps each rank's failure; say what was being read
        raise RuntimeError(f"reading Hugging Face weights from {path} failed: {err}") from err


def save_pretrained(model_type: str, config: Mapping[str, Any], state: Mapping[str, torch.Tensor], out: str | Path) -> None:
    """Write ``state`` (a whole transformers model's, Hugging Face names) to ``out`` as transformers would."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    missing, unexpected = model.load_state_dict(dict(state), strict=False, assign=True)
    if missing or unexpected:
        raise KeyError(f"the state does not fit {model_type}: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    model.save_pretrained(str(out))


def save_safetensors(state: Mapping[str, Any], out: str | Path) -> None:
    """Every tensor of ``state`` (nested dictionaries flattened to dotted names) in one safetensors file."""
    from safetensors.torch import save_file

    flat: dict[str, torch.Tensor] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value.detach().cpu().contiguous()
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(f"{prefix}.{key}" if prefix else str(key), item)

    visit("", state)
    if not flat:
        raise ValueError("the state holds no tensors to write.")
    save_file(flat, str(out))
