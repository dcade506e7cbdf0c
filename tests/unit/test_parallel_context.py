"""ParallelContext (strategies/context.py) is what callbacks read instead of the strategy's attributes: under
HybridParallelStrategy it carries the experts' layout (the expert-parallel modules, the meshes their tokens and
gradients cross) and the replica's batch check; under any other strategy neither. Torch's fake process group, one
process."""

from types import SimpleNamespace

import torch
from lightning.pytorch import Trainer

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy, parallel_context
from lightning_ciuic.parallel.parallelize import parallelize
from lightning_ciuic.planner.layout import fake_world
from tests.helpers import TINY_MODEL


def _context(world: int, **layout):
    """A set-up strategy's context (its meshes built, the model parallelized), without processes or a Trainer."""
    strategy = HybridParallelStrategy(**layout, parallel_devices=[torch.device("cpu")])
    dims = strategy.parallelism.resolve(world)
    strategy.parallel_dims, strategy.meshes = dims, dims.build("cpu")
    torch.manual_seed(0)
    module = DeepSeekMini(**{**TINY_MODEL, "n_routed_experts": 4})
    strategy.parallelized = parallelize(module, strategy.meshes, strategy.parallelism)
    return strategy, module, parallel_context(SimpleNamespace(strategy=strategy, world_size=world))


def test_an_expert_parallel_strategys_context_holds_its_experts_layout():
    with fake_world(0, 4):
        strategy, module, context = _context(4, data_parallel_size=4, expert_parallel_size=2)
        experts = context.experts
        assert experts is strategy.parallelized.experts
        moe_layers = [name for name, m in module.named_modules() if name.endswith("ffn.experts")]
        assert moe_layers and sorted(experts.modules) == moe_layers
        assert experts.ep_mesh.size() == 2 and experts.data_mesh.size() == 2  # ep=2 over dp=4: each expert on 2 ranks
        assert experts.stats.dispatch_bytes == 0  # the counters the monitor reads, before any step
        assert context.batch_check is strategy.batch_check and context.dims.ep == 2


def test_a_dense_layouts_context_and_another_strategys_have_no_experts():
    with fake_world(0, 2):
        _, _, context = _context(2, data_parallel_size=2)
        assert context.experts is None and context.batch_check is not None
    single = parallel_context(Trainer(accelerator="cpu", devices=1, logger=False))
    assert single.experts is None and single.batch_check is None and single.data_parallel is None
