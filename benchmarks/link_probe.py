"""What the simulated cluster's link delivers, both ways at once, to each way of moving a message between two nodes.

One process per node (benchmarks/sim_cluster.py, ``--rate`` on every interface). For each message size (MiB each way)
and each method, node 0's time from a barrier to both directions delivered, median of ``REPEATS`` after one warm-up, as
MB/s each way; once with both nodes starting together, once with node 1 starting ``--late-ms`` after node 0 (as a rank
that computed longer arrives at its all-to-all late; node 0's time less that):

* ``tcp``: a plain TCP connection, each side sending and receiving on it at once (a thread each way);
* ``gloo recv first``: gloo's ``irecv`` posted, then its ``isend``, on both nodes;
* ``gloo send first``: ``isend`` posted, then ``irecv``;
* ``gloo all_to_all``: ``all_to_all_single`` with the message as the other node's part (what the expert dispatch calls).

Methods alternate (the order reversed every other round) for ``--rounds`` rounds; the table gives each median over the
rounds with its spread, and its fraction of the nominal rate. Writes the ``link_probe`` section of docs/benchmarks.md
(``--dry-run``: prints it only).

    sudo .venv/bin/python benchmarks/link_probe.py [--rate 1gbit] [--rounds 3] [--late-ms 50]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.common import machine, write_section  # noqa: E402
from benchmarks.sim_cluster import SimulatedCluster, available, run_two_nodes  # noqa: E402

SIZES_MIB = (0.5, 1, 2, 4, 8, 16)
METHODS = ("tcp", "gloo recv first", "gloo send first", "gloo all_to_all")
REPEATS = 5
TCP_PORT = 29700
RATES = {"gbit": 1e9 / 8, "mbit": 1e6 / 8}


def _median_seconds(barrier, move, late: float, rank: int) -> float:
    """Rank 0's median time to ``move`` from a barrier, less ``late`` (the seconds rank 1 sleeps after the barrier)."""
    times = []
    for _ in range(REPEATS + 1):
        barrier()
        if rank == 1:
            time.sleep(late)
        start = time.perf_counter()
        move()
        times.append(time.perf_counter() - start - late)
    return statistics.median(times[1:])


def _tcp_connection(rank: int, peer: str) -> socket.socket:
    if rank == 0:
        with socket.create_server(("0.0.0.0", TCP_PORT)) as server:
            return server.accept()[0]
    for _ in range(100):
        try:
            return socket.create_connection((peer, TCP_PORT))
        except ConnectionRefusedError:
            time.sleep(0.1)
    raise RuntimeError(f"no TCP connection to {peer}:{TCP_PORT}")


def _tcp_both_ways(connection: socket.socket, nbytes: int) -> None:
    payload = memoryview(bytearray(nbytes))

    def receive() -> None:
        into, got = bytearray(1 << 20), 0
        while got < nbytes:
            got += connection.recv_into(into, min(len(into), nbytes - got))

    receiver = threading.Thread(target=receive)
    receiver.start()
    connection.sendall(payload)
    receiver.join()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["NODE_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    connection = _tcp_connection(rank, os.environ["MASTER_ADDR"])
    result = {}
    for mib in SIZES_MIB:
        n = int(mib * 2**20) // 4
        mine, theirs = torch.randn(2 * n), torch.empty(2 * n)
        send, received = mine[peer * n:(peer + 1) * n], theirs[peer * n:(peer + 1) * n]

        def p2p(receive_first: bool) -> None:
            if receive_first:
                works = [dist.irecv(received, peer), dist.isend(send, peer)]
            else:
                works = [dist.isend(send, peer), dist.irecv(received, peer)]
            for work in works:
                work.wait()

        moves = {
            "tcp": lambda: _tcp_both_ways(connection, n * 4),
            "gloo recv first": lambda: p2p(True),
            "gloo send first": lambda: p2p(False),
            "gloo all_to_all": lambda: dist.all_to_all_single(theirs, mine),
        }
        order = METHODS if args.round % 2 == 0 else METHODS[::-1]
        result[str(mib)] = {m: _median_seconds(dist.barrier, moves[m], args.late_ms / 1e3, rank) for m in order}
    connection.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def nominal_bytes_per_second(rate: str) -> float:
    """``1gbit`` -> 125e6 (tc's units, decimal)."""
    for unit, scale in RATES.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: give it as tc does, e.g. 1gbit or 100mbit")


def measure(args: argparse.Namespace) -> str:
    reason = available()
    if reason:
        return f"Not run: {reason}."
    nominal = nominal_bytes_per_second(args.rate)
    rounds: dict[int, list[dict]] = {0: [], args.late_ms: []}
    with SimulatedCluster(nodes=2, rate=args.rate) as cluster, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for late_ms in rounds:
                out = Path(tmp) / f"round{r}_late{late_ms}.json"
                argv = [sys.executable, __file__, "--worker", "--round", str(r), "--late-ms", str(late_ms), "--out", str(out)]
                run_two_nodes(argv, cluster, timeout=600)
                rounds[late_ms].append(json.loads(out.read_text()))
                print(f"LINK round {r}, node 1 {late_ms} ms late: {rounds[late_ms][-1]}", flush=True)
    text = [
        f"Two simulated nodes at {args.rate} ({nominal / 1e6:g} MB/s each way), one process each, both sending and"
        f" receiving at once, {args.rounds} alternating rounds, each figure the median of {REPEATS} repeats on node 0:"
        " MB/s each way, median over the rounds (spread), and its fraction of the nominal rate.",
    ]
    for late_ms, runs in rounds.items():
        text += ["", "Both nodes start together:" if not late_ms else f"Node 1 starts {late_ms} ms after node 0 (node 0's time less {late_ms} ms):", "",
                 "| MiB each way | " + " | ".join(METHODS) + " |", "|---" * (len(METHODS) + 1) + "|"]
        for mib in SIZES_MIB:
            rates = {m: [mib * 2**20 / run[str(mib)][m] / 1e6 for run in runs] for m in METHODS}
            cells = [f"{statistics.median(r):.0f} ({min(r):.0f}-{max(r):.0f}), {statistics.median(r) * 1e6 / nominal:.2f}" for r in rates.values()]
            text.append(f"| {mib:g} | " + " | ".join(cells) + " |")
    return "\n".join(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--out", default="")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--late-ms", type=int, default=50, help="how late node 1 starts in the second measurement")
    parser.add_argument("--dry-run", action="store_true", help="print the section, do not write docs/benchmarks.md")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    section = "\n".join([
        "## What the simulated link delivers, by method and message size",
        "",
        f"`sudo .venv/bin/python benchmarks/link_probe.py --rate {args.rate} --rounds {args.rounds} --late-ms {args.late_ms}`"
        f" on {machine()}.",
        "",
        measure(args),
    ])
    print(section)
    if not args.dry_run:
        write_section("link_probe", section)


if __name__ == "__main__":
    main()
