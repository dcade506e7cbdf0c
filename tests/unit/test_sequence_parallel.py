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
