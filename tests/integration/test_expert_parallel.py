"""Expert parallelism trains to the parameters of single-process training (float64, tolerance from the numerics:
tests/helpers.rounding_atol), on the example model and on Hugging Face mixture-of-experts models."""

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from tests.helpers import PRECISION, TINY_MODEL, assert_state_close, loader, reference_training

STEPS, PER_RANK_BATCH = 4, 2
MOE_MODEL = {**TINY_MODEL, "n_routed_experts": 4}


def _tiny() -> DeepSeekMini:
    seed_everything(7)
    return DeepSeekMini(**MOE_MODEL).double()


@pytest.mark.parametrize(
    "dp, shard, pp, ep, clip",
    [(2, 1, 1, 2, 0.05), (2, 2, 1, 2, None), (4, 4, 1, 2, 0.05), (4, 2, 1, 2, None), (2, 1, 2, 2, 0.05)],
    ids=["ep2-over-dp2", "ep2-over-fsdp2", "ep2-over-fsdp4", "ep2-over-hsdp2x2", "ep2-pp2"],
)
def test_expert_parallel_layout_matches_single_process(dp, shard, pp, ep, clip):
    strategy = HybridParallelStrategy(
        data_parallel_size=dp, data_parallel_shard_size=shard, pipeline_parallel_size=pp, expert_parallel_size=ep,
        num_microbatches=2, start_method="forkserver",
    )
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=dp * pp, max_steps=STEPS, logger=False, gradient_clip_val=clip,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, precision=PRECISION,
    )
    module = _tiny()
    global_batch = PER_RANK_BATCH * dp
    trainer.fit(module, loader(STEPS * global_batch, PER_RANK_BATCH))
    actual = {k: v.detach() for k, v in module.state_dict().items()}
    assert_state_close(actual, reference_training(_tiny, STEPS, global_batch, clip=clip), STEPS)
