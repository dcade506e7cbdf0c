"""Sequence and loss parallelism's layout, on torch's fake process group (one process, tp=2): the residual stream
between the tensor-parallel linears holds half the sequence, the logits stay a vocabulary-sharded DTensor, and the
switch turns both off. (Numerical equivalence with one process: tests/integration/test_equivalence.py.)"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from examples.deepseek import DeepSeekMini
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.parallelize import parallelize
from lightning_ciuic.parallel.tensor import loss_parallel_context
from tests.helpers import SEQ_LEN, TINY_MODEL

BATCH = 2


@pytest.fixture
def fake_tp2():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield ParallelismConfig(data_parallel_size=1, tensor_parallel_size=2)
    dist.destroy_process_group()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shapes(config: ParallelismConfig) -> tuple[dict[str, tuple[int, ...]], torch.Tensor, bool]:
    """The local input shapes of the norms, the logits, and whether the layout computes the loss from shards."""
    module = DeepSeekMini(**TINY_MODEL)
    result = parallelize(module, config.resolve(2), config)
    seen = {}
    for name in ("model.layers.0.attn_norm", "model.layers.1.ffn_norm", "model.norm"):
        module.get_submodule(name).register_forward_pre_hook(
            lambda m, args, name=name: seen.update({name: tuple(_local(args[0]).shape)})
        )
    logits = module(torch.randint(0, 256, (BATCH, SEQ_LEN)))
    return seen, logits, result.loss_parallel


def test_norms_hold_half_the_sequence_and_logits_stay_vocabulary_sharded(fake_tp2):
    seen, logits, loss_parallel = _shapes(fake_tp2)
    assert seen == dict.fromkeys(seen, (BATCH, SEQ_LEN // 2, TINY_MODEL["dim"])) and len(seen) == 3
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    assert logits.to_local().shape == (BATCH, SEQ_LEN, 128) and loss_parallel


def test_switched_off_the_stream_and_logits_are_whole(fake_tp2):
    import dataclasses

    seen, logits, loss_parallel = _shapes(dataclasses.replace(fake_tp2, sequence_parallel=False))
    assert seen == dict.fromkeys(seen, (BATCH, SEQ_LEN, TINY_MODEL["dim"])) and len(seen) == 3
    assert not isinstance(logits, DTensor) and logits.shape == (BATCH, SEQ_LEN, 256) and not loss_parallel


def test_a_users_cross_entropy_of_sharded_logits_is_a_plain_tensor_and_other_uses_say_what_works(fake_tp2):
    """Inside the strategy's step: ``F.cross_entropy`` (and ``nn.CrossEntropyLoss``) of the vocabulary-sharded logits
    give a plain tensor (``self.log`` and Lightning take it as it is); gathering the target's log-probability by hand
    mixes a plain index with the sharded logits and fails naming the fixes."""
    _, logits, _ = _shapes(fake_tp2)
    targets = torch.randint(0, 256, (BATCH, SEQ_LEN))
    with loss_parallel_context(True):
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        assert type(loss) is torch.Tensor and loss.shape == ()
        assert type(torch.nn.CrossEntropyLoss()(logits.flatten(0, 1), targets.flatten())) is torch.Tensor
        with pytest.raises(RuntimeError, match=r"mixed torch.Tensor and DTensor.*\.full_tensor\(\).*sequence_parallel=False"):
            logits.log_softmax(-1).gather(-1, targets[..., None])


class _Feedforward(torch.nn.Module):
    """An MLP between sequence-parallel norms: gate and up read the gathered sequence, down scatters it back."""

    def __init__(self, dim: int = 6, inner: int = 20) -> None:
        super().__init__()
        self.gate, self.up = torch.nn.Linear(dim, inner), torch.nn.Linear(dim, inner, bias=False)
        self.down = torch.nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _collectives(log: list) -> "torch.utils._python_dispatch.TorchDispatchMode":
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and "wait" not in func.__name__ and "wrap" not in func.__name__:
                log.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    return Collectives()


@pytest.mark.parametrize("saving_shard", [True, False])
def test_linears_reading_the_gathered_sequence_keep_the_ranks_part_and_gather_it_once_again(fake_tp2, saving_shard):
    """Megatron's sequence parallelism: the column-parallel linears reading a gathered input save this rank's half of
    the sequence for backward, not the gathered whole (torch's ColwiseParallel: ``saving_shard=False``); backward
    gathers it once for both and reduce-scatters their summed input gradient once (torch's: an all-reduce each)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_ciuic.parallel.regather import ColwiseSavingShard
    from lightning_ciuic.parallel.tensor import gathered_input

    mesh = init_device_mesh("cpu", (2,))
    column = ColwiseSavingShard if saving_shard else ColwiseParallel
    plan = {"": gathered_input(), "gate": column(), "up": column(), "down": RowwiseParallel(output_layouts=Shard(1))}
    module = parallelize_module(_Feedforward(), mesh, plan)
    part = torch.randn(BATCH, SEQ_LEN // 2, 6, requires_grad=True)  # this rank's half of the sequence
    saved, forward, backward = [], [], []

    def pack(tensor):
        saved.append(_local(tensor).numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _collectives(forward):
        out = module(part)
    with _collectives(backward):
        out.sum().backward()
    whole, half = BATCH * SEQ_LEN * 6, BATCH * SEQ_LEN // 2 * 6
    assert (whole in saved) is not saving_shard and (half in saved) is saving_shard
    assert forward == ["all_gather_into_tensor", "reduce_scatter_tensor"]
    expected = ["all_gather_into_tensor", "reduce_scatter_tensor"] if saving_shard else ["all_reduce", "all_reduce"]
    assert sorted(backward) == sorted(["all_gather_into_tensor", *expected])  # the first: down's reduce-scatter's
    assert part.grad.shape == part.shape and module.gate.weight.grad.placements == module.gate.weight.placements
