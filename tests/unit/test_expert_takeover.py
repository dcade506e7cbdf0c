"""Expert parallelism replaces a packed-experts module's forward only where that forward is known to compute what the
dispatcher computes (transformers' experts of that form, or a check of the module's own forward on a small input);
any other module with the same attribute names is refused before anything changes, naming it and the form that works.
On torch's fake process group (2 ranks in one process)."""

import copy
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from examples.deepseek import PackedExperts
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.parallel.experts import check_takeover, dispatched_output, shard_experts
from lightning_ciuic.parallel.experts import takeover

E, H, I = 4, 16, 8
FORM = r"Expert parallelism takes over packed SwiGLU experts: gate_up_proj \[E, 2I, H\] \(the I gate rows, then the I up rows\)"


class BiasedExperts(PackedExperts):
    """Packed experts with a bias on the gate/up projection, which the dispatcher's SwiGLU would leave unused."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int) -> None:
        super().__init__(n_experts, dim, inter_dim)
        self.gate_up_bias = nn.Parameter(torch.full((n_experts, 2 * inter_dim), 0.1))

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for index in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == index)
            gate, up = (F.linear(x[token], self.gate_up_proj[index]) + self.gate_up_bias[index]).chunk(2, dim=-1)
            expert = F.linear(self.act_fn(gate) * up, self.down_proj[index])
            out = out.index_add(0, token, expert * top_k_weights[token, slot, None])
        return out


class UpFirstExperts(PackedExperts):
    """Packed experts whose gate_up_proj holds the up rows first."""

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for index in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == index)
            up, gate = F.linear(x[token], self.gate_up_proj[index]).chunk(2, dim=-1)
            expert = F.linear(self.act_fn(gate) * up, self.down_proj[index])
            out = out.index_add(0, token, expert * top_k_weights[token, slot, None])
        return out


def _llama4_experts() -> nn.Module:
    """transformers' Llama-4 experts: transposed ``[E, H, 2I]`` / ``[E, I, H]``, forward(hidden) on sorted tokens."""
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    return Llama4TextExperts(Llama4TextConfig(num_local_experts=E, hidden_size=H, intermediate_size=I))


HF_EXPERTS = {
    "deepseek_v3": "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts",
    "mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralExperts",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts",
    "muse_spark": "transformers.models.muse_spark.modeling_muse_spark.MuseSparkExperts",
    "step3p7": "transformers.models.step3p7.modeling_step3p7.Step3p7Experts",
}
# what the last two read of their config (their model configs are composite)
HF_ODD_CONFIGS = {
    "muse_spark": dict(num_local_experts=E, moe_hidden_size=H, moe_intermediate_size=I, hidden_act="silu", post_norm_eps=1e-6),
    "step3p7": dict(num_local_experts=E, hidden_size=H, moe_intermediate_size=I, hidden_act="silu", swiglu_limits=[7.0], limit_after_act=False),
}


def _hugging_face_experts(model_type: str) -> nn.Module:
    import transformers

    path, name = HF_EXPERTS[model_type].rsplit(".", 1)
    cls = getattr(__import__(path, fromlist=[name]), name)
    if model_type in HF_ODD_CONFIGS:
        config = types.SimpleNamespace(**HF_ODD_CONFIGS[model_type])
        return cls(config, 0) if model_type == "step3p7" else cls(config)
    sizes = dict(hidden_size=H, moe_intermediate_size=I, intermediate_size=I, num_local_experts=E, n_routed_experts=E, num_experts=E)
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    config._experts_implementation = "eager"
    return cls(config)


class Holder(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts


@pytest.fixture
def ep2():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dims = ParallelDims.resolve(2, data_parallel_size=2, expert_parallel_size=2)
        yield lambda module: shard_experts(module, dims.build("cpu"))
    finally:
        dist.destroy_process_group()


def _refused(shard, experts: nn.Module, message: str) -> None:
    holder = Holder(experts)
    before = {n: p.detach().clone() for n, p in holder.named_parameters()}
    with pytest.raises(ValueError, match=message) as raised:
        shard(holder)
    assert "experts (" in str(raised.value) and "use expert_parallel_size=1" in str(raised.value)
    # nothing changed: the forward and the parameters are the module's own
    assert "forward" not in vars(experts) and not any(isinstance(p, DTensor) for p in holder.parameters())
    assert all(torch.allclose(before[n], p, rtol=0, atol=0, equal_nan=True) for n, p in holder.named_parameters())


def test_a_bias_the_dispatcher_would_leave_unused_is_refused(ep2):
    _refused(ep2, BiasedExperts(E, H, I), rf"experts \(BiasedExperts\) cannot run expert-parallel: on a check input .* differs .*\['gate_up_bias'\]\. {FORM}")


def test_up_rows_first_are_refused_naming_the_order(ep2):
    _refused(ep2, UpFirstExperts(E, H, I), r"experts \(UpFirstExperts\) cannot run expert-parallel: it computes act_fn\(up\) \* gate: its gate_up_proj holds the up rows first")


def test_llama4s_transposed_experts_are_refused_by_their_shapes(ep2):
    pytest.importorskip("transformers")
    _refused(ep2, _llama4_experts(), r"experts \(Llama4TextExperts\) cannot run expert-parallel: its gate_up_proj is \[4, 16, 16\] and its down_proj \[4, 8, 16\], not \[E, 2I, H\] and \[E, H, I\]")


def test_llama4s_experts_are_refused_on_the_meta_device_too(ep2):
    pytest.importorskip("transformers")
    with torch.device("meta"):
        experts = _llama4_experts()
    with pytest.raises(ValueError, match=r"Llama4TextExperts\) cannot run expert-parallel: its gate_up_proj is"):
        ep2(Holder(experts))


@pytest.mark.parametrize(
    "model_type, message",
    [("muse_spark", r"MuseSparkExperts\) cannot run expert-parallel: transformers marks its experts has_post_expert_norm=True"),
     ("step3p7", r"its class gates its experts its own way \(_apply_gate\)")],
)
def test_transformers_experts_of_another_form_are_refused_by_their_flags(ep2, model_type, message):
    pytest.importorskip("transformers")
    with torch.device("meta"):
        experts = _hugging_face_experts(model_type)
    with pytest.raises(ValueError, match=message):
        ep2(Holder(experts))


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("model_type", [None, "deepseek_v3", "mixtral", "qwen3_moe"])
def test_the_example_and_transformers_experts_are_taken_over(ep2, model_type, device):
    if model_type is not None:
        pytest.importorskip("transformers")
    with torch.device(device):
        experts = PackedExperts(E, H, I) if model_type is None else _hugging_face_experts(model_type)
    layout = ep2(Holder(experts))
    assert list(layout.modules) == ["experts"] and "forward" in vars(experts)
    assert isinstance(experts.gate_up_proj, DTensor) and experts.gate_up_proj.to_local().shape[0] == E // 2


@pytest.mark.parametrize("model_type", ["deepseek_v3", "mixtral", "qwen3_moe"])
def test_transformers_experts_compute_what_the_dispatcher_computes(model_type):
    """The registry's premise, checked: their own forward is the dispatcher's formula."""
    pytest.importorskip("transformers")
    experts = _hugging_face_experts(model_type).double()
    for param in experts.parameters():
        nn.init.normal_(param, std=0.3)
    assert takeover.probe(experts) is None


def test_the_check_does_not_touch_the_module_or_its_hooks():
    experts = PackedExperts(E, H, I).double()
    before = copy.deepcopy(experts.state_dict())
    calls = []
    experts.register_forward_pre_hook(lambda module, args: calls.append(args))
    check_takeover("experts", experts)
    assert calls == [] and all(torch.equal(before[k], v) for k, v in experts.state_dict().items())


def test_past_the_limit_the_modules_own_weights_are_checked_and_a_meta_one_is_refused():
    experts = PackedExperts(E, H, I).double()
    assert takeover.probe(experts, limit=0) is None
    assert "up rows first" in takeover.probe(UpFirstExperts(E, H, I).double(), limit=0)
    zero = PackedExperts(E, H, I)
    nn.init.zeros_(zero.gate_up_proj)
    assert "give no output to compare" in takeover.probe(zero, limit=0)
    with torch.device("meta"):
        meta = PackedExperts(E, H, I)
    assert "it is on the meta device, and checking its forward needs random weights" in takeover.probe(meta, limit=0)


def test_the_dispatchers_formula_is_the_example_experts_forward():
    torch.manual_seed(0)
    experts = PackedExperts(E, H, I).double()
    hidden = torch.randn(6, H, dtype=torch.float64)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(6, 2, dtype=torch.float64)
    torch.testing.assert_close(dispatched_output(experts, hidden, index, weights), experts(hidden, index, weights))


def test_a_models_layers_of_one_class_and_shape_are_checked_once(ep2, monkeypatch):
    checked = []
    probe = takeover.probe
    monkeypatch.setattr(takeover, "probe", lambda module, *a: checked.append(module) or probe(module, *a))
    model = nn.ModuleList([Holder(PackedExperts(E, H, I)), Holder(PackedExperts(E, H, I)), Holder(PackedExperts(E, 2 * H, I))])
    layout = ep2(model)
    assert len(layout.modules) == 3 and len(checked) == 2  # the third's shapes differ
