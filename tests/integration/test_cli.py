"""LightningCLI: YAML selects the strategy and callbacks by name; the console script runs the main job."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch import LightningDataModule, LightningModule

from lightning_ciuic import HybridParallelStrategy, WarmupCosineSchedule

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
trainer:
  accelerator: cpu
  devices: 4
  strategy:
    class_path: HybridParallelStrategy
    init_args:
      tensor_parallel_size: 2
      bucket_size_mb: 4.0
      sync_timeout: 60
  callbacks:
    - class_path: WarmupCosineSchedule
      init_args:
        warmup_ratio: 0.1
model:
  class_path: examples.deepseek.DeepSeekMini
  init_args:
    dim: 32
data:
  class_path: examples.data.ByteCorpusDataModule
"""


def _cli(args):
    return LightningCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False, args=args)


def test_yaml_round_trip(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    cli = _cli(["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HybridParallelStrategy)
    assert strategy.parallelism.degrees["tensor_parallel_size"] == 2 and strategy.parallelism.bucket_size_mb == 4.0
    assert strategy.parallelism.sync_timeout == 60
    assert any(isinstance(c, WarmupCosineSchedule) and c.warmup_ratio == 0.1 for c in cli.trainer.callbacks)

    dumped = cli.parser.dump(cli.config, skip_none=False)
    again = tmp_path / "again.yaml"
    again.write_text(dumped)
    strategy_config = yaml.safe_load(dumped)["trainer"]["strategy"]
    assert strategy_config["class_path"] == "lightning_ciuic.HybridParallelStrategy"
    assert _cli(["--config", str(again)]).trainer.strategy.parallelism.bucket_size_mb == 4.0


def _console_fit(config: str, cwd: Path, *arguments: str) -> subprocess.CompletedProcess:
    """`lightning-ciuic fit --config examples/configs/<config>` run from ``cwd`` as a user runs it, shortened (no
    validation, a log line every step, no progress bar), with ``arguments``; it must end with exit status 0."""
    command = [
        sys.executable, "-m", "lightning_ciuic.cli", "fit", "--config", str(ROOT / "examples/configs" / config),
        "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", *arguments,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _logged_losses(run_dir: Path) -> list[float]:
    (metrics,) = Path(run_dir).rglob("metrics.csv")
    return [float(r["train/loss"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")]


def test_console_script_trains_the_main_job_shows_the_pack_and_resumes(tmp_path):
    """`lightning-ciuic fit --config examples/configs/demo.yaml`, shortened (4 processes, dp=2 x tp=2), run from an
    empty folder: it trains, stays quiet, ends with the pack's summary, and the resume command it prints works."""
    done = _console_fit("demo.yaml", tmp_path, "--trainer.max_steps=6")
    output = done.stderr + done.stdout
    assert "pp=1 x dp=2 x tp=2 (world size 4)" in output
    losses = _logged_losses(tmp_path)
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses

    assert "deprecated" not in output and "weights_only" not in output, output[-3000:]  # quiet by default
    summary = done.stdout[done.stdout.index("Summary: 6 optimizer steps."):]
    report = next(line for line in summary.splitlines() if line.startswith("- Communication report: "))
    assert Path(report.split(": ")[1].split(";")[0]).is_file() and "trace.json" in report
    assert "- Checkpoints in demo_logs/checkpoints" in summary and "-step=6 " in summary
    assert "- Snapshots: every 50 steps" in summary
    resume = next(line for line in summary.splitlines() if line.startswith("- Resume: "))
    assert resume.split("   ")[0] == f"- Resume: lightning-ciuic fit --config {ROOT / 'examples/configs/demo.yaml'} --ckpt_path last"

    # The end-of-training checkpoint counts epoch 0 as finished (Lightning's counters after a max_steps stop): allow
    # a second epoch so the resumed run has steps left to take.
    again = _console_fit("demo.yaml", tmp_path, "--trainer.max_steps=8", "--trainer.max_epochs=2", "--ckpt_path", "last")
    assert "Restored all states from the checkpoint at demo_logs/checkpoints/latest" in again.stdout + again.stderr
    assert "Summary: 2 optimizer steps (steps 7 to 8)." in again.stdout and "-step=8 " in again.stdout


def test_the_shipped_dualpipe_config_trains_with_its_pairs_overlapped_and_resumes(tmp_path):
    """`lightning-ciuic fit --config examples/configs/dualpipe.yaml` (DeepSeek-V3's way: pp 2 x dp 2, ep 2, DualPipeV
    with its forward-backward pairs overlapped and at most one weight backward deferred, DeepSeek's recomputation, the
    bias balancer, the monitor), shortened:
    it trains, the monitor says how much of the all-to-alls was hidden (a middle pipeline stage's batch, which it
    does not read, is sized from the first stage's), and it resumes from its last checkpoint."""
    done = _console_fit("dualpipe.yaml", tmp_path, "--trainer.max_steps=6")
    output = done.stderr + done.stdout
    assert "pp=2 x dp=2 x tp=1 x ep=2" in output
    assert "dualpipev pipeline, 8 micro-batches, at most 1 weight backwards deferred" in output
    losses = _logged_losses(tmp_path)
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0, losses
    hidden = re.search(r"all-to-all [0-9.]+ MB sent and ([0-9.]+) ms per step, ([0-9.]+) ms of it exposed \(([0-9]+)% hidden", output)
    assert hidden is not None and float(hidden[2]) < float(hidden[1]) and int(hidden[3]) > 0, output[-3000:]
    assert "add ExpertLoadBalancer" not in output  # it is on: the advice, if any, is about its rate

    again = _console_fit("dualpipe.yaml", tmp_path, "--trainer.max_steps=8", "--trainer.max_epochs=2", "--ckpt_path", "last")
    assert "Restored all states from the checkpoint" in again.stdout + again.stderr
    assert "Summary: 2 optimizer steps (steps 7 to 8)." in again.stdout


def test_shipped_pipeline_configs_parse():
    """The pipeline demo and the Hugging Face Llama config build their strategy, model and data from YAML."""
    for name, model_type in (("pipeline.yaml", "DeepSeekMini"), ("hf_llama.yaml", "HuggingFaceCausalLM")):
        cli = _cli(["--config", str(ROOT / "examples" / "configs" / name)])
        strategy = cli.trainer.strategy
        assert strategy.parallelism.degrees["pipeline_parallel_size"] == 2 and strategy.parallelism.degrees["tensor_parallel_size"] == 2
        assert strategy.parallelism.pipeline.schedule == "1f1b" and strategy.parallelism.pipeline.num_microbatches == 4
        assert type(cli.model).__name__ == model_type
        assert len(cli.model.pipeline_blocks()) >= 4


def test_shipped_sharded_config_parses():
    """The sharded main job: FSDP2 over dp_shard=2 x tp=2 from YAML."""
    strategy = _cli(["--config", str(ROOT / "examples" / "configs" / "sharded.yaml")]).trainer.strategy
    assert strategy.parallelism.degrees == dict(
        pipeline_parallel_size=1, data_parallel_size=2, tensor_parallel_size=2, data_parallel_shard_size=2,
        expert_parallel_size=1,
    )
    assert strategy.parallelism.sharding.zero_stage == 3


def test_shipped_experts_config_parses():
    """The main job with its experts sharded: FSDP2 over 4 ranks, experts over the same 4, the balancer on."""
    from lightning_ciuic import ExpertLoadBalancer

    cli = _cli(["--config", str(ROOT / "examples" / "configs" / "experts.yaml")])
    assert cli.trainer.strategy.parallelism.degrees == dict(
        pipeline_parallel_size=1, data_parallel_size=4, tensor_parallel_size=1, data_parallel_shard_size=4,
        expert_parallel_size=4,
    )
    assert any(isinstance(c, ExpertLoadBalancer) for c in cli.trainer.callbacks)
    assert cli.model.hparams.n_routed_experts == 8


TOML_RUN = """
seed_everything = 3

[trainer]
accelerator = "cpu"
devices = 2
max_steps = 2
limit_val_batches = 0
logger = false
enable_checkpointing = false
enable_progress_bar = false

[trainer.strategy]
class_path = "lightning_ciuic.HybridParallelStrategy"

[trainer.strategy.init_args]
data_parallel_size = 2
sync_timeout = 60

[model]
class_path = "examples.deepseek.DeepSeekMini"

[model.init_args]
dim = 32
n_layers = 2
n_heads = 2
n_routed_experts = 2
moe_inter_dim = 16
dense_inter_dim = 32
max_seq_len = 16

[data]
class_path = "examples.data.ByteCorpusDataModule"

[data.init_args]
seq_len = 16
batch_size = 4
"""


def test_a_toml_config_trains_from_python_dash_m(tmp_path):
    """torchtitan's users write TOML: ``python -m lightning_ciuic fit --config run.toml`` (2 processes, 2 steps) reads
    it as fit reads YAML (before: ``Unexpected config: <the whole file>``), and its ranks start as ``python -m`` too."""
    config = tmp_path / "run.toml"
    config.write_text(TOML_RUN)
    cli = _pack_cli(["--config", str(config)])
    assert cli.trainer.strategy.parallelism.degrees["data_parallel_size"] == 2 and cli.model.hparams.dim == 32
    assert cli.datamodule.batch_size == 4 and cli.trainer.max_steps == 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_ciuic", "fit", "--config", str(config)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Summary: 2 optimizer steps." in done.stdout, done.stdout[-2000:]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["init_args"]["batch_size"] == 4  # saved as YAML


def _pack_cli(args):
    from lightning_ciuic.cli import PackCLI

    return PackCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False, args=args)
