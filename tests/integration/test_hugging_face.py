"""Hugging Face causal LMs built from a config train with pp=2 x tp=2 from strategy arguments alone."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch import Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_ciuic import HybridParallelStrategy
from tests.helpers import LOGGED_LOSS_REL, PRECISION, assert_state_close, loader, reference_training, run_workers

pytest.importorskip("transformers")

from lightning_ciuic.huggingface import HuggingFaceCausalLM  # noqa: E402
from tests.integration.test_pipeline import _LossRecorder  # noqa: E402

STEPS, PER_RANK_BATCH = 20, 4
COMMON = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=32)
CONFIGS = {
    "llama": dict(COMMON, num_attention_heads=4, num_key_value_heads=2),
    "deepseek_v3": dict(
        COMMON, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, moe_intermediate_size=16, kv_lora_rank=8, q_lora_rank=None,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        experts_implementation="eager",  # torch's grouped_mm (the default) has no float64 kernel
    ),
    # fused qkv and gate_up projections: colwise_gather_output, then rowwise_split_input on a replicated input
    "phi3": dict(COMMON, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


def _factory(model_type: str):
    def build() -> HuggingFaceCausalLM:
        seed_everything(5)
        return HuggingFaceCausalLM(model_type, CONFIGS[model_type], lr=1e-2).double()

    return build


def _pp2_tp2(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    for model_type in ("llama", "deepseek_v3"):
        expected_losses: list[float] = []
        expected = reference_training(_factory(model_type), STEPS, PER_RANK_BATCH, losses=expected_losses)
        module, recorder = _factory(model_type)(), _LossRecorder()
        trainer = Trainer(
            strategy=HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2),
            accelerator="cpu", devices=world, max_steps=STEPS, logger=False, callbacks=[recorder],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, precision=PRECISION,
        )
        trainer.fit(module, loader(STEPS * PER_RANK_BATCH, PER_RANK_BATCH))
        if model_type == "deepseek_v3":
            # Hugging Face's DeepSeek-V3 routes in float32 by design (router and RMSNorm cast to float32), so a last-bit
            # difference of a tensor-parallel sum can flip a discrete expert choice, after which trajectories drift
            # apart slowly: equal while no choice flipped, close afterwards. Llama has no discrete step: compared fully.
            assert recorder.losses[:8] == pytest.approx(expected_losses[:8], rel=1e-4), model_type
            assert recorder.losses == pytest.approx(expected_losses, rel=1e-2), model_type
            continue
        assert recorder.losses == pytest.approx(expected_losses, rel=LOGGED_LOSS_REL), model_type
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        assert_state_close(state, {k: expected[k] for k in state}, STEPS)
    three_heads = HuggingFaceCausalLM("llama", dict(CONFIGS["llama"], hidden_size=48, num_attention_heads=3, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide num_attention_heads=3; .* among \[1, 3\]"):
        Trainer(
            strategy=HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2),
            accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        ).fit(three_heads, loader(8, PER_RANK_BATCH))


def test_llama_and_deepseek_v3_train_with_pp2_tp2():
    """20 steps with sequence and loss parallelism (the default: the stages hand each other half the sequence, decoder
    layers after the first count positions over the whole of it): Llama gives the losses and weights of single-process
    training of the same model; DeepSeek-V3 the same losses until routing choices differ, within 1% after."""
    run_workers(_pp2_tp2, 4)


def test_tensor_parallel_plan_translation():
    module = _factory("deepseek_v3")()
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    from lightning_ciuic.parallel.tensor import SharedRotaryKey, hugging_face_plan

    plan, skipped = hugging_face_plan(module.model, module.model._tp_plan, prefix="model.")
    assert "model.model.layers.0.mlp.gate_proj" in plan  # the dense first layer
    assert "model.model.layers.1.mlp.shared_experts.down_proj" in plan
    assert "model.model.embed_tokens" in plan and "model.lm_head" in plan
    # MLA's shared rotary key: replicated, its gradient summed over tp (transformers >= 5.25 shards DeepSeek's attention)
    if "layers.*.self_attn.kv_a_proj_with_mqa" in module.model._tp_plan:
        assert isinstance(plan["model.model.layers.0.self_attn.kv_a_proj_with_mqa"], SharedRotaryKey)
        assert plan["model.model.layers.0.self_attn.kv_a_proj_with_mqa"].rotary_dim == 4
    # packed 3-D experts (transformers < 5.25 lists them in the tp plan): replicated here, sharded by expert parallelism
    assert not any(".mlp.experts" in name for name in plan), plan
    phi3 = _factory("phi3")().model
    phi3_plan, phi3_skipped = hugging_face_plan(phi3, phi3._tp_plan)
    o_proj = phi3_plan["model.layers.0.self_attn.o_proj"]  # rowwise_split_input: a replicated input, split here
    assert isinstance(o_proj, RowwiseParallel) and o_proj.input_layouts == (Replicate(),) and not phi3_skipped
    # ``*`` is a layer index, a whole component: GPT-NeoX's dense_h_to_4h / dense_4h_to_h are sharded (they were kept
    # replicated, their digits read as an index)
    from lightning_ciuic.huggingface import HuggingFaceCausalLM

    neox = HuggingFaceCausalLM("gpt_neox", dict(COMMON, num_attention_heads=4)).model
    neox_plan, neox_skipped = hugging_face_plan(neox, neox._tp_plan)
    assert {"gpt_neox.layers.1.mlp.dense_h_to_4h", "gpt_neox.layers.1.mlp.dense_4h_to_h"} <= neox_plan.keys(), neox_skipped
    assert not neox_skipped
    with pytest.raises(ValueError, match=r"gives 'layers.\*.mlp.gate_proj' the style 'colwise_sharded_io'.*tensor_parallel_size=1"):
        hugging_face_plan(module.model.model, {"layers.*.mlp.gate_proj": "colwise_sharded_io"})
    assert module.pipeline_blocks() == [
        "model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1", "model.model.norm", "model.lm_head"
    ]


def test_bad_model_arguments():
    with pytest.raises(ValueError, match="model_type='gpt9' is not a transformers model type"):
        HuggingFaceCausalLM("gpt9", {})
    with pytest.raises(ValueError, match=r"^model_type='lamma' is not a transformers model type; the nearest causal-LM types: llama, "):
        HuggingFaceCausalLM("lamma", {})
    with pytest.raises(ValueError, match=r"model_type='t5' has no causal language model in transformers .* use a decoder-only model type \(llama"):
        HuggingFaceCausalLM("t5", {})
    with pytest.raises(ValueError, match="tie_word_embeddings=True shares the embedding with the LM head"):
        HuggingFaceCausalLM("llama", dict(CONFIGS["llama"], tie_word_embeddings=True))


TINY_ENCODER = dict(COMMON, num_attention_heads=2, tie_word_embeddings=False)


@pytest.mark.parametrize(
    "model_type, config, fix",
    [
        ("bert", {}, "is_decoder"), ("roberta", {}, "is_decoder"), ("bert-generation", {}, "is_decoder"),
        ("xlm", dict(emb_dim=32, n_layers=1, n_heads=2), "causal"),
    ],
)
def test_a_model_whose_attention_sees_the_tokens_it_predicts_is_refused(model_type, config, fix):
    """Before, ``model_type: bert`` trained BertLMHeadModel with every position seeing the tokens it predicts, exit 0."""
    with pytest.raises(ValueError, match=rf"model_type='{model_type}' builds \w+, which attends both ways .* or config=\{{'{fix}': True\}}"):
        HuggingFaceCausalLM(model_type, dict(TINY_ENCODER, **config))


@pytest.mark.parametrize(
    "model_type, config",
    [("bert", dict(is_decoder=True)), ("gpt_neox", {}), ("llama", dict(num_key_value_heads=2))],
)
def test_the_models_it_accepts_are_causal(model_type, config):
    """A later token changes no earlier position's logits (GPT-NeoX says is_decoder=False and is causal all the same)."""
    import torch

    module = HuggingFaceCausalLM(model_type, dict(TINY_ENCODER, **config)).eval()
    ids = torch.randint(3, 60, (1, 8), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 7) % 57 + 3
    with torch.no_grad():
        torch.testing.assert_close(module(changed)[0, :-1], module(ids)[0, :-1])


def test_a_model_transformers_gives_no_pipeline_plan_is_refused_pipelined_naming_what_works():
    module = HuggingFaceCausalLM("bert", dict(TINY_ENCODER, is_decoder=True))
    with pytest.raises(ValueError, match=r"model_type='bert' \(BertLMHeadModel\) has no pipeline plan in transformers .* use pipeline_parallel_size=1"):
        module.pipeline_blocks()


PP2_TP2 = dict(pipeline_parallel_size=2, tensor_parallel_size=2)
PP2_FSDP2 = dict(pipeline_parallel_size=2, data_parallel_size=2, data_parallel_shard_size=2)
DP2_TP2 = dict(data_parallel_size=2, tensor_parallel_size=2)  # replicated: a vocabulary-sharded embedding's gradient comes back replicated
HSDP_EP2 = dict(data_parallel_size=4, data_parallel_shard_size=2, expert_parallel_size=2)  # experts over 2 ranks


@pytest.mark.parametrize(
    "model_type, layout",
    [("llama", PP2_TP2), ("deepseek_v3", PP2_TP2), ("llama", PP2_FSDP2), ("deepseek_v3", HSDP_EP2), ("llama", DP2_TP2),
     ("phi3", PP2_TP2)],
    ids=["llama-pp2xtp2", "deepseek_v3-pp2xtp2", "llama-pp2xfsdp2", "deepseek_v3-hsdp2x2-ep2", "llama-dp2xtp2", "phi3-pp2xtp2"],
)
def test_pretrained_weights_train_in_parallel_and_export_back_to_hugging_face(tmp_path, model_type, layout, capsys):
    """Hugging Face weights -> 3 steps at pp=2 x tp=2 (or pp=2 x FSDP 2, or HSDP 2x2 with the experts sharded over 2:
    each rank reads only its experts from the files) -> ``checkpoint export --format hf`` ->
    transformers' ``from_pretrained``: the weights of one process training from the same files, and the trained
    model's logits."""
    import torch
    import transformers

    from lightning_ciuic import AsyncCheckpointer
    from lightning_ciuic.cli import main as cli_main

    source, url, out, steps = tmp_path / "hf", str(tmp_path / "checkpoints"), tmp_path / "exported", 3
    seed_everything(11)
    config = transformers.AutoConfig.for_model(model_type, **CONFIGS[model_type])
    transformers.AutoModelForCausalLM.from_config(config).double().save_pretrained(source)

    # config.json does not keep the kernel choice: float64 experts need the eager implementation (an override).
    overrides = {k: v for k, v in CONFIGS[model_type].items() if k == "experts_implementation"}
    module = HuggingFaceCausalLM.from_pretrained(str(source), lr=1e-2, config=overrides).double()
    trainer = Trainer(
        strategy=HybridParallelStrategy(**layout, num_microbatches=2, start_method="forkserver"),
        accelerator="cpu", devices=4, max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[AsyncCheckpointer(url, save_interval=None, every_n_train_steps=steps)], precision=PRECISION,
    )
    dp = layout.get("data_parallel_size", 1)
    trainer.fit(module, loader(steps * PER_RANK_BATCH * dp, PER_RANK_BATCH))

    def from_files() -> HuggingFaceCausalLM:
        reference = HuggingFaceCausalLM.from_pretrained(str(source), lr=1e-2, config=overrides).double()
        reference.load_pretrained()  # one process: reads every tensor whole
        return reference

    trained = {k: v.detach() for k, v in module.state_dict().items()}
    assert_state_close(trained, reference_training(from_files, steps, PER_RANK_BATCH * dp), steps)

    with pytest.raises(SystemExit) as done:
        cli_main(["checkpoint", "export", url, "last", str(out), "--format", "hf"])
    assert done.value.code == 0, capsys.readouterr()
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64, **overrides)
    ids = torch.randint(0, CONFIGS[model_type]["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, module(ids), rtol=0, atol=1e-12)


def test_pretrained_directory_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json: give a directory in Hugging Face layout"):
        HuggingFaceCausalLM.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="needs a model_type"):
        HuggingFaceCausalLM()
