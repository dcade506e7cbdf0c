"""The ``lightning-ciuic`` console script: LightningCLI with every class of the pack available by name.

``lightning-ciuic fit --config examples/configs/demo.yaml`` trains the main job (``python -m lightning_ciuic`` is the
same command). Any LightningModule and LightningDataModule can be named in the config (``class_path``); the current
directory is put on ``sys.path`` first (as uvicorn and pytest do) so a project's own modules, such as
``examples.deepseek``, resolve without being installed. A config file is YAML (or JSON), or TOML where its name ends in
``.toml`` (the same keys and tables: ``[trainer.strategy.init_args]``):
:data:`~lightning_ciuic.cli_parsing.CONFIG_MODE`. ``lightning-ciuic --help``
lists the pack's commands beside Lightning's. A config whose classes cannot be built from it (a model's constructor
refusing its arguments, ...) is said as that refusal, one line, and the command exits 2
(:class:`~lightning_ciuic.cli_parsing.ConfigError`).

``lightning-ciuic advise RUN_DIR`` prints the CommunicationMonitor's summary and advice again, offline, from the
``monitor.json`` it wrote in ``RUN_DIR`` (or any folder below it); ``lightning-ciuic report RUN_DIR`` writes its
``report.html`` (and ``trace.json`` when the run was traced) again beside that ``monitor.json``.

A bad ``communication_compression`` (``--trainer.strategy.communication_compression int9``, or the same in YAML) is
said as the choices and what was given, instead of jsonargparse's error for each member of the argument's
``Union[CompressionMode, GradientQuantizer]`` ("Expected a path", "dot import path", ...):
:class:`~lightning_ciuic.cli_parsing.PackArgumentParser`. The parsing lives in :mod:`lightning_ciuic.cli_parsing`,
below this module and the planner, which reads configs with it too.
A set-up error of the strategy (a tensor-parallel plan that does not fit, ...), of a checkpoint restore (a damaged
checkpoint, a missing bucket, strict loading) or a pack callback's refusal at fit start is printed once, by the lowest
rank that had it, and the command exits 1 (:func:`~lightning_ciuic.parallel.shutdown.agree_on_setup`,
:func:`~lightning_ciuic.parallel.shutdown.reported_once`).

After ``fit``, the console script ends with a short summary of what the pack did (:mod:`lightning_ciuic.summary`):
the monitor's report, the checkpoints, the snapshots and how to resume.

``lightning-ciuic plan --config RUN.yaml --world-size N`` checks the run's layout for N ranks in this one process
(:mod:`lightning_ciuic.planner`, docs/plan.md): each class of ranks' memory, whether it fits ``--device-memory``,
uneven shards; ``--json OUT`` writes it; exit 1 when some rank does not fit, 2 when the config or the layout is
refused ("the config does not work: ...", "the layout does not work: ...").

``lightning-ciuic checkpoint ls URL`` lists AsyncCheckpointer checkpoints (name, step, epoch, sizes);
``checkpoint verify URL [NAME]`` re-reads and checks every chunk (exit 1 naming the damaged file);
``checkpoint export URL NAME OUT [--format torch|safetensors|hf]`` writes one checkpoint: as a plain ``torch.save``
dict (tensors on CPU; the default), as one safetensors file of the model's weights (any module), or, for a
``HuggingFaceCausalLM``, as a Hugging Face directory that ``transformers.AutoModelForCausalLM.from_pretrained(OUT)``
loads. ``checkpoint export DIR OUT [--format ...]`` does the same for a sharded checkpoint directory that
``trainer.save_checkpoint`` (or ``ModelCheckpoint``) wrote under the strategy (a DCP directory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import jsonargparse
from lightning.pytorch import LightningDataModule, LightningModule

import lightning_ciuic  # noqa: F401  (registers the strategy names and classes)
from lightning_ciuic.cli_parsing import ConfigCLI, ConfigError


def _latest_monitor_json(run_dir: str) -> Optional[Path]:
    root = Path(run_dir)
    found = [root] if root.is_file() else sorted(root.rglob("monitor.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        print(f"no monitor.json under {run_dir!r}: train with callbacks=[CommunicationMonitor()] first.", file=sys.stderr)
        return None
    return found[-1]


def advise_command(run_dir: str) -> int:
    from lightning_ciuic.advice import RunProfile, advise
    from lightning_ciuic.advice.report import summary_table

    found = _latest_monitor_json(run_dir)
    if found is None:
        return 2
    profile = RunProfile.from_json(json.loads(found.read_text())["profile"])
    print(f"{found}\n{summary_table(profile)}\n")
    advice = advise(profile)
    print("Advice:" if advice else "Advice: none (nothing found to gain >= 10%).")
    for item in advice:
        print(f"  - {item}")
    return 0


def report_command(run_dir: str) -> int:
    from lightning_ciuic.advice.report import write_report

    found = _latest_monitor_json(run_dir)
    if found is None:
        return 2
    for kind, path in write_report(found.parent, json.loads(found.read_text())).items():
        print(f"{kind}: {path}")
    return 0


CHECKPOINT_USAGE = (
    "usage: lightning-ciuic checkpoint ls URL | verify URL [NAME] | export URL NAME OUT [--format torch|safetensors|hf]"
    " | export DIR OUT [--format ...] (DIR: a sharded checkpoint trainer.save_checkpoint wrote)"
)
EXPORT_FORMATS = ("torch", "safetensors", "hf")


def checkpoint_command(argv: list[str]) -> int:
    from lightning_ciuic.checkpoint.dcp import load_full
    from lightning_ciuic.checkpoint.sharded import lightning_checkpoint
    from lightning_ciuic.checkpoint.incremental import CorruptCheckpointError
    from lightning_ciuic.plugins.checkpoint_io import ChunkedCheckpointIO
    from lightning_ciuic.summary import checkpoint_table

    if argv[:1] in (["-h"], ["--help"]):
        print(CHECKPOINT_USAGE)
        return 0
    if len(argv) < 2 or argv[0] not in ("ls", "verify", "export"):
        print(CHECKPOINT_USAGE, file=sys.stderr)
        return 2
    action, url, rest = argv[0], argv[1], argv[2:]
    if action == "export" and Path(url, ".metadata").is_file():  # a DCP directory of trainer.save_checkpoint
        from torch.distributed.checkpoint import FileSystemReader

        from lightning_ciuic.checkpoint.dcp import load_whole_dcp

        rest = [url, *rest]  # its name is the directory
        export_format, rest = _export_format(rest)
        if len(rest) != 2:
            print(CHECKPOINT_USAGE, file=sys.stderr)
            return 2
        return _export(lightning_checkpoint(load_whole_dcp(FileSystemReader(url))), url, rest[1], export_format)
    io = ChunkedCheckpointIO(url)
    manifests = io.catalog.manifests()
    if not manifests:
        what = "holds no committed checkpoint" if io.store.storage.exists("") else "does not exist"
        print(f"no checkpoints: {url} {what}; give the URL an AsyncCheckpointer wrote to.", file=sys.stderr)
        return 1
    if action == "ls":
        print("\n".join(checkpoint_table(manifests)))
        return 0
    if action == "verify":
        names = rest or [m.name for m in manifests]
        failed = 0
        for name in names:
            try:
                io.catalog.verify(io.catalog.get(name))
                print(f"ok       {name}")
            except (CorruptCheckpointError, FileNotFoundError) as err:
                failed += 1
                print(f"DAMAGED  {name}: {err}")
        return 1 if failed else 0
    export_format, rest = _export_format(rest)
    if len(rest) != 2:
        print(CHECKPOINT_USAGE, file=sys.stderr)
        return 2
    name = io.name_of(rest[0])
    return _export(lightning_checkpoint(load_full(io.store, name)), name, rest[1], export_format)


def _export_format(rest: list[str]) -> tuple[str, list[str]]:
    """``(format, the other arguments)`` of ``export``'s arguments; an unknown format is returned as it is."""
    if len(rest) >= 2 and rest[-2] == "--format":
        return rest[-1], rest[:-2]
    return "torch", rest


def _export(checkpoint: dict, name: str, out: str, export_format: str) -> int:
    """Write Lightning's whole checkpoint dict ``checkpoint`` to ``out`` in ``export_format``; the exit status."""
    import torch

    from lightning_ciuic.checkpoint.huggingface import save_pretrained, save_safetensors

    if export_format not in EXPORT_FORMATS:
        print(f"--format {export_format!r} is not one of {', '.join(EXPORT_FORMATS)}. {CHECKPOINT_USAGE}", file=sys.stderr)
        return 2
    if export_format == "torch":
        torch.save(checkpoint, out)
    elif export_format == "safetensors":
        save_safetensors(checkpoint.get("state_dict", checkpoint), out)
    else:
        hparams = checkpoint.get("hyper_parameters") or {}
        prefix = "model."
        if "model_type" not in hparams:
            print(
                f"--format hf needs a HuggingFaceCausalLM checkpoint (its hyper_parameters name the model_type); {name}"
                " has none. Use --format safetensors or torch.", file=sys.stderr,
            )
            return 2
        state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
        save_pretrained(hparams["model_type"], hparams.get("config") or {}, state, out)
    print(f"exported {name} to {out} ({export_format})")
    return 0


PLAN_USAGE = (
    "usage: lightning-ciuic plan --config RUN.yaml --world-size N [--device-memory 80GiB] [--json OUT.json]"
    " [--micro-batch-size B --sequence-length S [--flops 989T --link intra=900GB/s,inter=50GB/s [--efficiency 0.35]"
    " [--collective-latency 20us] [--fp8-speedup 1.41] --devices-per-node 8] [--processes P]] [--search] [any fit override, e.g. --trainer.strategy.init_args.tensor_parallel_size 8]"
)


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80GB"``, ``"512MiB"``, ``"1.5TiB"`` or a number of bytes, as bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, re.I)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write it as 80GiB, 80GB, 512MiB or a number of bytes.")
    number, prefix, binary = match.groups()
    base = 1024 if binary or not prefix else 1000
    return int(float(number) * base ** "_KMGT".index(prefix.upper() or "_"))


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ``ValueError`` becomes argparse's usage error, with its message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    return convert


def plan_command(argv: list[str]) -> int:
    """``lightning-ciuic plan``: the plan's table, and its JSON with ``--json``; exit 1 when a rank class does not fit,
    2 when the layout does not work, 3 when a pipeline stage's step failed in a worker process (one line)."""
    from lightning_ciuic.planner import plan
    from lightning_ciuic.planner.efficiency import FP8_SPEEDUP, KERNEL_EFFICIENCY
    from lightning_ciuic.planner.estimate import Hardware, parse_flops, parse_links, parse_seconds
    from lightning_ciuic.planner.train_step import StepSpec
    from lightning_ciuic.planner.workers import StageStepFailed

    parser = argparse.ArgumentParser(prog="lightning-ciuic plan", usage=PLAN_USAGE.removeprefix("usage: "), add_help=True)
    parser.add_argument("--config", help="the LightningCLI config (YAML, or TOML: a .toml file) that fit would read")
    parser.add_argument("--world-size", type=int, required=True, help="ranks to plan for (any number: no process starts)")
    parser.add_argument("--device-memory", type=parse_bytes, default=parse_bytes("80GiB"), help="memory per device (default 80GiB)")
    parser.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch: with --sequence-length, runs the step phase")
    parser.add_argument("--sequence-length", type=int, help="tokens per sequence")
    parser.add_argument("--flops", type=_argument(parse_flops), help="peak FLOP/s of one device (989T): with --link, a step-time estimate")
    parser.add_argument("--link", type=_argument(parse_links), help="link speeds per device, each way: intra=900GB/s,inter=50GB/s")
    parser.add_argument("--devices-per-node", type=int, default=8, help="devices per node (default 8): which axes cross nodes")
    parser.add_argument(
        "--efficiency", type=float, default=KERNEL_EFFICIENCY,
        help=f"fraction of the peak FLOP/s a training step's kernels reach (default {KERNEL_EFFICIENCY:.2f}: fitted on published runs, docs/plan.md)",
    )
    parser.add_argument(
        "--collective-latency", type=_argument(parse_seconds), default=0.0,
        help="seconds each collective call costs besides its bytes (20us; default 0: not modelled)",
    )
    parser.add_argument(
        "--fp8-speedup", type=float, default=FP8_SPEEDUP,
        help=f"how many times faster FP8 GEMMs run than bf16 ones (gemm_precision fp8; default {FP8_SPEEDUP:.2f}: fitted on published runs, docs/plan.md)",
    )
    parser.add_argument("--search", action="store_true", help="plan the other layouts of the world size too, ranked")
    parser.add_argument("--json", help="write the plan as JSON to this file")
    parser.add_argument(
        "--processes", type=int,
        default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        help="pipeline stages the step phase steps at once, in worker processes (default: the CPUs this process may use)",
    )
    options, overrides = parser.parse_known_args(argv)
    if (options.micro_batch_size is None) != (options.sequence_length is None):
        parser.error("the step phase needs both --micro-batch-size and --sequence-length (or neither: the static phase alone)")
    if (options.flops is None) != (options.link is None):
        parser.error("a step-time estimate needs both --flops and --link (or neither)")
    if options.flops is not None and options.micro_batch_size is None:
        parser.error("a step-time estimate needs the step phase's FLOPs and bytes: add --micro-batch-size and --sequence-length")
    if options.processes < 1:
        parser.error(f"--processes must be at least 1, got {options.processes}")
    step = StepSpec(options.micro_batch_size, options.sequence_length) if options.micro_batch_size else None
    hardware = None
    if options.flops is not None:
        try:
            hardware = Hardware(
                options.flops, *options.link, devices_per_node=options.devices_per_node, efficiency=options.efficiency,
                latency=options.collective_latency, fp8_speedup=options.fp8_speedup,
            )
        except ValueError as err:
            parser.error(str(err))
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if options.search:
        return _search_command(options, overrides, step, hardware)
    try:
        result = plan(
            options.config, world_size=options.world_size, cli_args=overrides, device_memory=options.device_memory,
            step=step, hardware=hardware, processes=options.processes, devices_per_node=options.devices_per_node,
        )
    except ConfigError as err:  # the config's classes, as fit builds them
        print(f"the config does not work: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as err:  # the layout's errors, as fit raises them
        print(f"the layout does not work: {err}", file=sys.stderr)
        return 2
    except StageStepFailed as err:  # one line: the stage, its rank, what failed
        print(f"the step phase failed: {err}", file=sys.stderr)
        return 3
    print(result.table())
    if options.json:
        Path(options.json).write_text(json.dumps(result.to_json(), indent=1))
        print(f"plan written to {options.json}")
    return 0 if result.all_fit else 1


def _search_command(options: argparse.Namespace, overrides: list[str], step: Any, hardware: Any) -> int:
    """``plan --search``: the ranked layouts; exit 1 when none fits."""
    from lightning_ciuic.planner import search_layouts
    from lightning_ciuic.planner.search import search_table
    from lightning_ciuic.planner.workers import StageStepFailed

    try:
        candidates = search_layouts(
            options.config, world_size=options.world_size, cli_args=overrides, devices_per_node=options.devices_per_node,
            device_memory=options.device_memory, step=step, hardware=hardware, processes=options.processes,
        )
    except ConfigError as err:
        print(f"the config does not work: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as err:  # the config itself (not a layout) does not work
        print(f"the run does not work: {err}", file=sys.stderr)
        return 2
    except StageStepFailed as err:
        print(f"the step phase failed: {err}", file=sys.stderr)
        return 3
    print(search_table(candidates))
    if options.json:
        Path(options.json).write_text(json.dumps(
            {"world_size": options.world_size, "candidates": [c.to_json() for c in candidates]}, indent=1
        ))
        print(f"search written to {options.json}")
    return 0 if any(c.plan is not None and c.plan.all_fit for c in candidates) else 1


DESCRIPTION = (
    "Lightning's Trainer commands (fit, validate, test, predict), every class of the pack available by name,\n"
    "and the pack's own commands (plan, checkpoint, advise, report: below)."
)
PACK_COMMANDS = """\
the pack's commands (each with --help):
  plan                  Check a run's layout for N ranks in this one process (memory per rank,
                        whether it fits, a step-time estimate): plan --config RUN.yaml --world-size N
  checkpoint            List, verify or export checkpoints: checkpoint ls URL | verify URL [NAME]
                        | export URL NAME OUT [--format torch|safetensors|hf]
  advise                The communication monitor's summary and advice, again: advise RUN_DIR
  report                Its report.html (and trace.json), again: report RUN_DIR

A config file (--config) is YAML or JSON, or TOML where its name ends in .toml.
python -m lightning_ciuic is the same command."""


class _HelpFormatter(jsonargparse.DefaultHelpFormatter):
    """jsonargparse's, keeping the description's and the epilog's lines as written (the pack's commands, aligned)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] in (["advise"], ["report"]):
        usage = f"usage: lightning-ciuic {argv[0]} RUN_DIR"
        if argv[1:] in (["-h"], ["--help"]):
            print(usage)
            raise SystemExit(0)
        if len(argv) != 2:
            raise SystemExit(usage)
        raise SystemExit((advise_command if argv[0] == "advise" else report_command)(argv[1]))
    if argv[:1] == ["checkpoint"]:
        raise SystemExit(checkpoint_command(argv[1:]))
    if argv[:1] == ["plan"]:
        raise SystemExit(plan_command(argv[1:]))
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        PackCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={
                "prog": "lightning-ciuic", "description": DESCRIPTION, "epilog": PACK_COMMANDS, "formatter_class": _HelpFormatter,
            },
        )
    except ConfigError as err:
        raise SystemExit(f"lightning-ciuic: the config does not work: {err}") from None


class PackCLI(ConfigCLI):
    """:class:`~lightning_ciuic.cli_parsing.ConfigCLI` whose progress bar counts to ``max_steps``
    (:mod:`lightning_ciuic.progress`) and that ends ``fit`` with the pack's summary (rank 0)."""

    def before_fit(self) -> None:
        from lightning_ciuic.progress import bound_to_max_steps

        bound_to_max_steps(self.trainer.progress_bar_callback)

    def after_fit(self) -> None:
        from lightning_ciuic.summary import run_summary

        if self.trainer.is_global_zero:
            print(run_summary(self.trainer, self.config_path()))

    def config_path(self) -> Optional[str]:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        paths = config.get("config") or []
        return str(paths[-1]) if paths else None


if __name__ == "__main__":
    main()
