"""What one gradient synchronization costs in computation: our reducers against torch's fp16 hook, bucket by bucket.

Two processes (gloo, 1 intra-op thread each), on loopback and on a simulated 2-node cluster with ``--rate`` links
(``benchmarks/sim_cluster.py``, needs root), average the gradient of the benchmarks' "large" model
(8.62M float32 values, in the buckets ``HybridParallelStrategy`` makes: 1 MB first, then 25 MB, then the rest)
with each variant, every bucket launched asynchronously in order and all then waited for (as DDP's reducer and
ours do), and time the whole set (median of ``--repeats`` after 3 warm-ups; ``--rounds`` alternating rounds, the
median of the rounds' medians):

* ``all_reduce fp32``: the backend's all-reduce alone (no cast): the floor of any variant here;
* ``torch fp16 hook``: what ``fp16_compress_hook`` computes (cast and divide, all-reduce, cast back), each bucket's
  all-reduce launched asynchronously as DDP launches its hooks;
* ``fp16``/``int8``/``nf4`` through :class:`~lightning_ciuic.comm.compression.GradientCompression` as training
  calls it (``reducer(key, bucket, shapes, group).wait()``), with error feedback as by default and the other way.

Then, in one process, the passes of the int8 and nf4 codecs over one 25 MB bucket: encode, decode, decode-and-add.
Loopback moves bytes at memory speed, so the differences there are computation; on the capped link the wire time
adds by each variant's bytes, and nothing else competes for the cores (``benchmarks/compression.py`` measures
whole training steps). Writes the ``codec_passes`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/codec_passes.py [--rounds 3] [--repeats 10] [--rate 1gbit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import machine, write_section  # noqa: E402
from benchmarks.sim_cluster import SimulatedCluster, available, run_two_nodes  # noqa: E402

VALUES = 8_620_000
BUCKETS = [262_144, 6_553_600, VALUES - 262_144 - 6_553_600]  # 1 MB, 25 MB, the rest (float32)
VARIANTS = ["all_reduce fp32", "torch fp16 hook", "fp16", "fp16 + error feedback", "int8", "int8 without error feedback",
            "nf4"]


def _reducer(variant: str):
    """``step(buffers)`` averaging every buffer with ``variant``, and a close function."""
    from lightning_ciuic.comm.compression import GradientCompression

    group = dist.group.WORLD
    if variant == "all_reduce fp32":
        return (lambda buffers: [w.wait() for w in [dist.all_reduce(b, async_op=True) for b in buffers]]), lambda: None
    if variant == "torch fp16 hook":  # torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook
        def hook(buffers):
            pending = []
            for b in buffers:  # DDP launches each bucket's hook as the bucket fills, and waits for all at the end
                wire = b.to(torch.float16).div_(2)
                pending.append((dist.all_reduce(wire, group=group, async_op=True), wire, b))
            for work, wire, b in pending:
                work.wait()
                b.copy_(wire)
        return hook, lambda: None
    mode = variant.split(" ")[0]
    feedback = True if "+ error feedback" in variant else False if "without" in variant else None
    reducer = GradientCompression(mode, error_feedback=feedback)

    def ours(buffers):
        pending = [reducer(str(i), b, [b.shape], group) for i, b in enumerate(buffers)]
        for p in pending:
            p.wait(timedelta(seconds=120))
    return ours, reducer.close


def _worker(rounds: int, repeats: int, out: str) -> None:
    """One of the two ranks (``NODE_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` from :func:`run_two_nodes`)."""
    torch.set_num_threads(1)
    rank = int(os.environ["NODE_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(rank)
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            step, close = _reducer(variant)
            times = []
            for attempt in range(3 + repeats):
                buffers = [torch.randn(n, generator=generator) for n in BUCKETS]
                dist.barrier()
                start = time.perf_counter()
                step(buffers)
                if attempt >= 3:
                    times.append(time.perf_counter() - start)
            close()
            slowest = torch.tensor(statistics.median(times), dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            medians[variant].append(slowest.item())
    if rank == 0:
        Path(out).write_text(json.dumps(medians))
    dist.barrier()
    dist.destroy_process_group()


def codec_passes(repeats: int) -> dict[str, float]:
    """Milliseconds per pass of the int8 and nf4 codecs over one 25 MB bucket, one thread."""
    from lightning_ciuic.wire.codecs import dense_codec

    torch.set_num_threads(1)
    n = BUCKETS[1]
    x, out = torch.randn(n), torch.empty(n)
    passes = {}
    for name in ("int8", "nf4"):
        codec = dense_codec(name)
        encoded = codec.encode(x)
        passes |= {
            f"{name} encode (absmax, scale, quantize, store)": lambda c=codec, e=encoded: c.encode_into(x, e, n),
            f"{name} decode into a float32 buffer": lambda c=codec, e=encoded: c.decode_into(e, n, out),
            f"{name} decode and add (the all-to-all's sum)": lambda c=codec, e=encoded: c.decode_into(e, n, out, accumulate=True),
        }
    passes |= {"fp16 cast, for comparison": lambda: x.to(torch.float16), "float32 copy, for comparison": lambda: out.copy_(x)}
    result = {}
    for name, run in passes.items():
        times = []
        for attempt in range(3 + repeats):
            start = time.perf_counter()
            run()
            if attempt >= 3:
                times.append(time.perf_counter() - start)
        result[name] = statistics.median(times) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rate", default="1gbit", help="the simulated cluster's links")
    parser.add_argument("--worker", default="", help="internal: run one rank, rank 0 writing its results here")
    args = parser.parse_args()
    if args.worker:
        return _worker(args.rounds, args.repeats, args.worker)
    links = {"loopback": None} if available() else {"loopback": None, args.rate: args.rate}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for link, rate in links.items():
            out = Path(tmp) / f"{link}.json"
            argv = [sys.executable, __file__, "--rounds", str(args.rounds), "--repeats", str(args.repeats), "--worker", str(out)]
            if rate is None:
                run_two_nodes(argv, None)
            else:
                with SimulatedCluster(nodes=2, rate=rate) as cluster:
                    run_two_nodes(argv, cluster)
            results[link] = json.loads(out.read_text())
    rows = []
    for variant in VARIANTS:
        cells = []
        for medians in results.values():
            m, hook = medians[variant], medians["torch fp16 hook"]
            cells.append(f"**{statistics.median(m) * 1e3:.1f}** ({', '.join(f'{t * 1e3:.1f}' for t in m)}) |"
                         f" {statistics.median(t / h for t, h in zip(m, hook)):.2f}")
        rows.append(f"| {variant} | {' | '.join(cells)} |")
    header = " | ".join(f"{link}: ms (rounds) | / torch fp16 hook" for link in results)
    passes = codec_passes(args.repeats)
    pass_rows = [f"| {name} | {ms:.2f} | {BUCKETS[1] * 4 / 1e9 / (ms / 1e3):.1f} |" for name, ms in passes.items()]
    write_section(
        "codec_passes",
        f"""
## What one gradient synchronization computes: our reducers against torch's fp16 hook

Command: `.venv/bin/python benchmarks/codec_passes.py --rounds {args.rounds} --repeats {args.repeats}`
(2 processes, gloo, 1 intra-op thread each, sharing this machine's cores, on loopback{'' if len(results) == 1 else f' and on a simulated 2-node cluster with {args.rate} links'};
{VALUES / 1e6:.2f}M float32 values in buckets of 1 MB, 25 MB and the rest, each launched asynchronously in order and all then waited for, as DDP's reducer (the hook) and ours do;
median of {args.repeats} after 3 warm-ups, the slower rank's; {args.rounds} alternating rounds; machine: {machine()}).
Loopback moves bytes at memory speed, so there the differences are computation and copying; on the capped link each
variant's bytes add their wire time. Nothing else runs: in training the codec also competes with backward for the cores.
{'' if len(results) > 1 else f'The capped link was skipped: {available()}.'}

| variant | {header} |
|---|{'---|---|' * len(results)}
""" + "\n".join(rows) + f"""

The int8 and nf4 codecs' passes over one 25 MB bucket (one thread, median of {args.repeats}):

| pass | ms | GB/s of float32 |
|---|---|---|
""" + "\n".join(pass_rows) + "\n",
    )
    print("\n".join(rows + pass_rows))


if __name__ == "__main__":
    main()
