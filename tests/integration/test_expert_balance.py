"""ExpertLoadBalancer: one step moves each router bias by rate * sign(mean - load) of the tokens the whole global
batch routed (summed over the data-parallel ranks, equal on every rank); a router without such a bias is refused."""

import json

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from examples.deepseek import DeepSeekMini
from lightning_ciuic import ExpertLoadBalancer, HybridParallelStrategy
from lightning_ciuic.parallel.experts import RoutedTokens
from tests.helpers import PRECISION, TINY_MODEL, TokenWindows, lightning_epoch_order, loader

RATE, PER_RANK_BATCH = 0.01, 4
MOE_MODEL = {**TINY_MODEL, "n_routed_experts": 8}  # 8: each rank's half alone would move some bias the other way
BIAS = "model.layers.1.ffn.e_score_correction_bias"


def _tiny() -> DeepSeekMini:
    seed_everything(3)
    return DeepSeekMini(**MOE_MODEL).double()


class WriteBias(Callback):
    def __init__(self, path) -> None:
        self.path = str(path)

    def on_train_end(self, trainer, pl_module):
        biases = trainer.strategy.all_gather(pl_module.get_buffer(BIAS).detach())
        if trainer.is_global_zero:
            with open(self.path, "w") as f:
                json.dump(biases.tolist(), f)


def test_one_step_moves_each_bias_by_the_sign_of_the_global_batchs_imbalance(tmp_path):
    strategy = HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2, start_method="forkserver")
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=PRECISION,
        callbacks=[ExpertLoadBalancer(bias_update_rate=RATE), WriteBias(tmp_path / "bias.json")],
    )
    trainer.fit(_tiny(), loader(2 * PER_RANK_BATCH, PER_RANK_BATCH))
    biases = torch.tensor(json.loads((tmp_path / "bias.json").read_text()), dtype=torch.float64)

    reference = _tiny().train()
    routed = RoutedTokens(reference)
    data = TokenWindows(2 * PER_RANK_BATCH).data[lightning_epoch_order(2 * PER_RANK_BATCH)]
    reference(data[:, :-1])
    load = routed.take()["model.layers.1.ffn.experts"].double()
    expected = RATE * torch.sign(load.mean() - load)
    assert load.sum() == 2 * PER_RANK_BATCH * data[:, :-1].shape[1] * MOE_MODEL["n_activated_experts"]
    assert torch.equal(biases[0], expected) and torch.equal(biases[1], expected), (biases, expected)
    # the test tells a sum over ranks from each rank's own counts: some rank's half alone would move the bias otherwise
    halves = []
    for rank in range(2):
        reference(data[rank::2, :-1])
        half = routed.take()["model.layers.1.ffn.experts"].double()
        halves.append(RATE * torch.sign(half.mean() - half))
    assert any(not torch.equal(half, expected) for half in halves), halves


def test_a_router_without_a_score_bias_is_refused_naming_the_layers():
    pytest.importorskip("transformers")
    from lightning_ciuic.huggingface import HuggingFaceCausalLM

    mixtral = HuggingFaceCausalLM("mixtral", dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    ))
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[ExpertLoadBalancer()])
    with pytest.raises(ValueError, match=r"layers \['model.model.layers.0.mlp.experts'\] have none \(MixtralSparseMoeBlock\)"):
        trainer.fit(mixtral, loader(2, 2))
