"""Activation recomputation modes (parallel/recompute.py): parsed and refused, and each one's gradients equal to
keeping every activation (float64, one process), with the recomputation it promises happening in backward."""

import contextlib
import copy
from collections import Counter

import pytest
import torch
from torch import nn

from examples.deepseek import DeepSeekConfig, DeepSeekTransformer, MultiHeadLatentAttention
from lightning_ciuic import compat
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.recompute import Recompute, checkpoint_activations, recompute_blocks

RECIPE = {"recompute": ["norm", "mla_up"]}  # DeepSeek-V3's


@pytest.mark.parametrize(
    "given, expected",
    [
        (False, Recompute("none")), ("none", Recompute("none")), (True, Recompute("full")), ("full", Recompute("full")),
        ("full:3", Recompute("full", every=3)), ("selective", Recompute("selective")),
        (RECIPE, Recompute("modules", modules=("norm", "mla_up"))), ({"recompute": "attn.*"}, Recompute("modules", modules=("attn.*",))),
    ],
)
def test_each_spelling_is_one_mode_kept_parsed_by_the_config(given, expected):
    config = ParallelismConfig(gradient_checkpointing=given)
    assert config.gradient_checkpointing == expected and bool(expected) == (expected.mode != "none")
    assert ParallelismConfig(gradient_checkpointing=config.gradient_checkpointing) == config  # parsed once, as it is
    hash(config)


@pytest.mark.parametrize("given", ["partial", "full:0", "full:x", "selective:2", 2, {"keep": ["norm"]}, {"recompute": []}, {"recompute": [3]}])
def test_anything_else_is_refused_naming_it_and_every_spelling(given):
    with pytest.raises(ValueError, match=r"gradient_checkpointing=.* is not a recomputation mode: use False or 'none'.*"
                                         r"'full:<k>'.*'selective'.*\['mla_up', 'norm'\].*\{'recompute': \['norm', 'mla_up'\]\}"):
        ParallelismConfig(gradient_checkpointing=given)


def _model() -> DeepSeekTransformer:
    torch.manual_seed(0)
    return DeepSeekTransformer(DeepSeekConfig(n_layers=3, n_dense_layers=1)).double()


class _Ops(compat.TorchDispatchMode):
    """The ops run in backward (a recomputed forward's among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if compat.in_backward():
            self.ran.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _step(model: nn.Module, mode) -> tuple[dict, list]:
    names = model.block_names()
    if mode is not None:
        recompute_blocks([model.get_submodule(n) for n in names], Recompute.parse(mode), names)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with _Ops() as ops:
        for _ in range(2):  # twice: a second step after the first recomputed as the first did
            model(tokens).logsumexp(-1).mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}, ops.ran


@pytest.mark.parametrize("mode", [True, "full:2", "selective", RECIPE, {"recompute": ["ffn", "attn.w*"]}])
def test_each_mode_recomputes_in_backward_and_its_gradients_equal_keeping_everything(mode):
    model = _model()
    expected, kept = _step(copy.deepcopy(model), None)
    grads, ran = _step(model, mode)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-13, msg=lambda m: f"{name}: {m}")
    recomputed = Counter(ran) - Counter(kept)  # what ran in backward beyond backward itself: forwards again
    norms = mode != {"recompute": ["ffn", "attn.w*"]}  # every other mode recomputes RMSNorm (its rsqrt)
    assert ("aten.rsqrt" in recomputed) == norms, (mode, recomputed)
    # The recipe runs its up-projections again (q, k and v are not kept), and no other product: two steps of one per
    # MLA layer (the example's query has no latent); every other mode recomputes some (selective: every other one).
    assert "aten.mm" in recomputed, (mode, recomputed)
    if mode == RECIPE:
        assert recomputed["aten.mm"] == 2 * sum(isinstance(m, MultiHeadLatentAttention) for m in model.modules()), recomputed


def test_a_recomputed_modules_output_is_not_kept_by_its_consumers():
    """DeepSeek-V3's recipe keeps fewer bytes from the forward than keeping everything (the norms' and up-projections'
    outputs too, which their consumers would keep), and more than recomputing each block whole."""
    def held_after_forward(mode) -> int:
        model = _model()
        names = model.block_names()
        if mode is not None:
            recompute_blocks([model.get_submodule(n) for n in names], Recompute.parse(mode), names)
        tracker = compat.memory_tracker(per_module=False)
        with tracker:
            loss = model(torch.randint(0, 256, (2, 16))).sum()
            held = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
            loss.backward()
        return held

    none, recipe, full = (held_after_forward(mode) for mode in (None, RECIPE, True))
    assert full < recipe < none, (full, recipe, none)
    # The up-projection named alone keeps what attention makes of its output (k, v); the preset keeps neither.
    up_alone = held_after_forward({"recompute": ["norm", "attn.wkv_b"]})
    config = DeepSeekConfig()
    k_and_v = 2 * 16 * config.n_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) * 8
    assert recipe <= up_alone - 2 * k_and_v, (recipe, up_alone, k_and_v)  # 2 MLA layers


def test_a_name_that_matches_nothing_is_refused_with_the_names_there_are():
    model = _model()
    names = model.block_names()
    with pytest.raises(ValueError, match=r"\['ffn_up'\] name no sub-module of any block of \['embed', 'layers.0'.*"
                                         r"look like \['attn_norm', 'attn', 'attn.wq'"):
        recompute_blocks([model.get_submodule(n) for n in names], Recompute.parse({"recompute": ["norm", "ffn_up"]}), names)


def test_the_presets_name_transformers_deepseek_v3s_norms_and_up_projections():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from lightning_ciuic.parallel.recompute import module_matches

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
    )
    layer = DeepseekV3ForCausalLM(config).model.layers[0]
    named = {e: sorted(n for n, m in layer.named_modules() if n and module_matches(n, m, e)) for e in ("norm", "mla_up")}
    assert named == {
        "norm": ["input_layernorm", "post_attention_layernorm", "self_attn.kv_a_layernorm", "self_attn.q_a_layernorm"],
        "mla_up": ["self_attn.kv_b_proj", "self_attn.q_b_proj"],
    }


def test_activation_checkpointing_recomputes_in_backward_with_equal_gradients():
    torch.manual_seed(0)
    plain, recomputed = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    recomputed.load_state_dict(plain.state_dict())
    calls = []
    recomputed[0].register_forward_hook(lambda *_: calls.append(1))
    checkpoint_activations([recomputed])
    checkpoint_activations([recomputed])  # twice: still one level
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    recomputed(x).sum().backward()
    assert len(calls) == 2, "forward once, then once more in backward"
    torch.testing.assert_close(recomputed[0].weight.grad, plain[0].weight.grad)
    assert set(recomputed.state_dict()) == set(plain.state_dict())


def _split_backward(model: DeepSeekTransformer, mode, shared: bool) -> tuple[dict, Counter, Counter]:
    """A zero-bubble schedule's backward of the example's layers, norm and head (a pipeline stage after the embedding:
    its input needs a gradient), torch's input pass then its weight pass, each in a
    :class:`~lightning_ciuic.parallel.split_backward.BackwardPasses` pass (``shared``) or bare: the stage's input and
    weight gradients, and the ops each pass ran."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from lightning_ciuic.parallel.split_backward import BackwardPasses

    names = model.block_names()
    recompute_blocks([model.get_submodule(n) for n in names], Recompute.parse(mode), names)
    split = BackwardPasses()  # before the forward, as a pipeline stage is built before it runs
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    x = model.embed(tokens).detach().requires_grad_()
    stage = nn.Sequential(*model.layers, model.norm, model.head)
    loss = stage(x).logsumexp(-1).mean()
    with _Ops() as input_ops, split.backward(0, full=False) if shared else contextlib.nullcontext():
        _, groups = stage_backward_input([loss], None, [x], stage.parameters())
    with _Ops() as weight_ops, split.weight(0) if shared else contextlib.nullcontext():
        stage_backward_weight(stage.parameters(), groups)
    grads = {n: p.grad for n, p in stage.named_parameters()} | {"input": x.grad}
    return grads, Counter(input_ops.ran), Counter(weight_ops.ran)


@pytest.mark.parametrize("mode", [True, "full:2", "selective", RECIPE])
def test_a_split_backwards_weight_pass_recomputes_nothing_and_computes_the_same_gradients(mode):
    """The weight pass takes what the input pass recomputed (the inputs of the nodes it runs again) instead of running
    the recomputed forwards once more, as torch's passes did (once per weight group they touch); the input pass
    recomputes what it did, and the gradients are the same to the bit."""
    model = _model()
    whole = copy.deepcopy(model)
    names = whole.block_names()
    recompute_blocks([whole.get_submodule(n) for n in names], Recompute.parse(mode), names)
    bare, bare_input, bare_weight = _split_backward(copy.deepcopy(model), mode, shared=False)
    grads, input_ops, weight_ops = _split_backward(model, mode, shared=True)
    assert bare_weight["aten.rsqrt"] > 0, bare_weight  # torch's weight pass runs the norms' forwards again
    assert weight_ops["aten.rsqrt"] == 0 and weight_ops.total() < bare_weight.total(), (weight_ops, bare_weight)
    assert input_ops == bare_input
    for name, grad in bare.items():
        assert torch.equal(grads[name], grad), name
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    x = whole.embed(tokens).detach().requires_grad_()
    stage = nn.Sequential(*whole.layers, whole.norm, whole.head)
    stage(x).logsumexp(-1).mean().backward()  # one backward, whole
    expected = {n: p.grad for n, p in stage.named_parameters()} | {"input": x.grad}
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-13, msg=lambda m: f"{name}: {m}")


def test_a_stages_backward_passes_run_on_the_calling_thread():
    """Whole, input and weight passes turn autograd's device worker threads off (an accelerator's backward runs on
    the caller's thread, where the pass's thread-local state is set), and back on after."""
    from lightning_ciuic.parallel.split_backward import BackwardPasses

    passes = BackwardPasses()
    for context in (passes.backward(0, full=True), passes.backward(1, full=False), passes.weight(1)):
        with context:
            assert not torch._C._is_multithreading_enabled()
        assert torch._C._is_multithreading_enabled()
