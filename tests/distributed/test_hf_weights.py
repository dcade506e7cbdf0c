"""Hugging Face weights read into sharded tensors: each rank reads only the values it holds (plain tensors through
DCP's safetensors reader, packed experts from their per-expert tensors), and a tensor the files lack is named."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_ciuic.checkpoint.huggingface import load_weights
from tests.helpers import run_workers

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

E, I, H = 4, 3, 5  # experts, expert width, hidden size


def _files() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {"proj.weight": torch.randn(8, 6, generator=g, dtype=torch.float64)}
    for e in range(E):
        for part, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            tensors[f"moe.experts.{e}.{part}.weight"] = torch.randn(*shape, generator=g, dtype=torch.float64)
    return tensors


class _CountingOpen:
    """``safetensors.safe_open`` that adds up the values read (whole tensors and slices)."""

    def __init__(self, real, counter: list[int]) -> None:
        self.real, self.counter = real, counter

    def __call__(self, *args, **kwargs):
        handle, counter = self.real(*args, **kwargs), self.counter

        class Slice:
            def __init__(self, inner):
                self.inner = inner

            def __getitem__(self, index):
                out = self.inner[index]
                counter[0] += out.numel()
                return out

            def __getattr__(self, name):
                return getattr(self.inner, name)

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_slice(self, name):
                return Slice(handle.get_slice(name))

            def get_tensor(self, name):
                out = handle.get_tensor(name)
                counter[0] += out.numel()
                return out

            def __getattr__(self, name):
                return getattr(handle, name)

        return Handle()


def _sharded_load(rank, world, directory):
    mesh = init_device_mesh("cpu", (world,))
    files = _files()
    gate_up = torch.stack([torch.cat([files[f"moe.experts.{e}.gate_proj.weight"], files[f"moe.experts.{e}.up_proj.weight"]]) for e in range(E)])
    down = torch.stack([files[f"moe.experts.{e}.down_proj.weight"] for e in range(E)])
    targets = {
        "proj.weight": distribute_tensor(torch.zeros(8, 6, dtype=torch.float64), mesh, [Shard(0)]),
        "moe.experts.gate_up_proj": distribute_tensor(torch.zeros(E, 2 * I, H, dtype=torch.float64), mesh, [Shard(0)]),
        "moe.experts.down_proj": distribute_tensor(torch.zeros(E, H, I, dtype=torch.float64), mesh, [Shard(0)]),
    }
    read = [0]
    real = safetensors.safe_open
    safetensors.safe_open = _CountingOpen(real, read)
    try:
        load_weights(targets, directory)
    finally:
        safetensors.safe_open = real
    assert torch.equal(targets["proj.weight"].full_tensor(), files["proj.weight"])
    assert torch.equal(targets["moe.experts.gate_up_proj"].full_tensor(), gate_up)
    assert torch.equal(targets["moe.experts.down_proj"].full_tensor(), down)
    assert read[0] == sum(t.numel() for t in files.values()) // world  # this rank's half, nothing more
    with pytest.raises(KeyError, match=r"the model has extra.weight, which the Hugging Face files in .* lack"):
        load_weights({"extra.weight": torch.zeros(2)}, directory)
    dist.barrier()


def test_each_rank_reads_only_the_values_it_holds(tmp_path):
    save_file(_files(), str(tmp_path / "model.safetensors"))
    run_workers(_sharded_load, 2, str(tmp_path))
