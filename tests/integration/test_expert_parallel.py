"""Expert parallelism trains to the parameters of single-process training (float64, tolerance from the numerics:
tests/helpers.rounding_atol), on the example model and on Hugging Face mixture-of-experts models."""

import functools
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from lightning_ciuic.parallel.experts import dispatched_output, packed_experts
from lightning_ciuic.parallel.fp8 import use_fp8_gemms
from lightning_ciuic.parallel.parallelize import named_blocks
from tests.helpers import PRECISION, SEQ_LEN, TINY_MODEL, assert_state_close, loader, reference_training

STEPS, PER_RANK_BATCH = 4, 2
MOE_MODEL = {**TINY_MODEL, "n_routed_experts": 4}


def _tiny() -> DeepSeekMini:
    seed_everything(7)
    return DeepSeekMini(**MOE_MODEL).double()


@pytest.mark.parametrize(
    "dp, shard, pp, tp, ep, clip, overlap",
    [
        (2, 1, 1, 1, 2, 0.05, False), (2, 2, 1, 1, 2, None, False), (4, 4, 1, 1, 2, 0.05, False), (4, 2, 1, 1, 2, None, False),
        (2, 1, 2, 1, 2, 0.05, False), (2, 2, 1, 2, 2, 0.05, False), (2, 2, 1, 2, 4, 0.05, False), (2, 1, 1, 2, 4, None, False),
        (2, 1, 1, 1, 2, 0.05, True), (2, 2, 1, 2, 4, 0.05, True),
    ],
    ids=[
        "ep2-over-dp2", "ep2-over-fsdp2", "ep2-over-fsdp4", "ep2-over-hsdp2x2", "ep2-pp2", "ep2-over-fsdp2-tp2",
        "ep4-over-fsdp2xtp2", "ep4-over-dp2xtp2", "ep2-over-dp2-overlap", "ep4-over-fsdp2xtp2-overlap",
    ],
)
def test_expert_parallel_layout_matches_single_process(dp, shard, pp, tp, ep, clip, overlap):
    """``overlap``: expert_dispatch_overlap, each layer's tokens in two chunks, one's all-to-alls while the other computes."""
    _fit_and_compare(dp, shard, pp, tp, ep, clip, expert_dispatch_overlap=overlap)


@pytest.mark.parametrize(
    "recompute, tp, overlap",
    [
        (True, 1, False), ("selective", 1, False), ({"recompute": ["norm", "mla_up"]}, 1, False),
        ("selective", 2, False), ({"recompute": ["norm"]}, 2, False), ("selective", 1, True),
    ],
    ids=["full", "selective", "deepseek-recipe", "selective-tp2", "norms-tp2", "selective-overlap"],
)
def test_accumulation_and_activation_checkpointing_with_experts_sharded(recompute, tp, overlap):
    """Two micro-batches per step, activations recomputed in backward: every block, torchtitan's op-level policy
    (the dispatch's all-to-alls recomputed; also overlapped, asynchronous), DeepSeek-V3's norms and MLA
    up-projections; under FSDP 2 x tp 2 (ep 4) with sequence parallelism, whose linears keep the norms' (recomputed)
    output as their part of the gathered input."""
    _fit_and_compare(
        2, 2, 1, tp, 2 * tp, 0.05, accumulate=2, gradient_checkpointing=recompute, expert_dispatch_overlap=overlap
    )


def _grouped() -> DeepSeekMini:
    """DeepSeek-V3's group-limited routing: 4 experts in 2 groups, each token's 2 experts in its best group."""
    seed_everything(7)
    return DeepSeekMini(**MOE_MODEL, n_expert_groups=2, topk_expert_groups=1).double()


@pytest.mark.parametrize(
    "dp, shard, pp, ep, per_node, overlap",
    [(4, 4, 1, 4, 2, False), (2, 1, 1, 2, 1, False), (2, 2, 1, 4, 2, False), (2, 1, 2, 2, 1, False), (2, 1, 2, 2, 1, True)],
    ids=[
        "ep4-as-2-nodes-of-2-over-fsdp4", "ep2-as-2-nodes-of-1-over-dp2", "ep4-over-fsdp2xtp2-as-2-nodes-of-2",
        "ep2-as-2-nodes-of-1-pp2", "ep2-as-2-nodes-of-1-pp2-overlap",
    ],
)
def test_hierarchical_dispatch_with_group_limited_routing_matches_single_process(dp, shard, pp, ep, per_node, overlap):
    """A token crosses the (simulated: node = rank // expert_devices_per_node) inter-node hop once per node, each node
    holding one expert group; with FSDP, with the tp peers in ep (tp = ep / dp_shard), with pp 2; overlapped."""
    tp = ep // shard if ep > shard else 1
    _fit_and_compare(
        dp, shard, pp, tp, ep, 0.05, factory=_grouped, expert_dispatch="hierarchical", expert_devices_per_node=per_node,
        expert_dispatch_overlap=overlap,
    )


def test_the_opt_in_node_limit_trains_as_the_model_routed_by_node_groups():
    """``expert_node_limit=1`` on the example model without groups, ep 4 as 2 nodes of 2 (flat dispatch): each token's
    experts on one node, the parameters of one process training the model with one group per node, one per token."""
    _fit_and_compare(4, 4, 1, 1, 4, 0.05, reference=_grouped, expert_devices_per_node=2, expert_node_limit=1)


def _fit_and_compare(
    dp, shard, pp, tp, ep, clip, accumulate=1, gradient_checkpointing=False, factory=_tiny, reference=None, steps=STEPS,
    per_rank=PER_RANK_BATCH, microbatches=2, callbacks=(), **dispatch,
):
    strategy = HybridParallelStrategy(
        data_parallel_size=dp, data_parallel_shard_size=shard, pipeline_parallel_size=pp, tensor_parallel_size=tp,
        expert_parallel_size=ep, num_microbatches=microbatches, start_method="forkserver",
        gradient_checkpointing=gradient_checkpointing, **dispatch,
    )
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=dp * pp * tp, max_steps=steps, logger=False, gradient_clip_val=clip,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, precision=PRECISION,
        accumulate_grad_batches=accumulate, callbacks=list(callbacks),
    )
    module = factory()
    global_batch = per_rank * dp * accumulate
    trainer.fit(module, loader(steps * global_batch, per_rank))
    actual = {k: v.detach() for k, v in module.state_dict().items()}
    assert_state_close(actual, reference_training(reference or factory, steps, global_batch, clip=clip), steps)


# gemm_precision="fp8": widths FP8's kernels take (multiples of 16: kv_lora_rank + the rotary part)
FP8_MODEL = {**MOE_MODEL, "kv_lora_rank": 16, "qk_rope_head_dim": 16}


def _fp8_tiny() -> DeepSeekMini:
    seed_everything(7)
    return DeepSeekMini(**FP8_MODEL).double()


def _fp8_reference() -> DeepSeekMini:
    """One process, the blocks' linears and the experts by FP8 GEMMs (the experts as expert parallelism runs them)."""
    module = _fp8_tiny()
    use_fp8_gemms(*named_blocks(module, "gemm_precision='fp8'"))
    for _, experts in packed_experts(module):
        experts.forward = functools.partial(dispatched_output, experts, fp8=True)
    return module


def test_fp8_gemms_train_as_one_process_with_the_same_fp8_gemms():
    """ep 2 over FSDP 2 with pp 2: every scale belongs to one token or one weight channel, so the layout computes what
    one process computes with the same FP8 GEMMs, to float64's rounding; and FP8 did run: one process without it
    ends elsewhere."""
    _fit_and_compare(2, 2, 2, 1, 2, 0.05, factory=_fp8_tiny, reference=_fp8_reference, gemm_precision="fp8")
    fp8, plain = (reference_training(f, 1, 4, clip=0.05) for f in (_fp8_reference, _fp8_tiny))
    assert max((fp8[k] - plain[k]).abs().max().item() for k in plain) > 1e-5


HF_COMMON = dict(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=32,
    num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, experts_implementation="eager",
)
HF_MOE = {
    "qwen3_moe": dict(HF_COMMON, num_experts=4, moe_intermediate_size=16, norm_topk_prob=True),
    "mixtral": dict(HF_COMMON, num_local_experts=4),
    # DeepSeek-V3's group-limited router: 4 experts in 2 groups, each token's 2 in its best group (routed in float32)
    "deepseek_v3": dict(
        HF_COMMON, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1,
        first_k_dense_replace=1, moe_intermediate_size=16, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8,
    ),
}


def _hugging_face(model_type: str):
    def build():
        from lightning_ciuic.huggingface import HuggingFaceCausalLM

        seed_everything(5)
        return HuggingFaceCausalLM(model_type, HF_MOE[model_type], lr=1e-2).double()

    return build


@pytest.mark.parametrize(
    "model_type, shard, tp, ep, overlap",
    [
        ("qwen3_moe", 1, 1, 2, False), ("qwen3_moe", 2, 1, 2, False), ("mixtral", 1, 1, 2, False), ("mixtral", 2, 1, 2, False),
        ("mixtral", 2, 2, 4, False), ("qwen3_moe", 2, 2, 4, False), ("qwen3_moe", 1, 2, 2, False), ("qwen3_moe", 2, 1, 2, True),
    ],
    ids=[
        "qwen3_moe-replicated", "qwen3_moe-fsdp", "mixtral-replicated", "mixtral-fsdp", "mixtral-fsdp2xtp2-ep4",
        "qwen3_moe-fsdp2xtp2-ep4", "qwen3_moe-dp2xtp2-ep2", "qwen3_moe-fsdp-overlap",
    ],
)
def test_hugging_face_moe_families_train_with_experts_sharded(model_type, shard, tp, ep, overlap):
    """transformers' own experts modules (packed weights, routed in float32 by the model) over dp=2 (x tp=2: the
    Hugging Face tensor-parallel plan for attention, experts split by ep over the tp peers too). Qwen3-MoE's per-head
    q_norm / k_norm under tp ("replicated_with_grad_allreduce"): each rank's gradient is its heads' part, summed over
    tp (trained on the partial gradients, the run was 0.036 off single-process training after 4 steps). ``overlap``:
    expert_dispatch_overlap (two chunks, one's all-to-alls while the other computes)."""
    pytest.importorskip("transformers")
    factory = _hugging_face(model_type)
    strategy = HybridParallelStrategy(
        data_parallel_size=2, data_parallel_shard_size=shard, tensor_parallel_size=tp, expert_parallel_size=ep,
        expert_dispatch_overlap=overlap, start_method="forkserver",
    )
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2 * tp, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=PRECISION,
    )
    module = factory()
    trainer.fit(module, loader(STEPS * PER_RANK_BATCH * 2, PER_RANK_BATCH))
    actual = {k: v.detach() for k, v in module.state_dict().items()}
    assert_state_close(actual, reference_training(factory, STEPS, PER_RANK_BATCH * 2), STEPS, lr=1e-2)


class _PairsRun(Callback):
    """Each rank writes how many forward-backward pairs it ran interleaved, and how often their sides took turns."""

    def __init__(self, directory) -> None:
        self.directory = str(directory)

    def on_train_end(self, trainer, pl_module):
        from lightning_ciuic.parallel.paired_overlap import PAIR_STATS

        Path(self.directory, f"pairs-{trainer.global_rank}.json").write_text(json.dumps(PAIR_STATS))


def _grouped_deeper() -> DeepSeekMini:
    """:func:`_grouped` with 4 layers, 3 of them mixtures of experts: under DualPipeV's 4 stages over pp 2 both sides of
    a forward-backward pair hold experts."""
    seed_everything(7)
    return DeepSeekMini(**{**MOE_MODEL, "n_layers": 4}, n_expert_groups=2, topk_expert_groups=1).double()


def _qwen3_moe_deeper():
    """transformers' Qwen3-MoE with 4 layers, each a mixture of experts."""
    from lightning_ciuic.huggingface import HuggingFaceCausalLM

    seed_everything(5)
    return HuggingFaceCausalLM("qwen3_moe", dict(HF_MOE["qwen3_moe"], num_hidden_layers=4), lr=1e-2).double()


DEEPSEEK_RECIPE = {"recompute": ["norm", "mla_up"]}


@pytest.mark.parametrize(
    "factory, shard, tp, ep, dispatch, per_node, recompute",
    [
        (_grouped_deeper, 1, 1, 2, "flat", None, DEEPSEEK_RECIPE),
        (_grouped_deeper, 1, 1, 2, "hierarchical", 1, DEEPSEEK_RECIPE),
        (_grouped_deeper, 2, 1, 2, "flat", None, DEEPSEEK_RECIPE),
        (_grouped_deeper, 2, 2, 4, "flat", None, DEEPSEEK_RECIPE),
        (_qwen3_moe_deeper, 1, 1, 2, "flat", None, False),
    ],
    ids=["flat", "hierarchical", "fsdp2", "fsdp2-tp2-ep4", "qwen3_moe"],
)
def test_dualpipev_forward_backward_pairs_overlapped_train_as_one_process(
    factory, shard, tp, ep, dispatch, per_node, recompute, tmp_path,
):
    """DualPipeV over pp 2 x dp 2 with expert_dispatch_overlap: its forward-backward pairs run interleaved, one
    micro-batch's all-to-alls in flight while the other computes (parallel/paired_overlap.py), with DeepSeek-V3's
    recomputation on the example model (ep 2 over dp 2, flat and hierarchical; over FSDP 2; ep 4 over FSDP 2 x tp 2),
    and transformers' Qwen3-MoE: the parameters of one process. Every rank ran its pairs (3 a step at 4 micro-batches)
    and their sides took turns at the all-to-alls (at least 2 a pair where both sides hold experts: 6 flat, 12
    hierarchical on the example model)."""
    if factory is _qwen3_moe_deeper:
        pytest.importorskip("transformers")
    _fit_and_compare(
        2, shard, 2, tp, ep, 0.05, factory=factory, gradient_checkpointing=recompute, steps=3, per_rank=4, microbatches=4,
        pipeline_schedule="dualpipev", expert_dispatch_overlap=True, expert_dispatch=dispatch,
        expert_devices_per_node=per_node, callbacks=[_PairsRun(tmp_path)],
    )
    ranks = 2 * 2 * tp
    stats = [json.loads((tmp_path / f"pairs-{rank}.json").read_text()) for rank in range(ranks)]
    assert [s["pairs"] for s in stats] == [3 * 3] * ranks, stats
    # pipeline rank 1 (the second half of the global ranks: pp is the mesh's outer axis) holds stages 1 and 2,
    # mixtures of experts both: the sides of each pair hand over at their waits (pipeline rank 0's stages 0 and 3 hold
    # the embedding and the head, and one of them no all-to-all, or none)
    assert min(s["turns"] for s in stats[ranks // 2:]) >= 2 * 3 * 3, stats


@pytest.mark.parametrize("overlap", [False, True], ids=["pairs-in-turn", "pairs-overlapped"])
def test_fp8_gemms_under_dualpipev_with_deepseeks_recomputation_train_as_one_process(overlap):
    """DualPipeV over pp 2 x ep 2 with DeepSeek-V3's recomputation recipe: its input passes leave the FP8 linears'
    weight gradients to its weight passes (parallel/fp8.py, weight_gradients_deferred), as one process computes them;
    also with its forward-backward pairs overlapped (expert_dispatch_overlap). Four micro-batches of one sequence per
    rank (the schedule needs one per stage)."""
    _fit_and_compare(
        2, 1, 2, 1, 2, None, gradient_checkpointing={"recompute": ["norm", "mla_up"]}, factory=_fp8_tiny,
        reference=_fp8_reference, steps=3, per_rank=4, microbatches=4, pipeline_schedule="dualpipev", gemm_precision="fp8",
        expert_dispatch_overlap=overlap,
    )


HF_FP8 = {  # widths FP8's kernels take: multiples of 16
    "qwen3_moe": HF_MOE["qwen3_moe"],
    "deepseek_v3": dict(HF_MOE["deepseek_v3"], kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
}


def _hugging_face_fp8(model_type: str, reference: bool):
    def build():
        from lightning_ciuic.huggingface import HuggingFaceCausalLM

        seed_everything(5)
        module = HuggingFaceCausalLM(model_type, HF_FP8[model_type], lr=1e-2).double()
        if reference:  # one process, as _fp8_reference
            use_fp8_gemms(*named_blocks(module, "gemm_precision='fp8'"))
            for _, experts in packed_experts(module):
                experts.forward = functools.partial(dispatched_output, experts, fp8=True)
        return module

    return build


@pytest.mark.parametrize("model_type, steps", [("qwen3_moe", STEPS), ("deepseek_v3", 1)])
def test_hugging_face_moe_families_train_with_fp8_gemms_as_one_process(model_type, steps):
    """transformers' DeepSeek-V3 and Qwen3-MoE, ep 2 over FSDP 2, gemm_precision="fp8": as one process with the same
    FP8 GEMMs (their routers, not nn.Linear or beside the experts, stay in float64). DeepSeek-V3 routes in float32:
    from the second step, its routing weights differ from one process's by float32's rounding of parameters that
    differ by float64's, and a weight that tips an intermediate's e4m3 rounding moves it a whole code (a router
    weight 1.6e-6 off after 4 steps), so one step, from equal parameters."""
    pytest.importorskip("transformers")
    _fit_and_compare(
        2, 2, 1, 1, 2, None, factory=_hugging_face_fp8(model_type, reference=False),
        reference=_hugging_face_fp8(model_type, reference=True), steps=steps, gemm_precision="fp8",
    )


class _MeanLosses(Callback):
    """Global rank 0 writes each step's loss, averaged over the (equal) data-parallel batches, to ``path`` (JSON)."""

    def __init__(self, path) -> None:
        self.path, self.losses = str(path), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import torch.distributed as dist

        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)
        self.losses.append(float(loss) / dist.get_world_size())

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.losses))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_hugging_face_moe_families_train_with_the_hierarchical_dispatch(model_type, tmp_path):
    """ep 2 as 2 simulated nodes of 1 rank over FSDP 2: a token crosses once per node. Qwen3-MoE to the parameters of
    one process; DeepSeek-V3 (each node one expert group) routes in float32 by design, so a last-bit difference can
    flip a discrete expert choice: its losses compared, as tests/integration/test_hugging_face.py does."""
    pytest.importorskip("transformers")
    factory, recorder = _hugging_face(model_type), _MeanLosses(tmp_path / "losses.json")
    strategy = HybridParallelStrategy(
        data_parallel_size=2, data_parallel_shard_size=2, expert_parallel_size=2, expert_dispatch="hierarchical",
        expert_devices_per_node=1, start_method="forkserver",
    )
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=PRECISION, callbacks=[recorder],
    )
    module = factory()
    trainer.fit(module, loader(STEPS * PER_RANK_BATCH * 2, PER_RANK_BATCH))
    expected_losses: list[float] = []
    expected = reference_training(factory, STEPS, PER_RANK_BATCH * 2, losses=expected_losses)
    assert json.loads((tmp_path / "losses.json").read_text()) == pytest.approx(expected_losses, rel=1e-4)
    if model_type != "deepseek_v3":
        actual = {k: v.detach() for k, v in module.state_dict().items()}
        assert_state_close(actual, expected, STEPS, lr=1e-2)


def _fit_for(steps: int, tmp_path, ckpt_path=None, **layout):
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = HybridParallelStrategy(data_parallel_size=2, start_method="forkserver", **layout)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2 * layout.get("tensor_parallel_size", 1), max_steps=steps,
        logger=False, callbacks=[checkpoints],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, precision=PRECISION,
    )
    module = _tiny()
    trainer.fit(module, loader(3 * 2 * PER_RANK_BATCH, PER_RANK_BATCH), ckpt_path=ckpt_path)
    return {k: v.detach() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(
    "saved_layout, resume_layout",
    [
        (dict(expert_parallel_size=2), dict()),
        (dict(expert_parallel_size=2), dict(data_parallel_shard_size=2, expert_parallel_size=2)),
        (dict(expert_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel_size=4)),
        (dict(), dict(expert_parallel_size=2)),
    ],
    ids=["ep2-into-replicated-ep1", "ep2-into-fsdp2-ep2", "ep2-into-dp2xtp2-ep4", "replicated-ep1-into-ep2"],
)
def test_a_checkpoint_of_an_expert_parallel_run_resumes_in_another_layout(tmp_path, saved_layout, resume_layout):
    """Saved at step 3 by dp 2 (replicated) with or without ep 2, resumed to step 6 in another layout: the parameters
    of single-process training for 6 steps."""
    _fit_for(3, tmp_path, **saved_layout)
    step3 = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    if saved_layout:
        assert (step3 / ".metadata").is_file(), "expert shards make the checkpoint a DCP directory"
    resumed = _fit_for(6, tmp_path / "resumed", ckpt_path=str(step3), **resume_layout)
    expected = reference_training(_tiny, 6, 2 * PER_RANK_BATCH, num_samples=3 * 2 * PER_RANK_BATCH)
    assert_state_close(resumed, expected, 6)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_the_monitor_counts_the_token_exchange_and_the_balance(tmp_path, capfd, overlap):
    """Overlapped, the all-to-alls' wall time (ep_comm) is more than the time the training thread was blocked on them
    (ep_exposed); blocking, the two are the same."""
    import json

    from lightning_ciuic import CommunicationMonitor

    steps = 6
    trainer = Trainer(
        strategy=HybridParallelStrategy(
            data_parallel_size=2, expert_parallel_size=2, expert_dispatch_overlap=overlap, start_method="forkserver"
        ),
        accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[CommunicationMonitor(measure_link=False, gather_every=3, trace=True)],
    )
    trainer.fit(DeepSeekMini(**MOE_MODEL), loader(steps * PER_RANK_BATCH * 2, PER_RANK_BATCH))
    record = json.loads((tmp_path / "monitor" / "monitor.json").read_text())
    profile = record["profile"]
    assert profile["ep"] == 2
    # every (token, expert) pair of the global batch runs on exactly one rank, every step
    pairs = 2 * PER_RANK_BATCH * SEQ_LEN * MOE_MODEL["n_activated_experts"]
    assert sum(rank["ep_tokens"] for rank in profile["ranks"]) == pytest.approx(pairs)
    assert all(rank["ep_bytes"] > 0 and rank["ep_comm"] > 0 for rank in profile["ranks"])
    for rank in profile["ranks"]:
        assert 0 < rank["ep_exposed"] < rank["ep_comm"] if overlap else rank["ep_exposed"] == pytest.approx(rank["ep_comm"]), rank
    assert all(rank["ep_inter_bytes"] == 0 for rank in profile["ranks"])  # the cluster's one node of 2 devices
    # each MoE layer's step: counts, dispatch, combine forward; combine and dispatch gradients backward
    spans = [event for rank in record["trace"] for event in rank if event[0] == "ep collectives"]
    assert {event[1] for event in spans} == {"ep counts", "ep dispatch", "ep combine", "ep combine gradient", "ep dispatch gradient"}
    per_rank_ms = [sum(e[4] - e[3] for e in rank if e[0] == "ep collectives") / 1e6 for rank in record["trace"]]
    assert all(ms > 0 for ms in per_rank_ms)
    assert list(profile["expert_load"]) == ["model.layers.1.ffn.experts"] and profile["expert_load"]["model.layers.1.ffn.experts"] >= 1
    out = capfd.readouterr()
    assert "experts (ep=2): tokens per expert max/mean over the run: model.layers.1.ffn.experts" in out.out + out.err
    assert ("hidden behind compute" in out.out + out.err) and (overlap or "(0% hidden behind compute" in out.out + out.err)


class _ExpertReplicas(Callback):
    """Rank 0 records whether the ranks holding the same experts (edp) hold equal expert shards, and every data-
    parallel rank equal dense parameters, and how many expert gradient collectives ran."""

    def on_train_end(self, trainer, pl_module):
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        experts = trainer.strategy.parallelized.experts
        ids = experts.parameter_ids()
        result = {}
        for name, tensors, group in (
            ("experts", [p.to_local() for p in experts.parameters()], experts.data_mesh.get_group()),
            ("dense", [p for p in pl_module.parameters() if id(p) not in ids and not isinstance(p, DTensor)], None),
        ):
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            copies = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
            dist.all_gather(copies, flat, group=group)
            result[name] = all(torch.equal(c, flat) for c in copies)
        engine = trainer.strategy.data_parallel
        result["expert_collectives"] = engine.synchronizers["experts"].stats.collectives
        result["expert_bytes"] = engine.synchronizers["experts"].stats.bytes_sent
        result["dense_bytes"] = engine.synchronizers["dense"].stats.bytes_sent
        result["engine_bytes"] = engine.stats.bytes_sent
        result["expert_numel"] = sum(p.to_local().numel() for p in experts.parameters())
        result["dense_numel"] = sum(p.numel() for p in pl_module.parameters() if p.requires_grad and id(p) not in ids)
        if trainer.is_global_zero:
            trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in result.items()})


def test_compressed_gradients_with_experts_sharded_keep_every_copy_equal(tmp_path):
    """dp=4, ep=2 (edp=2), int8 gradient compression with error feedback: expert gradients go through the same codec
    over their own group (their residuals apart from the dense ones'), and every copy of a tensor stays equal. The
    replicated run reports its expert gradients' bytes: the engine's counters and the monitor's dp payload and bytes
    include them."""
    import json

    from lightning_ciuic import CommunicationMonitor

    trainer = Trainer(
        strategy=HybridParallelStrategy(
            data_parallel_size=4, expert_parallel_size=2, communication_compression="int8", start_method="forkserver"
        ),
        accelerator="cpu", devices=4, max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[_ExpertReplicas(), CommunicationMonitor(measure_link=False)],
    )
    trainer.fit(DeepSeekMini(**MOE_MODEL), loader(3 * PER_RANK_BATCH * 4, PER_RANK_BATCH))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["experts"] == 1.0 and metrics["dense"] == 1.0, metrics
    assert metrics["expert_collectives"] >= 3, metrics
    assert metrics["expert_bytes"] > 0 and metrics["engine_bytes"] == metrics["dense_bytes"] + metrics["expert_bytes"], metrics
    profile = json.loads((tmp_path / "monitor" / "monitor.json").read_text())["profile"]
    numel = metrics["dense_numel"] + metrics["expert_numel"]  # rank 0's gradients: dense, and its 2 of 4 experts
    assert metrics["expert_numel"] > 0 and profile["gradient_numel"] == numel, (profile["gradient_numel"], metrics)
    rank0 = profile["ranks"][0]  # the step after the monitor's warm-up: one sync of every gradient, in float32
    assert rank0["dp_payload"] == 4 * numel and rank0["dp_bytes"] == metrics["engine_bytes"] / 3, (rank0, metrics)


def _fit_then_validate(rank: int, world: int, out: str) -> None:
    """In one process per rank (as "popen" runs them): fit, then validate twice with the same Trainer and module,
    which Lightning sets up again each time."""
    import json
    import os

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    losses = {}
    for name, layout in (("ep1", {}), ("ep2", dict(expert_parallel_size=2)),
                         ("fsdp2-ep2", dict(data_parallel_shard_size=2, expert_parallel_size=2))):
        trainer = Trainer(
            strategy=HybridParallelStrategy(data_parallel_size=2, **layout), accelerator="cpu", devices=world,
            max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, precision=PRECISION,
        )
        module = _tiny()
        trainer.fit(module, loader(2 * 2 * PER_RANK_BATCH, PER_RANK_BATCH))
        losses[name] = [trainer.validate(module, loader(4, 2), verbose=False)[0]["val/loss"] for _ in range(2)]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(losses, f)


def test_validating_after_fit_in_the_same_processes_keeps_each_ranks_experts(tmp_path):
    """A second set-up of a parallelized model reuses it: before, the replicated run broadcast rank 0's expert shard
    over its peer's (validation loss 5.0146 where 4.9957 was right) and FSDP2 x ep took its own units for a user's."""
    import json

    from tests.helpers import run_workers

    run_workers(_fit_then_validate, 2, str(tmp_path / "losses.json"))
    losses = json.loads((tmp_path / "losses.json").read_text())
    expected = losses["ep1"][0]  # no expert shards to mistake
    for name, values in losses.items():
        assert values == pytest.approx([expected, expected], rel=1e-9), (name, losses)


def test_the_example_experts_train_under_bf16_autocast():
    """Autocast runs the experts' projections in bfloat16 while their float32 output buffer stays: they add up cast."""
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, precision="bf16-mixed")
    module = _tiny().float()
    trainer.fit(module, loader(4, 2))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


class BiasedExpertsModel(DeepSeekMini):
    """The example model with a bias on every routed expert's gate/up projection, in the experts' own forward: the
    expert-parallel forward would have left it unused (at ep=2 it trained another model, silently: 2.077 against
    2.098 at step 4)."""

    def __init__(self, **kwargs) -> None:
        from tests.unit.test_expert_takeover import BiasedExperts

        super().__init__(**kwargs)
        for name, experts in list(self.named_modules()):
            if name.endswith("ffn.experts"):
                parent = self.get_submodule(name.rsplit(".", 1)[0])
                parent.experts = BiasedExperts(*experts.gate_up_proj.shape[:1], experts.gate_up_proj.shape[2], experts.down_proj.shape[2])


def test_experts_whose_forward_is_not_the_dispatchers_are_refused_before_any_step(tmp_path):
    strategy = HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2, start_method="forkserver")
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    seed_everything(7)
    module = BiasedExpertsModel(**MOE_MODEL)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.ffn\.experts \(BiasedExperts\) cannot run expert-parallel: .*\['gate_up_bias'\]"):
        trainer.fit(module, loader(8, PER_RANK_BATCH))
    assert trainer.global_step == 0
