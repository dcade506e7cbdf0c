"""Hash throughput for checkpoint chunk names: BLAKE3 (format 2) against BLAKE2b-128 (format 1) and the usual
alternatives, on one thread, side by side.

Each round hashes one ``--mb`` MB buffer of random bytes with every function in turn (and copies it once, the
memory-bandwidth reference); ``--rounds`` alternating rounds; the table shows the median throughput and each
round's. Writes the ``hashing`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/hashing.py [--mb 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import blake3  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import machine, write_section  # noqa: E402

FUNCTIONS = {
    "BLAKE3-256 (format 2)": lambda data: blake3.blake3(data).digest(),
    "BLAKE2b-128 (format 1)": lambda data: hashlib.blake2b(data, digest_size=16).digest(),
    "SHA-256": lambda data: hashlib.sha256(data).digest(),
    "CRC32 (no collision resistance)": lambda data: zlib.crc32(data),
    "memory copy (reference)": lambda data: bytearray(data),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    data = memoryview(torch.randint(0, 256, (args.mb * 2**20,), dtype=torch.uint8).numpy().tobytes())
    speeds: dict[str, list[float]] = {name: [] for name in FUNCTIONS}
    for _ in range(args.rounds):
        for name, function in FUNCTIONS.items():
            start = time.perf_counter()
            function(data)
            speeds[name].append(len(data) / (time.perf_counter() - start) / 1e9)
    blake2b = statistics.median(speeds["BLAKE2b-128 (format 1)"])
    rows = [
        f"| {name} | **{statistics.median(s):.2f}** ({', '.join(f'{v:.2f}' for v in s)}) | {statistics.median(s) / blake2b:.1f}x |"
        for name, s in speeds.items()
    ]
    command = " ".join([".venv/bin/python benchmarks/hashing.py", *sys.argv[1:]])
    write_section("hashing", f"""## Hashing checkpoint chunks

Command: `{command}` (one {args.mb} MB buffer of random bytes, one thread, {args.rounds} alternating rounds; machine:
{machine()}). Chunk names are digests of their bytes: the hash is most of the CPU work of an incremental save.

| function | GB/s: median (rounds) | vs BLAKE2b-128 |
|---|---|---|
""" + "\n".join(rows))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
