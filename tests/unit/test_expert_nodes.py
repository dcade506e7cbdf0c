"""Node-limited routing and placement: DeepSeek-V3's group-limited top-k (the example model's opt-in routing) against
transformers' router, a router's group limit said where the nodes do not hold whole groups, and the hierarchical
dispatch's arguments refused where they cannot apply (torch's fake process group: 16 ranks in one process)."""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from examples.deepseek import DeepSeekConfig, DeepSeekTransformer
from lightning_ciuic import HybridParallelStrategy
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.experts import group_limited_top_k
from lightning_ciuic.parallel.parallelize import parallelize


def test_group_limited_top_k_chooses_what_transformers_deepseek_v3_router_chooses():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=8, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, norm_topk_prob=True,
    )
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    router.weight.data.normal_()
    router.e_score_correction_bias.normal_(std=0.1)
    hidden = torch.randn(64, 8)
    _, _, theirs = router(hidden)
    scores = torch.nn.functional.linear(hidden, router.weight).sigmoid() + router.e_score_correction_bias
    ours = group_limited_top_k(scores, 4, 4, 2)
    assert torch.equal(ours.sort(dim=-1).values, theirs.sort(dim=-1).values)
    assert all(len(set(row)) <= 2 for row in (ours // 4).tolist())  # at most topk_group groups per token


def test_group_limited_top_k_with_one_group_is_the_plain_top_k_and_refuses_too_few_experts():
    scores = torch.randn(10, 8)
    assert torch.equal(group_limited_top_k(scores, 3, 1, 1), scores.topk(3, dim=-1).indices)
    with pytest.raises(ValueError, match=r"n_group=4 groups, topk_group=1, top 3: .* at least 3 experts"):
        group_limited_top_k(scores, 3, 4, 1)


def _parallelize(world: int, groups: int, topk: int, ungrouped_router: bool = False, **layout):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        config = ParallelismConfig(**layout)
        cfg = DeepSeekConfig(dim=32, n_layers=3, n_heads=2, n_routed_experts=16, moe_inter_dim=16, n_expert_groups=groups, topk_expert_groups=topk)
        with torch.device("meta"):
            model = DeepSeekTransformer(cfg)
        if ungrouped_router:  # a router that picks its top-k itself (as Mixtral's and Qwen3-MoE's do)
            del model.layers[2].ffn.n_group
        result = parallelize(model, config.resolve(world), config, materialize=False)
        result.routers = [(m.n_group, m.topk_group) for m in model.modules() if hasattr(m, "topk_group")]
        return result
    finally:
        dist.destroy_process_group()


def test_a_group_limit_that_the_nodes_do_not_hold_whole_is_said_once(recwarn):
    # ep 16 over 4 nodes of 4: 8 groups of 2 experts are whole on the nodes (4 experts each), 2 groups of 8 are not
    layout = dict(data_parallel_size=16, expert_parallel_size=16, expert_dispatch="hierarchical", expert_devices_per_node=4)
    result = _parallelize(16, 8, 2, **layout)
    assert result.experts.nodes.count == 4 and not [w for w in recwarn if "expert groups" in str(w.message)]
    with pytest.warns(UserWarning, match=r"limits each token to 1 of 2 expert groups \(8 experts each\), and ep=16 over 4"
                      r" nodes of 4 ranks .* a token may reach up to 2 nodes, not 1\. .* among \[1, 2\]"):
        _parallelize(16, 2, 1, **layout)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(expert_dispatch="tree", expert_parallel_size=2), r"expert_dispatch='tree': use one of \['flat', 'hierarchical'\]"),
        (dict(expert_dispatch="hierarchical"), r"expert_parallel_size=1 sends none"),
        (dict(expert_dispatch="hierarchical", expert_parallel_size=2, expert_devices_per_node=0), r"expert_devices_per_node"),
        (dict(expert_node_limit=1), r"expert_node_limit=1 .* expert_parallel_size=1 keeps every expert on every rank"),
    ],
)
def test_bad_dispatch_arguments_fail_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridParallelStrategy(**kwargs)


def test_the_hierarchical_dispatch_is_refused_where_the_ep_ranks_share_one_node():
    with pytest.raises(ValueError, match=r"the ep group \[0, 1, 2, 3\] sits on one node \(expert_devices_per_node=8\)"):
        _parallelize(8, 1, 1, data_parallel_size=8, expert_parallel_size=4, expert_dispatch="hierarchical", expert_devices_per_node=8)


NODE_LIMIT = dict(data_parallel_size=16, expert_parallel_size=16, expert_devices_per_node=4)  # 4 nodes of 4 ranks


def test_the_opt_in_node_limit_makes_each_node_a_group_of_the_routers():
    result = _parallelize(16, 1, 1, **NODE_LIMIT, expert_node_limit=2)
    assert result.routers == [(4, 2), (4, 2)] and result.experts.node_limit == 2  # what the planner's routing assumes


@pytest.mark.parametrize(
    "groups, ungrouped_router, layout, message",
    [
        (1, False, dict(NODE_LIMIT, expert_devices_per_node=16), r"expert_node_limit=2 .* sits on one node"),
        (1, False, dict(NODE_LIMIT, expert_node_limit=4), r"spans 4 nodes, so a limit of 4 limits nothing; use 1 to 3"),
        (2, False, NODE_LIMIT, r"routers \['layers.1.ffn', 'layers.2.ffn'\] already limit each token to some expert groups"),
        (1, True, NODE_LIMIT, r"of the 2 mixture-of-experts layers .* only 1 have a router the pack can limit"),
    ],
    ids=["one-node", "every-node", "already-grouped", "a-router-it-cannot-limit"],
)
def test_the_node_limit_is_refused_where_it_cannot_apply(groups, ungrouped_router, layout, message):
    layout = {"expert_node_limit": 2, **layout}
    with pytest.raises(ValueError, match=message):
        _parallelize(16, groups, 1, ungrouped_router, **layout)
