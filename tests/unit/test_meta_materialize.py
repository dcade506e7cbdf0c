"""materialize() of a module tree holding a Hugging Face model built on the meta device: the model is initialised by
transformers' own initialisation (norms ones, rotary ``inv_freq`` computed, linear layers normal(0, 0.02)), the
modules around it by their ``reset_parameters()``; a module that neither initialises is still named in an error."""

import math

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from lightning_ciuic.huggingface import HuggingFaceCausalLM  # noqa: E402
from lightning_ciuic.parallel.fsdp import materialize  # noqa: E402

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=32)
STD = 0.02  # transformers' initializer_range default


def _meta(build):
    with torch.device("meta"):
        return build()


def _assert_initialised_like(module: nn.Module, reference: nn.Module) -> None:
    """Buffers (the rotary tables: non-persistent, no checkpoint restores them) equal a normal build's; parameters
    are drawn as transformers draws them, not left as memory's garbage."""
    buffers = dict(module.named_buffers())
    assert buffers.keys() == dict(reference.named_buffers()).keys() and buffers
    for name, buffer in reference.named_buffers():
        assert torch.equal(buffers[name], buffer), name
    for name, param in module.named_parameters():
        assert torch.isfinite(param).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        elif param.dim() == 2:  # embedding and linear weights: normal(0, 0.02)
            assert math.isclose(param.std().item(), STD, rel_tol=0.15), (name, param.std().item())


def test_a_meta_built_hugging_face_module_gets_transformers_initialisation():
    module = _meta(lambda: HuggingFaceCausalLM("llama", LLAMA))
    materialize(module, torch.device("cpu"))
    _assert_initialised_like(module, HuggingFaceCausalLM("llama", LLAMA))


def test_a_model_initialised_once_then_moved_to_meta_is_initialised_again():
    """transformers marks each module it initialised (``_is_hf_initialized``) and skips it next time: the marks
    outlive the values, which ``to_empty`` replaced."""
    module = HuggingFaceCausalLM("llama", LLAMA).to("meta")
    materialize(module, torch.device("cpu"))
    _assert_initialised_like(module, HuggingFaceCausalLM("llama", LLAMA))


class Wrapper(nn.Module):
    """A user's module around a Hugging Face model, with a layer of its own."""

    def __init__(self, extra: nn.Module) -> None:
        super().__init__()
        self.lm = HuggingFaceCausalLM("llama", LLAMA).model
        self.extra = extra


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_modules_around_the_hugging_face_model_are_reset_and_one_without_reset_parameters_is_named():
    module = _meta(lambda: Wrapper(nn.Linear(32, 2)))
    materialize(module, torch.device("cpu"))
    _assert_initialised_like(module.lm, HuggingFaceCausalLM("llama", LLAMA).model)
    bound = 1 / math.sqrt(32)  # nn.Linear.reset_parameters: uniform(-1/sqrt(in), 1/sqrt(in))
    assert all(param.abs().max() <= bound for param in module.extra.parameters())
    with pytest.raises(TypeError, match=r"Wrapper was built on the meta device, but \['NoReset'\] own parameters"):
        materialize(_meta(lambda: Wrapper(NoReset())), torch.device("cpu"))
