"""What the console script says about a bad ``communication_compression``: what was given and the choices, not
jsonargparse's error for each member of ``Union[CompressionMode, GradientQuantizer]``; the good forms still parse."""

from pathlib import Path

import pytest
from lightning.pytorch import LightningDataModule, LightningModule

from lightning_ciuic.cli import PackCLI, main

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "examples/configs/demo.yaml")
CHOICES = "'none', 'fp16', 'bf16', 'int8', 'nf4', 'topk', 'powersgd', 'auto'"


@pytest.mark.parametrize("where", ["command line", "yaml"])
def test_a_bad_compression_is_said_as_what_was_given_and_the_choices(where, tmp_path, capsys):
    if where == "yaml":
        bad = tmp_path / "bad.yaml"
        bad.write_text("trainer:\n  strategy:\n    init_args:\n      communication_compression: int9\n")
        args = ["fit", "--config", DEMO, "--config", str(bad)]
    else:
        args = ["fit", "--config", DEMO, "--trainer.strategy.communication_compression", "int9"]
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    error = err[err.index("error: "):]
    assert error.startswith(f"error: trainer.strategy.communication_compression='int9' is not one of {CHOICES}, nor a GradientQuantizer."), error
    assert "--trainer.strategy.communication_compression GradientQuantizer --trainer.strategy.communication_compression.bits 8 (bits 16, 8 or 4" in error
    for noise in ("Expected a path", "dot import path", "Union subtypes", "NestedArg"):
        assert noise not in err, err
    assert len(error.splitlines()) == 1, error


def test_a_bad_gradient_quantizer_says_what_is_wrong_with_it(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", DEMO, "--trainer.strategy.communication_compression",
              '{"class_path": "GradientQuantizer", "init_args": {"bitz": 8}}'])
    err = capsys.readouterr().err
    assert "(the GradientQuantizer given: Option 'bitz' is not accepted)" in err and "Union subtypes" not in err, err


@pytest.mark.parametrize(
    "args, mode",
    [
        (["--trainer.strategy.communication_compression", "int8"], "int8"),
        (["--trainer.strategy.communication_compression", "GradientQuantizer", "--trainer.strategy.communication_compression.bits", "4"], "nf4"),
        (["--trainer.strategy.communication_compression", '{"class_path": "lightning_ciuic.GradientQuantizer", "init_args": {"bits": 16}}'], "fp16"),
        (["--config", "QUANTIZER_YAML"], "nf4"),
    ],
    ids=["mode", "class-name-and-bits", "class-path", "yaml-class-path"],
)
def test_the_good_forms_still_parse(args, mode, tmp_path):
    quantizer = tmp_path / "quantizer.yaml"
    quantizer.write_text(
        "trainer:\n  strategy:\n    init_args:\n      communication_compression:\n"
        "        class_path: lightning_ciuic.GradientQuantizer\n        init_args: {bits: 4}\n"
    )
    args = [str(quantizer) if a == "QUANTIZER_YAML" else a for a in args]
    cli = PackCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                  args=["--config", DEMO, *args])
    assert cli.trainer.strategy.parallelism.compression.mode == mode


def test_the_top_level_help_lists_the_packs_commands(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: lightning-ciuic ")
    for command in ("  plan ", "  checkpoint ", "  advise ", "  report ", "    fit "):
        assert command in printed, printed
    assert "TOML" in printed and "python -m lightning_ciuic" in printed


@pytest.mark.parametrize("command", [["plan", "--help"], ["checkpoint", "--help"], ["advise", "--help"]])
def test_each_packs_commands_help_says_usage_once(command, capsys):
    with pytest.raises(SystemExit) as done:
        main(command)
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"usage: lightning-ciuic {command[0]} ") and printed.count("usage:") == 1, printed


HF_LLAMA = str(ROOT / "examples/configs/hf_llama.yaml")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--model.init_args.model_type", "lamma"],
         "model_type='lamma' is not a transformers model type; the nearest causal-LM types: llama, mllama, llama4, zamba."),
        (["--model.init_args.model_type", "bert"],  # pp 2 x tp 2: before, "use at most 0 stages"
         "model_type='bert' builds BertLMHeadModel, which attends both ways with this config"),
    ],
)
def test_plan_says_a_model_the_config_cannot_build_in_one_line(overrides, message, capsys):
    from lightning_ciuic.cli import plan_command

    pytest.importorskip("transformers")
    assert plan_command(["--config", HF_LLAMA, "--world-size", "4", *overrides]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith(f"the config does not work: {message}") and len(said) < 600, said
    with pytest.raises(SystemExit, match="^lightning-ciuic: the config does not work: " + message.replace("(", r"\(").replace(")", r"\)")):
        main(["fit", "--config", HF_LLAMA, *overrides])


def test_instantiation_errors_keep_the_one_refusal_jsonargparse_wraps():
    from lightning_ciuic.cli_parsing import instantiation_error

    wrapped = (
        "Does not validate against any of the Union subtypes\nSubtypes: [LightningModule, NoneType]\nErrors:\n"
        "  - model_type='x' is refused\n  - Expected a <class 'NoneType'>\nGiven value type: Namespace\nGiven value: ..."
    )
    assert instantiation_error(wrapped) == "model_type='x' is refused"
    assert instantiation_error("plain") == "plain"


def test_a_strategys_refusal_in_a_config_is_said_alone(capsys):
    """A strategy's argument refused by the strategy (a rule between arguments) reached the plan's user inside
    jsonargparse's union report (``Trainer(strategy=...)`` is ``str | Strategy``: "Expected a <class 'str'>" beside
    it, then the whole namespace given, one line of 1,200 characters): the refusal alone now."""
    from lightning_ciuic.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["plan", "--config", "examples/configs/plan/deepseek_v3.yaml", "--world-size", "128",
              "--trainer.strategy.init_args.pipeline_schedule", "dualpipev", "--trainer.strategy.init_args.zero_stage", "3"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    said = [line for line in err.splitlines() if line.startswith("the config does not work")]
    assert said == [
        "the config does not work: pipeline_schedule='dualpipev' splits backward into input- and weight-gradient"
        " passes, which gave wrong first-stage gradients with stages sharded by ZeRO-3 (FSDP2 gathering weights for"
        " each backward, torch 2.13) in our tests: with zero_stage=3 use 'gpipe', '1f1b', 'interleaved_1f1b' or"
        " 'looped_bfs', or keep the schedule with zero_stage=1 or 2 (the pipelines' default)."
    ], err
    assert "Namespace(" not in err and "Expected a" not in err
