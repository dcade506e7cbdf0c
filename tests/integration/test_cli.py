"""LightningCLI: YAML selects the strategy and callbacks by name; the console script runs the main job."""

import csv
import os
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
    assert strategy._requested["tensor_parallel_size"] == 2 and strategy.bucket_size_mb == 4.0
    assert strategy._sync_timeout.total_seconds() == 60
    assert any(isinstance(c, WarmupCosineSchedule) and c.warmup_ratio == 0.1 for c in cli.trainer.callbacks)

    dumped = cli.parser.dump(cli.config, skip_none=False)
    again = tmp_path / "again.yaml"
    again.write_text(dumped)
    strategy_config = yaml.safe_load(dumped)["trainer"]["strategy"]
    assert strategy_config["class_path"] == "lightning_ciuic.HybridParallelStrategy"
    assert _cli(["--config", str(again)]).trainer.strategy.bucket_size_mb == 4.0


def test_console_script_trains_the_main_job(tmp_path):
    """`lightning-ciuic fit --config examples/configs/demo.yaml`, shortened: 4 processes, dp=2 x tp=2."""
    command = [
        sys.executable, "-m", "lightning_ciuic.cli", "fit", "--config", "examples/configs/demo.yaml",
        "--trainer.max_steps=12", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=2",
        "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pp=1 x dp=2 x tp=2 (world size 4)" in done.stderr + done.stdout
    (metrics,) = Path(tmp_path).rglob("metrics.csv")
    losses = [float(r["train/loss"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")]
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses


def test_shipped_pipeline_configs_parse():
    """The pipeline demo and the Hugging Face Llama config build their strategy, model and data from YAML."""
    for name, model_type in (("pipeline.yaml", "DeepSeekMini"), ("hf_llama.yaml", "HuggingFaceCausalLM")):
        cli = _cli(["--config", str(ROOT / "examples" / "configs" / name)])
        strategy = cli.trainer.strategy
        assert strategy._requested["pipeline_parallel_size"] == 2 and strategy._requested["tensor_parallel_size"] == 2
        assert strategy._pipeline_config.schedule == "1f1b" and strategy._pipeline_config.num_microbatches == 4
        assert type(cli.model).__name__ == model_type
        assert len(cli.model.pipeline_blocks()) >= 4


def test_shipped_sharded_config_parses():
    """The sharded main job: FSDP2 over dp_shard=2 x tp=2 from YAML."""
    strategy = _cli(["--config", str(ROOT / "examples" / "configs" / "sharded.yaml")]).trainer.strategy
    assert strategy._requested == dict(
        pipeline_parallel_size=1, data_parallel_size=2, tensor_parallel_size=2, data_parallel_shard_size=2
    )
    assert strategy.sharding_config.reshard_after_forward is True
