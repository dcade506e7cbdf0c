"""One check per private part of Lightning and torch the pack touches (lightning_ciuic/compat/): an upgrade
that moves one fails here, by name, rather than in a training run."""

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import Strategy
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.pipelining import PipelineStage

from lightning_ciuic import compat


def test_versions_outside_the_tested_range_are_named():
    assert compat.check_versions({"torch": "2.13.0+cpu", "lightning": "2.6.6"}) == []
    (message,) = compat.check_versions({"torch": "2.13.0", "lightning": "2.9.0"})
    assert "tested with lightning 2.6 up to before 2.7, found 2.9.0" in message


def test_lightning_launchers_and_the_methods_ours_overrides():
    script, multiprocessing, worker_output = compat.launchers()
    assert inspect.isclass(script) and inspect.isclass(multiprocessing)
    for method in ("_wrapping_function", "_collect_rank_zero_results", "get_extra_results"):
        assert callable(getattr(multiprocessing, method)), method
    assert worker_output._fields == ("best_model_path", "weights_path", "trainer_state", "trainer_results", "extra")
    snapshot, unshare = compat.spawn_handoff()
    assert callable(snapshot.capture) and callable(snapshot.restore) and callable(unshare)


def test_optimizer_unwrapping_and_the_strategy_reset():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert compat.unwrap_optimizer(LightningOptimizer(optimizer)) is optimizer
    assert compat.unwrap_optimizer(optimizer) is optimizer
    assert callable(Strategy._reset_optimizers_and_schedulers)


def test_fit_loop_counters_are_where_snapshots_look():
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert compat.batch_index(trainer) == -1 and compat.epoch_position(trainer) == (0, 0)  # before the first batch
    assert not compat.set_batches_processed(trainer, 3)  # no epoch running: nothing moves
    epochs = trainer.fit_loop.epoch_progress
    epochs.increment_ready(), epochs.increment_started()
    assert compat.set_batches_processed(trainer, 3) and compat.epoch_position(trainer) == (0, 3)
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    current.completed = 2  # saved in on_train_batch_end: the 3rd batch not completed yet
    assert compat.set_batches_processed(trainer, 5)
    assert (current.ready, current.started, current.processed, current.completed) == (5, 5, 5, 4)
    assert compat.set_batches_processed(trainer, 3) and current.completed == 2
    epochs.increment_processed()  # counted processed (its end, or max_steps mid-epoch): the next starts at batch 0
    assert compat.epoch_position(trainer) == (1, 0)
    loops = trainer.fit_loop.state_dict()
    loops["epoch_loop.state_dict"]["_batches_that_stepped"] = 7
    compat.rewind_step_counters(trainer, loops)
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 7


def test_overridden_private_hooks_still_exist():
    assert "trainer" in inspect.signature(ModelCheckpoint._find_last_checkpoints).parameters  # AsyncCheckpointer
    assert callable(PipelineStage._to_tensor)  # parallel/pipeline.py: shape inference on zeros
    # The planner's pipeline steps: a schedule's warm-up replaced, MemTracker's module hooks silenced.
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    assert list(inspect.signature(_PipelineSchedule._warmup_p2p).parameters) == ["self", "stages", "has_backward", "p2p_done"]
    assert InferenceMode.STATIC
    from torch.distributed.pipelining import schedules

    assert list(inspect.signature(schedules._batch_p2p).parameters) == ["p2p_ops", "desc"]
    with compat.pipeline_sends_held():
        assert schedules._batch_p2p([]) == []
    from torch.distributed._tools.mod_tracker import ModTracker

    assert isinstance(MemTracker()._mod_tracker, ModTracker)
    assert all(callable(getattr(ModTracker, name)) for name in ("register_user_hooks", "clear_user_hooks", "__enter__"))
    assert ModTracker().parents == {"Global"} and ModTracker().is_bw is False
    tracker = compat.memory_tracker(per_module=False)
    with tracker:
        kept = torch.ones(256)
    assert tracker.get_tracker_snapshot("peak")[kept.device]["Total"] >= kept.numel() * 4


def test_torch_private_helpers():
    assert issubclass(compat.EmptyStateDictLoadPlanner, LoadPlanner)
    assert "no_dist" in inspect.signature(compat.load_state_dict_into).parameters
    assert inspect.isclass(compat.TorchDispatchMode)


def test_the_attention_kernels_ops_are_the_ones_sdpa_runs():
    names = {op.name() for op in compat.ATTENTION_OPS}
    assert {"aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"} <= names
    seen = []

    class Ops(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 4, 8)
    with Ops():
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert set(seen) & set(compat.ATTENTION_OPS), f"CPU attention ran {seen}, none of {compat.ATTENTION_OPS}"


def test_backward_is_told_from_forward():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(compat.in_backward())
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(compat.in_backward())
            return grad

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False, True]


def test_mesh_axes_flatten_into_one_named_axis():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c"))
        flat = compat.flatten_mesh(mesh, ("a", "b"), "ab")
        assert flat.mesh_dim_names == ("ab",) and mesh["ab"].size() == 1
        split = compat.unflatten_mesh(mesh, "c", (1, 1), ("c1", "c2"))
        assert split.mesh_dim_names == ("a", "b", "c1", "c2") and split["c2"].size() == 1
    finally:
        dist.destroy_process_group()


def test_a_modules_forward_hooks_can_be_suspended_and_come_back():
    calls = []
    module = torch.nn.Linear(2, 2)
    module.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    module.register_forward_hook(lambda m, args, out: calls.append("post"))
    with compat.forward_hooks_suspended(module):
        module(torch.zeros(1, 2))
    assert calls == []
    module(torch.zeros(1, 2))
    assert calls == ["pre", "post"]


def test_an_fsdp2_units_mesh_is_read_from_its_state():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        unit = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
        assert compat.fsdp_mesh(unit) is mesh
        assert compat.fsdp_mesh(fully_shard(torch.nn.Sequential(unit), mesh=mesh)) is None  # owns no parameters
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("per_module", [True, False])
def test_the_memory_tracker_on_fake_tensors_does_not_count_dtensors_sharding_propagation(per_module):
    """DTensor learns an op's output shape by running it on fake tensors of the global shapes, once per op signature:
    a step's first forward must peak as its second does (torch's MemTracker, entered inside the fake mode, counted them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_ciuic.planner.layout import fake_world

    with fake_world(0, 4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
            model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
            peaks = []
            for _ in range(2):
                tracker = compat.memory_tracker(per_module=per_module)
                with tracker:
                    model(torch.randn(32, 64)).sum().backward()
                peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
                model.zero_grad(set_to_none=True)
    assert peaks[0] == peaks[1]


def test_litdata_distributed_environment_is_where_the_data_world_sets_it():
    pytest.importorskip("litdata", reason="litdata (test extra) is not installed")
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.utilities.env import _DistributedEnv

    env = compat.litdata_distributed_env(world_size=2, global_rank=1, num_nodes=1)
    assert (env.world_size, env.global_rank, env.num_nodes) == (2, 1, 1)
    with compat.litdata_detects(env):
        assert _DistributedEnv.detect() is env
    assert _DistributedEnv.detect() is not env
    # StreamingDataset keeps its world as ``distributed_env``; the loader's load_state_dict detects it again
    assert "self.distributed_env = _DistributedEnv.detect()" in inspect.getsource(StreamingDataset.__init__)
    assert "_DistributedEnv.detect()" in inspect.getsource(StreamingDataLoader.load_state_dict)


def test_transformers_experts_are_told_by_their_decorators_forward_and_gating():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    with torch.device("meta"):
        experts = DeepseekV3Experts(DeepseekV3Config(n_routed_experts=4, hidden_size=16, moe_intermediate_size=8))
    assert compat.hugging_face_experts_layout(experts) == {
        "is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
        "has_post_expert_norm": False, "default_gate": True,
    }

    class OwnGate(DeepseekV3Experts):
        def _apply_gate(self, gate_up):
            return gate_up

    class OwnForward(DeepseekV3Experts):
        def forward(self, hidden, top_k_index, top_k_weights):
            return hidden

    with torch.device("meta"):
        config = DeepseekV3Config(n_routed_experts=4, hidden_size=16, moe_intermediate_size=8)
        assert compat.hugging_face_experts_layout(OwnGate(config))["default_gate"] is False
        assert compat.hugging_face_experts_layout(OwnForward(config)) is None
    assert compat.hugging_face_experts_layout(torch.nn.Linear(2, 2)) is None


def test_grouped_mm_multiplies_each_row_group_by_its_own_weights():
    assert compat.has_grouped_mm()
    rows, weights = torch.randn(5, 16), torch.randn(2, 16, 8)
    out = compat.grouped_mm(rows, weights, torch.tensor([2, 5], dtype=torch.int32))
    torch.testing.assert_close(out, torch.cat([rows[:2] @ weights[0], rows[2:] @ weights[1]]))


@pytest.mark.parametrize("contexts", ["torch", "kept"])
def test_selective_checkpointing_keeps_its_outputs_for_a_second_backward(contexts):
    """The zero-bubble schedules' split backward: the inputs' gradient (graph retained), then the weights'. torch's
    contexts refuse the second pass; the kept storage gives the gradients of one plain backward, bit for bit."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    torch.manual_seed(0)
    weight, x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True), torch.randn(4, 8, dtype=torch.float64, requires_grad=True)

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def block(inputs):
        return torch.tanh(inputs @ weight).sin() @ weight

    make = create_selective_checkpoint_contexts if contexts == "torch" else compat.selective_checkpoint_contexts
    out = checkpoint(block, x, use_reentrant=False, context_fn=lambda: make(policy)).square().sum()
    (grad_x,) = torch.autograd.grad(out, x, retain_graph=True)
    if contexts == "torch":
        with pytest.raises(RuntimeError, match="backward an extra time"):
            torch.autograd.grad(out, weight)
        return
    (grad_w,) = torch.autograd.grad(out, weight)
    expected_x, expected_w = torch.autograd.grad(block(x).square().sum(), (x, weight))
    assert torch.equal(grad_x, expected_x) and torch.equal(grad_w, expected_w)


def test_the_touch_points_issue_46_moved_here_still_answer():
    from lightning.pytorch import LightningModule
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        shard = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
        assert compat.local_shape_and_offset(shard) == ((4, 3), (0, 0))
        assert compat.resolve_process_group(mesh.get_group().group_name) is mesh.get_group()
        module = LightningModule()
        compat.set_module_device_mesh(module, mesh)
        assert module.device_mesh is mesh
    finally:
        dist.destroy_process_group()
    assert compat.overload_packet(torch.ops.aten.mm.default) is torch.ops.aten.mm
    formulas = compat.private_op_flop_formulas(len)
    assert formulas[torch.ops.aten._grouped_mm] is len and len(formulas) == 3
    with compat.fake_tensor_mode():
        assert type(torch.empty(2)).__name__ == "FakeTensor"
    assert type(compat.fake_store()).__name__ == "FakeStore"

    class Schedule:
        pass

    schedule = Schedule()
    compat.use_static_pipeline_warmup(schedule)
    assert schedule._warmup_p2p is compat.static_pipeline_warmup


def test_transformers_models_give_their_parallel_plans():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2))
    assert "model.layers.*.self_attn.q_proj" in compat.hugging_face_tp_plan(model)
    assert list(compat.hugging_face_pp_plan(model.model))[0] == "embed_tokens"
    assert compat.hugging_face_tp_plan(torch.nn.Linear(2, 2)) is None


def test_a_litdata_combined_dataset_holds_its_children():
    pytest.importorskip("litdata", reason="litdata (test extra) is not installed")
    from litdata import CombinedStreamingDataset

    assert "self._datasets = datasets" in inspect.getsource(CombinedStreamingDataset.__init__)  # where it keeps them
    children = [object.__new__(CombinedStreamingDataset)]
    combined = object.__new__(CombinedStreamingDataset)
    combined._datasets = children
    assert compat.litdata_children(combined) == children and compat.litdata_children(object()) == []


def test_every_overridden_private_hook_still_exists():
    import importlib

    for path in compat.OVERRIDDEN_PRIVATE_HOOKS:
        module, cls, hook = path.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(module), cls), hook)), path


def test_a_strategys_precision_plugin_is_kept_where_lightning_keeps_it():
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(device="cpu")
    assert compat.precision_plugin_given(strategy) is None
    assert strategy.precision_plugin is not strategy.precision_plugin  # Lightning's property: a new default per read
    plugin = Precision()
    compat.set_precision_plugin(strategy, plugin)
    assert strategy.precision_plugin is plugin and compat.precision_plugin_given(strategy) is plugin


@pytest.mark.parametrize("weighted", [False, True])
def test_loss_parallels_backward_in_place_gives_torchs_gradient_bit_for_bit(weighted):
    """The cross-entropy of vocabulary-sharded logits (torch's loss_parallel, on a one-rank mesh of the fake process
    group, where each collective returns its input: the values are exact) has the same gradient with the in-place
    backward as with torch's, with ignored targets and with class weights."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        logits = torch.randn(12, 10, dtype=torch.float64)
        targets = torch.randint(0, 10, (12,))
        if not weighted:  # torch's own loss_parallel backward indexes the class weights by an ignored target: refused
            targets[3] = -100
        weight = torch.rand(10, dtype=torch.float64) if weighted else None
        grads = []
        for in_place in (False, True):
            sharded = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
            with loss_parallel(), compat.loss_parallel_backward_in_place() if in_place else contextlib.nullcontext():
                F.cross_entropy(sharded, targets, weight=weight).backward()
            grads.append(sharded.grad.full_tensor())
        assert torch.equal(grads[0], grads[1])
        reference = logits.clone().requires_grad_()
        F.cross_entropy(reference, targets, weight=weight).backward()
        torch.testing.assert_close(grads[1], reference.grad)
    finally:
        dist.destroy_process_group()


def test_dualpipevs_pairs_and_a_threads_dispatch_modes_are_where_the_pack_reads_them():
    """run_pairs_with reads torch 2.13's runtime as its ``_step_microbatches`` keeps it; a schedule without
    forward-backward pairs is left as it is. A helper thread handed this thread's dispatch modes dispatches to them."""
    import threading

    from torch.distributed.pipelining import schedules

    runtime = schedules._PipelineScheduleRuntime
    for name in ("register_custom_function", "_assert_unsharded", "_maybe_compute_loss", "_maybe_get_loss"):
        assert callable(getattr(runtime, name)), name
    assert callable(schedules._wait_batch_p2p) and schedules.OVERLAP_F_B.value == "OVERLAP_F_B"
    assert {"fwd_recv_ops", "bwd_recv_ops", "backward_counter"} <= set(runtime.__init__.__code__.co_names)

    class NoPairs:
        pass

    schedule = NoPairs()
    compat.run_pairs_with(schedule, lambda forward, backward: None)
    assert vars(schedule) == {}

    seen = []

    class Seen(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(threading.current_thread().name)
            return func(*args, **(kwargs or {}))

    with Seen():
        modes = compat.dispatch_modes()

        def helper():
            compat.push_dispatch_modes(modes)
            torch.ones(2) + 1

        thread = threading.Thread(target=helper, name="helper")
        thread.start()
        thread.join()
    assert "helper" in seen


def test_a_schedules_order_with_its_communication_and_its_send_batches_are_where_the_pack_reads_them():
    """pipeline_order_with_comms reads a runtime schedule's ``pipeline_order_with_comms`` (an ``OVERLAP_F_B`` as its
    parts, actions of no micro-batch left out) and ``stage_index_to_group_rank``; a schedule without them gives
    ``None``. pipeline_send_works hands ``_batch_p2p``'s works to the wrapper, told whether the batch only sends, and
    puts torch's back on leaving."""
    from torch.distributed.pipelining import schedules

    class Runtime:
        stage_index_to_group_rank = {0: 0, 1: 1}
        pipeline_order_with_comms = {
            0: [schedules._Action(0, schedules.UNSHARD), schedules._Action(0, schedules.FORWARD, 0),
                schedules._Action(0, schedules.SEND_F, 0), None],
            1: [schedules._Action(1, schedules.RECV_F, 0),
                schedules._Action(-1, schedules.OVERLAP_F_B, None, (schedules._Action(1, schedules.FORWARD, 1),
                                                                     schedules._Action(1, schedules.FULL_BACKWARD, 0)))],
        }

    order, stage_rank = compat.pipeline_order_with_comms(Runtime())
    assert order == {0: [("F", 0, 0), ("SEND_F", 0, 0)], 1: [("RECV_F", 1, 0), ("F", 1, 1), ("B", 1, 0)]}
    assert stage_rank == {0: 0, 1: 1} and compat.pipeline_order_with_comms(object()) is None

    torchs, seen = schedules._batch_p2p, []
    with compat.pipeline_send_works(lambda sends_only, works: seen.append(sends_only) or ["wrapped", *works]):
        assert schedules._batch_p2p([]) == ["wrapped"]
    assert schedules._batch_p2p is torchs and seen == [True]


def test_a_schedules_order_is_reordered_and_lowered_again_where_the_pack_limits_its_weight_backwards():
    """reorder_pipeline replaces a runtime schedule's compute order on every rank and lowers its communication again
    (``_prepare_schedule_with_comms``); full_backward_of makes an input backward the full one of its stage and
    micro-batch; pipeline_schedule_order reorders each rank's order the same way."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage, schedules

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 1, 2, None, 4
    schedule = schedules.ScheduleDualPipeV([stage, stage], 4)
    assert compat.full_backward_of(schedules._Action(2, schedules.BACKWARD_INPUT, 3)) == schedules._Action(2, schedules.FULL_BACKWARD, 3)

    def whole_backwards(actions):
        return [compat.full_backward_of(a) if a is not None and a.computation_type == schedules.BACKWARD_INPUT else a
                for a in actions if a is None or a.computation_type != schedules.BACKWARD_WEIGHT]

    expected = whole_backwards(schedule.pipeline_order[1])
    compat.reorder_pipeline(schedule, whole_backwards)
    assert schedule.pipeline_order[1] == expected
    lowered = [str(a) for a in schedule.pipeline_order_with_comms[1]]
    assert "2B3" in lowered and "2I3" not in lowered and not any(a.endswith("W3") for a in lowered)
    order = compat.pipeline_schedule_order("ScheduleDualPipeV", 2, 4, 2, whole_backwards)
    assert not any(kind in ("I", "W") for actions in order for parts in actions for kind, _, _ in parts)


def test_a_checkpointed_region_is_recomputed_once_for_a_split_backwards_two_passes():
    """share_recomputations wraps torch's non-reentrant checkpoint's unpack (``_checkpoint_hook``, its frames'
    ``recomputed`` tables and holders' ``handles``); param_group_nodes_observed sees stage_backward_input's weight
    groups (``get_param_groups``). In a RecomputationShared's first call, what the observed nodes unpack stays; its
    second call takes it: the region's forward runs twice (forward, input pass), not four times, and the gradients are
    torch's to the bit. Outside, torch's behaviour (the second call recomputes, once per weight group)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils.checkpoint import checkpoint

    compat.share_recomputations()
    torch.manual_seed(0)
    weights = [torch.randn(8, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    weights.append(torch.randn(8, dtype=torch.float64, requires_grad=True))  # a bias
    runs = []

    def block(inputs):
        runs.append(1)
        return torch.tanh(inputs @ weights[0] + weights[2]) @ weights[1]

    def passes(share):
        runs.clear()
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = checkpoint(block, x, use_reentrant=False).square().sum()
        observed = compat.param_group_nodes_observed(share.again.update) if share else contextlib.nullcontext()
        with observed, share.first_call() if share else contextlib.nullcontext():
            _, groups = stage_backward_input([out], None, [x], iter(weights))
        with share.second_call() if share else contextlib.nullcontext():
            stage_backward_weight(iter(weights), groups)
        grads = [x.grad] + [w.grad for w in weights]
        for w in weights:
            w.grad = None
        return len(runs), grads

    torch_runs, expected = passes(None)
    runs_shared, grads = passes(compat.RecomputationShared())
    assert (torch_runs, runs_shared) == (4, 2)  # torch's weight pass: once per weight group (two: w1 and bias, w2)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
