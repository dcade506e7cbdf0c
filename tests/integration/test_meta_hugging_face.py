"""A Hugging Face model built under ``Trainer.init_module(empty_init=True)`` (the meta device) and sharded over two
gloo ranks (data_parallel_shard_size=2) is materialised by transformers' own initialisation: the rotary tables
(non-persistent buffers: no checkpoint brings them back) equal a normally built model's on every rank and in the
process that called fit, the norms are ones, the weights normal(0, 0.02) and the same on both ranks; it trains."""

import math

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.distributed.tensor import DTensor

from lightning_ciuic import HybridParallelStrategy
from tests.helpers import loader

pytest.importorskip("transformers")

from lightning_ciuic.huggingface import HuggingFaceCausalLM  # noqa: E402

LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=32)  # 256: the test data's byte tokens
STEPS, PER_RANK_BATCH, STD = 2, 2, 0.02  # transformers' initializer_range default


class Materialised(Callback):
    """Each rank saves what set-up made of the model, before training: its buffers and the whole weights."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_fit_start(self, trainer, pl_module):
        weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in pl_module.state_dict().items()}
        buffers = {k: b.detach().clone() for k, b in pl_module.named_buffers()}
        sharded = all(isinstance(p, DTensor) for p in pl_module.parameters())
        torch.save({"weights": weights, "buffers": buffers, "sharded": sharded}, self.directory / f"rank{trainer.global_rank}.pt")


def _assert_buffers_equal(buffers: dict, reference: HuggingFaceCausalLM) -> None:
    expected = dict(reference.named_buffers())
    assert buffers.keys() == expected.keys() and expected
    for name, buffer in expected.items():
        assert torch.equal(buffers[name].cpu(), buffer), name


def test_a_meta_built_hugging_face_model_is_materialised_sharded_by_its_own_initialisation(tmp_path):
    trainer = Trainer(
        strategy=HybridParallelStrategy(data_parallel_size=2, data_parallel_shard_size=2, start_method="forkserver"),
        accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Materialised(tmp_path)],
    )
    with trainer.init_module(empty_init=True):
        module = HuggingFaceCausalLM("llama", LLAMA, lr=1e-2)
    assert all(t.is_meta for t in (*module.parameters(), *module.buffers()))
    trainer.fit(module, loader(STEPS * PER_RANK_BATCH * 2, PER_RANK_BATCH))

    reference = HuggingFaceCausalLM("llama", LLAMA)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank in ranks:
        assert rank["sharded"]
        _assert_buffers_equal(rank["buffers"], reference)
    initial = ranks[0]["weights"]
    for name, weight in initial.items():
        assert torch.equal(weight, ranks[1]["weights"][name]), name  # each shard its part of one whole tensor
        assert torch.isfinite(weight).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(weight, torch.ones_like(weight)), name
        elif weight.dim() == 2:
            assert math.isclose(weight.std().item(), STD, rel_tol=0.15), (name, weight.std().item())
    # The calling process's copy (allocated there, the trained weights loaded into it) has the tables too.
    _assert_buffers_equal(dict(module.named_buffers()), reference)
    trained = module.state_dict()
    assert all(torch.isfinite(trained[name]).all() for name in initial)
    assert any(not torch.equal(trained[name], initial[name]) for name in initial)
    assert float(trainer.callback_metrics["train/loss"]) < math.log(LLAMA["vocab_size"]) + 1
