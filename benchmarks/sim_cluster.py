"""A simulated cluster on one machine: network namespaces joined by a veth/bridge, links capped with ``tc``.

``SimulatedCluster(nodes=2, rate="1gbit")`` creates namespaces ``ciuic-n0..`` each with one interface
(``10.77.0.<i+1>/24``) plugged into a bridge that lives in its own namespace, and caps every interface's
egress with a ``tbf`` qdisc at ``rate`` (both directions of every link: node side and bridge side).
``rate=None`` leaves the links uncapped. ``run(node, argv, env)`` starts a process inside a node, with
``GLOO_SOCKET_IFNAME`` set so gloo uses the capped link. Everything is removed on exit, also after an error.
:func:`run_two_nodes` runs one command as the two ranks of a ``num_nodes=2`` job, in a cluster's nodes or on
loopback; :func:`run_nodes` as ``per_node`` ranks on each of ``nodes`` nodes; :func:`run_measured` a benchmark's
worker that way, and reads back what it wrote; :func:`measured_rounds` every variant of a benchmark in alternating
rounds; :func:`node_benchmark_parser` the arguments such a benchmark takes.

Needs root and iproute2 (``ip``, ``tc``); :func:`available` says why not when it cannot work. Traffic stays on
addresses this module creates inside its own namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from benchmarks.common import ROOT, alternating, median_after_warmup

PREFIX = "ciuic"
SUBNET = "10.77.0"


def available() -> Optional[str]:
    """None if a simulated cluster can be built here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2 ('{tool}' not found)"
    return None


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class SimulatedCluster:
    def __init__(self, nodes: int = 2, rate: Optional[str] = "1gbit") -> None:
        reason = available()
        if reason:
            raise RuntimeError(f"cannot build a simulated cluster: {reason}")
        self.nodes, self.rate = nodes, rate
        self.switch = f"{PREFIX}-sw"

    def namespace(self, node: int) -> str:
        return f"{PREFIX}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def _cap(self, namespace: str, device: str) -> None:
        if self.rate:
            _sh("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
                "rate", self.rate, "burst", "512kb", "latency", "100ms")

    def __enter__(self) -> "SimulatedCluster":
        self._teardown()
        try:
            _sh("ip", "netns", "add", self.switch)
            _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for node in range(self.nodes):
                ns, inner, outer = self.namespace(node), f"{PREFIX}{node}", f"{PREFIX}{node}p"
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
                _sh("ip", "link", "set", inner, "netns", ns)
                _sh("ip", "link", "set", outer, "netns", self.switch)
                _sh("ip", "-n", self.switch, "link", "set", outer, "master", "br0")
                _sh("ip", "-n", self.switch, "link", "set", outer, "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", inner)
                _sh("ip", "-n", ns, "link", "set", inner, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                self._cap(ns, inner)
                self._cap(self.switch, outer)
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._teardown()

    def _teardown(self) -> None:
        for node in range(self.nodes):
            subprocess.run(["ip", "netns", "del", self.namespace(node)], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)

    def run(self, node: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        env = {**env, "GLOO_SOCKET_IFNAME": f"{PREFIX}{node}"}
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *argv], env=env)


def run_two_nodes(argv: list[str], cluster: Optional[SimulatedCluster], port: int = 29650, timeout: float = 1800) -> None:
    """Run ``argv`` as node 0 and node 1 of a two-node job (``WORLD_SIZE=2``, one process per node, as Lightning's
    ``num_nodes=2, devices=1`` expects): inside ``cluster``'s nodes, or on loopback when it is None."""
    run_nodes(argv, cluster, 2, 1, port, timeout)


def run_nodes(
    argv: list[str], cluster: Optional[SimulatedCluster], nodes: int, per_node: int, port: int = 29650, timeout: float = 1800,
) -> None:
    """Run ``argv`` as ``per_node`` processes on each of ``nodes`` nodes (``WORLD_SIZE``, ``NODE_RANK``,
    ``LOCAL_RANK`` as Lightning's ``num_nodes=nodes, devices=per_node`` expects): inside ``cluster``'s nodes (the
    processes of one node share its namespace: what they send each other stays off its link), or on loopback."""
    base = {**os.environ, "MASTER_PORT": str(port), "WORLD_SIZE": str(nodes * per_node), "PYTHONPATH": str(ROOT)}
    if cluster is None:
        base.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    else:
        base.update(MASTER_ADDR=cluster.address(0))
    procs = []
    for node in range(nodes):
        for local in range(per_node):
            env = {**base, "NODE_RANK": str(node), "LOCAL_RANK": str(local)}
            procs.append(subprocess.Popen(argv, env=env) if cluster is None else cluster.run(node, argv, env))
    codes = [p.wait(timeout=timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"exit codes {codes}; the log shows why")


def run_measured(argv: list[str], out: Path, cluster: Optional[SimulatedCluster], nodes: int, per_node: int, warmup: int) -> dict:
    """:func:`run_nodes` of a benchmark's worker ``argv`` that writes its ``StepTimer`` JSON to ``out`` and its
    report to ``out.report``: the two merged, with ``step`` the median step after ``warmup`` steps."""
    run_nodes(argv, cluster, nodes, per_node)
    result = {**json.loads(out.read_text()), **json.loads(Path(str(out) + ".report").read_text())}
    result["step"] = median_after_warmup(result["times"], warmup)
    return result


def node_benchmark_parser(variant: str, steps: int) -> argparse.ArgumentParser:
    """The arguments every benchmark on simulated nodes takes: ``--worker`` (this process is one rank of a run, of
    ``--variant``, writing to ``--out``), the links' ``--rate``, ``--steps`` per run, ``--rounds`` of every variant,
    ``--dry-run`` (print the section, do not write docs/benchmarks.md)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--variant", default=variant)
    parser.add_argument("--out", default="")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="print the section, do not write docs/benchmarks.md")
    return parser


def measured_rounds(
    variants: tuple[str, ...], rounds: int, nodes: int, rate: str, run_one: Callable[[str, SimulatedCluster], dict],
    label: str, line: Callable[[dict], str],
) -> dict[str, list[dict]]:
    """Every variant run once a round by ``run_one(variant, cluster)`` (the order alternating: ``common.alternating``)
    on ``nodes`` simulated nodes at ``rate``; each run's ``line(result)`` printed as it ends; the results by variant."""
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with SimulatedCluster(nodes=nodes, rate=rate) as cluster:
        for r, variant in alternating(variants, rounds):
            result = run_one(variant, cluster)
            results[variant].append(result)
            print(f"{label} round {r} {variant}: {line(result)}", flush=True)
    return results
