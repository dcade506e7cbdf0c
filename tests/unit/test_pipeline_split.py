"""Pipeline stage splitting without processes: balance, split points, placement, partition."""

import pytest
import torch
from torch import nn

from lightning_ciuic.parallel.schedule_bubble import schedule_bubble
from lightning_ciuic.parallel.pipeline import (
    OnAnotherStage,
    balanced_split,
    block_modules,
    partition,
    split_at,
    stage_ids_of_rank,
)


def test_balanced_split_minimizes_the_largest_stage():
    assert balanced_split([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_split([32, 200, 200, 200, 200, 1, 32], 2) == [0, 3]  # 432 | 433
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert balanced_split([3, 3, 3], 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot cut 3 pipeline blocks into 4 stages: each stage needs at least one block"):
        balanced_split([1, 1, 1], 4)


def test_split_points():
    names = ["embed", "l0", "l1", "l2", "head"]
    assert split_at(names, ["l1"], 2) == [0, 2]
    with pytest.raises(ValueError, match="1 pipeline split points give 2 stages, but .* = 4 stages are needed; give 3"):
        split_at(names, ["l1"], 4)
    with pytest.raises(ValueError, match=r"pipeline split point 'l9' is not a pipeline block; blocks are \['embed'"):
        split_at(names, ["l9"], 2)
    with pytest.raises(ValueError, match="must name distinct blocks in order, after the first block"):
        split_at(names, ["l2", "l1"], 3)


def test_stage_placement_and_bubble():
    assert stage_ids_of_rank(1, 2, 1, "1f1b") == [1]
    assert stage_ids_of_rank(1, 4, 2, "interleaved_1f1b") == [1, 5]
    assert stage_ids_of_rank(0, 2, 2, "zbv_zero_bubble") == [0, 3]


@pytest.mark.parametrize("pp, microbatches", [(2, 4), (4, 4), (4, 8), (16, 32)])
def test_a_schedules_bubble_is_its_order_of_actions_played_with_equal_stages(pp, microbatches):
    """GPipe and 1F1B give their closed form, interleaved 1F1B its own; the zero-bubble schedules and DualPipeV
    (DeepSeek-V3's, under its V placement) idle less than 1F1B, and more than nothing."""
    one_stage = (pp - 1) / (microbatches + pp - 1)
    assert schedule_bubble("gpipe", pp, microbatches) == pytest.approx(one_stage)
    assert schedule_bubble("1f1b", pp, microbatches) == pytest.approx(one_stage)
    assert schedule_bubble("interleaved_1f1b", pp, microbatches, 2) == pytest.approx((pp - 1) / (2 * microbatches + pp - 1))
    for schedule in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"):
        if schedule == "dualpipev" and microbatches < 2 * pp:
            continue  # torch's DualPipeV needs a micro-batch per stage
        assert 0 < schedule_bubble(schedule, pp, microbatches, 2) < schedule_bubble("interleaved_1f1b", pp, microbatches, 2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 10)


BLOCKS = ["embed", "layers.0", "layers.1", "layers.2", "head"]


def test_partition_keeps_parameter_names_and_explains_a_call_to_another_stage():
    net = Net()
    full = set(net.state_dict())
    (stage,) = partition(net, BLOCKS, [0, 2], [1])
    assert set(net.state_dict()) == {k for k in full if k.startswith(("layers.1", "layers.2", "head"))}
    assert isinstance(net.embed, OnAnotherStage)
    assert len(stage.blocks) == 3 and stage(torch.randn(2, 4)).shape == (2, 10)
    with pytest.raises(RuntimeError, match="'embed' runs on pipeline stage 0, not on this rank"):
        net.embed(torch.tensor([1]))


def test_block_protocol_errors():
    with pytest.raises(ValueError, match=r"pipeline blocks \['layers.7'\] are not sub-modules of Net"):
        block_modules(Net(), ["embed", "layers.7"])
    with pytest.raises(ValueError, match=r"parameters \['head.weight', 'head.bias'\] belong to no pipeline block"):
        block_modules(Net(), BLOCKS[:-1])
    tied = Net()
    tied.head.weight = tied.layers[0].weight
    with pytest.raises(ValueError, match="a parameter is shared by pipeline blocks 'layers.0' and 'head'"):
        block_modules(tied, BLOCKS)
    with pytest.raises(ValueError, match="pipeline blocks must be distinct"):
        block_modules(Net(), ["embed", "embed"])


def test_a_pipeline_module_runs_through_the_runner_attached_to_it_and_its_copies_hold_none():
    import copy

    from lightning_ciuic.parallel.pipeline_module import PipelineModule

    class Two(PipelineModule, nn.Module):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)

        def forward(self, x):
            return self.b(self.a(x))

        def pipeline_blocks(self):
            return ["a", "b"]

        def pipeline_loss(self, outputs, targets):
            return (outputs - targets).pow(2).mean()

    class Runner:  # what the cut hands the module: its stages' schedule
        def forward(self, inputs):
            return "through the runner"

    module = Two()
    x = torch.ones(3, 2)
    assert module.pipeline is None and torch.equal(module.pipelined_forward(x), module(x))
    module.attach_pipeline(Runner())
    assert module.pipelined_forward(x) == "through the runner"
    assert copy.deepcopy(module).pipeline is None  # a copy is no rank's stages


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_mixture_of_experts_stages_are_balanced_by_the_parameters_a_token_passes(family):
    """Balanced by parameter count, the stage holding the dense layers (and the embedding) of a model whose experts
    hold most of its parameters gets more layers, FLOPs and activations than the others: the split counts of each
    experts module only its router's top_k (transformers' DeepSeek-V3 and Qwen3-MoE, 2 dense layers of 8, 4 stages).
    Checked against the forward FLOPs of each block, the planner's count: the cut is the one balancing them."""
    import transformers

    from lightning_ciuic.huggingface import HuggingFaceCausalLM
    from lightning_ciuic.parallel.experts import parameters_per_token
    from lightning_ciuic.parallel.pipeline_module import PipelineConfig, stage_starts
    from lightning_ciuic.planner.flops import LocalFlops

    shapes = dict(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2)
    config = {
        "deepseek_v3": dict(n_routed_experts=64, first_k_dense_replace=2, q_lora_rank=32, kv_lora_rank=16,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
        "qwen3_moe": dict(num_experts=64, mlp_only_layers=[0, 1], head_dim=16),
    }[family]
    module = HuggingFaceCausalLM(model_type=family, config={**shapes, **config})
    names = module.pipeline_blocks()
    blocks = [module.get_submodule(n) for n in names]
    sparse = next(b for b in blocks if any(n.endswith("experts") for n, _ in b.named_modules()))
    experts = next(m for n, m in sparse.named_modules() if n.endswith("experts"))
    held = sum(p.numel() for p in experts.parameters())
    assert parameters_per_token(sparse) == sum(p.numel() for p in sparse.parameters()) - held + held * 2 // 64

    flops, tokens = [], torch.randint(0, 64, (1, 16))  # each block's forward FLOPs (grouped GEMMs too)
    with torch.no_grad():
        x, calls = module.pipeline_inputs((tokens, tokens))[0], module.pipeline_block_calls()
        for name, block in zip(names, blocks):
            with LocalFlops() as counter:
                x = calls[name](block, x) if name in calls else block(x)
            flops.append(counter.total)

    def slowest_stage(starts):
        bounds = [*starts, len(names)]
        return max(sum(flops[bounds[s]:bounds[s + 1]]) for s in range(len(starts)))

    best = slowest_stage(balanced_split(flops, 4))  # the cut that balances the FLOPs themselves
    by_count = balanced_split([sum(p.numel() for p in b.parameters()) for b in blocks], 4)
    assert slowest_stage(by_count) > 1.3 * best  # the old cut: 1.47x (DeepSeek-V3), 1.40x (Qwen3-MoE)
    assert slowest_stage(stage_starts(module, names, 4, PipelineConfig())) == best
