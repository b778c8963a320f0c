"""What a host slot's checksums cost its publisher, and a receiver's partial sums in host
memory: seconds per GiB of the CRC-32 (zlib) and the WSUM-64 (`wsum.host_wsum64`) of one
buffer of random bytes, and of `SumPlan.host` over a column half of a bf16 weight (a piece per
row, as a TP=2 worker reads a TP=1 trainer's row-parallel shard) and over a row half (one
piece, as it reads a column-parallel shard). Best of `--repeats`.

    python -m benchmarks.host_checksums --mib 256 --repeats 5 --out host_checksums.json
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness import run_meta
from refit_sidecar.integrity.wsum import SumPlan, host_wsum64


def best_s_per_gib(work: Callable[[], object], nbytes: int, repeats: int) -> float:
    """The best of `repeats` timed runs, after an untimed one (first allocations)."""
    work()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best / (nbytes / 2**30)


def measure(mib: int, repeats: int, width: int = 4096) -> dict[str, float]:
    """Seconds per GiB of each; prints them and the WSUM-64's ratio to the CRC-32."""
    data = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)
    rows = data.nbytes // (2 * width)
    row = 2 * width
    starts = np.arange(rows, dtype=np.int64) * row + row // 2
    half = SumPlan.of(starts, np.full(rows, row // 2), starts, np.zeros(rows), 1)
    rows_half = SumPlan.of([data.nbytes // 2], [data.nbytes // 2], [data.nbytes // 2], [0], 1)
    result = {
        "crc32": best_s_per_gib(lambda: zlib.crc32(data.data), data.nbytes, repeats),
        "host_wsum64": best_s_per_gib(lambda: host_wsum64(data), data.nbytes, repeats),
        "column_half_sum": best_s_per_gib(lambda: half.host(data), half.nbytes, repeats),
        "row_half_sum": best_s_per_gib(lambda: rows_half.host(data), rows_half.nbytes, repeats),
    }
    for name, value in result.items():
        print(f"{name:>16}: {value:.3f} s/GiB")
    print(f"host_wsum64 / crc32: {result['host_wsum64'] / result['crc32']:.1f}x")
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the results (JSON) here")
    args = parser.parse_args(argv)
    result = measure(args.mib, args.repeats)
    if args.out is not None:
        meta = dict(run_meta("benchmarks.host_checksums", argv), mib=args.mib, repeats=args.repeats)
        args.out.write_text(json.dumps(dict(meta=meta, s_per_gib=result), indent=1) + "\n")


if __name__ == "__main__":
    main()
