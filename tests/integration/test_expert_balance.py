"""ExpertLoadBalancer: one step moves each router bias by rate * sign(mean - load) of the tokens the whole global
batch routed (summed over the data-parallel ranks, equal on every rank); a router without such a bias is refused."""

import json

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, Subset

from examples.deepseek import DeepSeekMini
from lightning_ciuic import ExpertLoadBalancer, HybridParallelStrategy
from lightning_ciuic.parallel.experts import RoutedTokens, packed_experts
from tests.helpers import (
    PRECISION, TINY_MODEL, TokenWindows, assert_state_close, lightning_epoch_order, loader, reference_training,
)

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


# --- the sequence-wise balance loss -------------------------------------------------------------------------------

ALPHA = 0.5  # far above DeepSeek-V3's 1e-4, so a wrong weight or scale moves the parameters beyond rounding


def _hand_balance_loss(logits: torch.Tensor, chosen: torch.Tensor, sequences: int, scores: str) -> torch.Tensor:
    """DeepSeek-V3 report eq. 17-20, one sequence at a time."""
    n_experts, top_k = logits.shape[-1], chosen.shape[-1]
    losses = []
    for logit, choice in zip(logits.chunk(sequences), chosen.chunk(sequences)):
        s = logit.softmax(-1) if scores == "softmax" else logit.sigmoid()
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        f = torch.stack([(choice == i).sum() for i in range(n_experts)]).to(s.dtype) * n_experts / (top_k * len(logit))
        losses.append((f * p).sum())
    return torch.stack(losses).mean()


class _SeenRouting:
    """What each router of ``module`` produced in its forwards: (logits, chosen experts, sequences)."""

    def __init__(self, module, gate_of) -> None:
        self.seen: list[tuple] = []
        for name, experts in packed_experts(module):
            moe = module.get_submodule(name.rpartition(".")[0])
            state: dict = {}
            moe.register_forward_pre_hook(lambda m, a, s=state: s.update(sequences=a[0].shape[0]))
            gate_of(moe).register_forward_hook(lambda m, a, out, s=state: s.update(logits=out[0] if isinstance(out, tuple) else out))
            experts.register_forward_pre_hook(lambda m, a, s=state: self.seen.append((s["logits"], a[1], s["sequences"])))

    def loss(self, scores: str) -> torch.Tensor:
        total = sum(_hand_balance_loss(logits, chosen, b, scores) for logits, chosen, b in self.seen)
        self.seen.clear()
        return total


class WithHandBalanceLoss(DeepSeekMini):
    """The reference: the example model whose loss adds ALPHA x the hand-written balance loss of the same batch."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.routing = _SeenRouting(self, lambda moe: moe.gate)

    def pipelined_loss(self, batch):
        return super().pipelined_loss(batch) + ALPHA * self.routing.loss("softmax")


def _tiny_with_hand_loss() -> DeepSeekMini:
    seed_everything(3)
    return WithHandBalanceLoss(**MOE_MODEL).double()


class LoggedBalanceLoss(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "moe/sequence_balance_loss" in trainer.callback_metrics:
            self.values.append(float(trainer.callback_metrics["moe/sequence_balance_loss"]))


@pytest.mark.parametrize(
    "dp, pp, ep, accumulate, checkpointing",
    [(1, 1, 1, 2, False), (2, 1, 2, 2, True), (1, 2, 1, 1, False)],
    ids=["one-process-accumulate2", "ep2-over-dp2-accumulate2-recomputed", "pp2-two-microbatches"],
)
def test_the_sequence_balance_loss_trains_to_the_hand_written_losss_parameters(dp, pp, ep, accumulate, checkpointing):
    """Parameters after 3 steps with ExpertLoadBalancer(sequence_balance_weight=ALPHA, bias_update_rate=0) equal
    single-process training on loss + ALPHA x DeepSeek-V3's formula written out per sequence: the weight, the mean over
    sequences and the scale over accumulated and pipeline micro-batches are checked together."""
    steps = 3
    strategy = "auto" if dp * pp == 1 else HybridParallelStrategy(  # one process: Lightning's own strategy
        data_parallel_size=dp, pipeline_parallel_size=pp, expert_parallel_size=ep, num_microbatches=2,
        gradient_checkpointing=checkpointing, start_method="forkserver",
    )
    logged = LoggedBalanceLoss()
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=dp * pp, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=PRECISION, accumulate_grad_batches=accumulate,
        callbacks=[ExpertLoadBalancer(bias_update_rate=0, sequence_balance_weight=ALPHA), logged],
    )
    module = _tiny()
    global_batch = PER_RANK_BATCH * dp * accumulate
    samples = steps * global_batch
    if strategy == "auto":  # no DistributedSampler: the data in the order the reference takes it
        data = DataLoader(Subset(TokenWindows(samples), lightning_epoch_order(samples)), batch_size=PER_RANK_BATCH)
    else:
        data = loader(samples, PER_RANK_BATCH)
    trainer.fit(module, data)
    actual = {k: v.detach() for k, v in module.state_dict().items()}
    expected = reference_training(_tiny_with_hand_loss, steps, global_batch)
    assert_state_close(actual, expected, steps)
    without = reference_training(_tiny, steps, global_batch)
    assert any(not torch.allclose(actual[k], without[k], rtol=0, atol=1e-6) for k in without), "the loss moved nothing"
    if dp * pp == 1:  # logged in this process: the step's mean over its forwards, a positive number near ALPHA
        assert logged.values and all(0.5 * ALPHA < v < 2 * ALPHA for v in logged.values), logged.values


@pytest.mark.parametrize("model_type", ["deepseek_v3", "mixtral"])
def test_the_sequence_balance_loss_reaches_hugging_face_routers(model_type):
    """transformers' DeepSeek-V3 (sigmoid scores, group-limited choice) and Mixtral (softmax, no router bias): the
    gradients with the hooks equal those of loss + ALPHA x the hand-written formula; the loss itself is unchanged."""
    pytest.importorskip("transformers")
    from lightning_ciuic.huggingface import HuggingFaceCausalLM
    from lightning_ciuic.parallel.balance_loss import SequenceBalanceLoss

    config = {
        "deepseek_v3": dict(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, moe_intermediate_size=8, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, experts_implementation="eager",
        ),
        "mixtral": dict(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager",
        ),
    }[model_type]
    scores = "sigmoid" if model_type == "deepseek_v3" else "softmax"
    batch = (TokenWindows(3, seed=1).data[:, :-1] % 64, TokenWindows(3, seed=2).data[:, :-1] % 64)

    def gradients(hooks: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seed_everything(4)
        module = HuggingFaceCausalLM(model_type, config).double().train()
        if hooks:
            SequenceBalanceLoss(module, ALPHA)
            loss = module.pipelined_loss(batch)
            reported = loss.detach()
        else:
            routing = _SeenRouting(module, lambda moe: moe.gate)
            loss = module.pipelined_loss(batch)
            reported = loss.detach()
            loss = loss + ALPHA * routing.loss(scores)
        loss.backward()
        return reported, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    (loss_with, with_hooks), (loss_plain, by_hand) = gradients(True), gradients(False)
    assert torch.equal(loss_with, loss_plain)
    assert with_hooks.keys() == by_hand.keys()
    # DeepSeek-V3 routes in float32 whatever the model's dtype: its terms differ by float32 rounding (a few operations
    # over <= 16 tokens x 8 experts each), Mixtral's by float64's.
    eps = torch.finfo(torch.float32 if model_type == "deepseek_v3" else torch.float64).eps
    for name in by_hand:
        atol = 64 * eps * float(by_hand[name].abs().max())
        torch.testing.assert_close(with_hooks[name], by_hand[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")
    router = next(n for n in by_hand if n.endswith("mlp.gate.weight"))
    seed_everything(4)
    plain = HuggingFaceCausalLM(model_type, config).double().train()
    plain.pipelined_loss(batch).backward()
    assert not torch.allclose(plain.get_parameter(router).grad, by_hand[router]), "the balance loss changed no gradient"


def test_balance_settings_that_cannot_work_are_refused_saying_what_would(monkeypatch):
    from lightning.pytorch.plugins import MixedPrecision

    from examples.deepseek import MixtureOfExperts
    from lightning_ciuic.parallel.balance_loss import SequenceBalanceLoss

    with pytest.raises(ValueError, match=r"balances nothing: set either above 0"):
        ExpertLoadBalancer(bias_update_rate=0)
    with pytest.raises(ValueError, match=r"sequence_balance_weight must be >= 0, got -1"):
        ExpertLoadBalancer(sequence_balance_weight=-1)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      plugins=[MixedPrecision("16-mixed", "cpu")],  # with its GradScaler: the Trainer on CPU takes bf16
                      callbacks=[ExpertLoadBalancer(sequence_balance_weight=1e-4)])
    with pytest.raises(ValueError, match=r"GradScaler's loss scale would not reach .* use precision='bf16-mixed'"):
        trainer.fit(_tiny().float(), loader(2, 2))
    monkeypatch.setattr(MixtureOfExperts, "router_score_function", None)
    with pytest.raises(ValueError, match=r"layers \['model.layers.1.ffn.experts'\] is unknown \(MixtureOfExperts, router Linear\)"):
        SequenceBalanceLoss(_tiny(), 1e-4)
