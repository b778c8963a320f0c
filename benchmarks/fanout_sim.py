"""Predicted refit time against the number of receivers: star, tree and pipelined tree.

Predictions of a model (`benchmarks.fanout_model`), not measurements; no GPU, no network.
Prints one markdown table per bandwidth, then the fastest (max_children, chunk) per count.

    python -m benchmarks.fanout_sim                              # the tables of docs/fanout.md
    python -m benchmarks.fanout_sim --bandwidth-gb-s 386 --receivers 3 64 1024
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from benchmarks.fanout_model import LinkModel, Row, Topology, format_table, sweep

MIB = 2**20


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-gb", type=float, default=2.0, help="model bytes, in 1e9 bytes")
    parser.add_argument(
        "--bandwidth-gb-s",
        type=float,
        nargs="+",
        default=[50.0, 386.0],
        help="outbound bytes/s of one source, in 1e9 (one table each)",
    )
    parser.add_argument("--latency-us", type=float, default=10.0, help="per hop")
    parser.add_argument(
        "--chunk-overhead-us", type=float, default=10.0, help="fixed cost of each chunk read"
    )
    parser.add_argument(
        "--answer-us",
        type=float,
        default=0.0,
        help="the sidecar's time per answer, serialized over the receivers",
    )
    parser.add_argument("--chunk-mib", type=float, nargs="+", default=[4.0, 16.0, 64.0])
    parser.add_argument("--max-children", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument(
        "--receivers", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 64, 256, 1024, 4096]
    )
    return parser.parse_args(argv)


def fastest(rows: Sequence[Row]) -> str:
    """Per receiver count, the pipelined row with the lowest predicted time, against one
    receiver alone at its best chunk size."""
    pipelined = [r for r in rows if r.topology is Topology.PIPELINED]
    alone = min(r.baseline_s for r in pipelined)
    lines = [
        "| N | fastest pipelined | ms | x one receiver at its best |",
        "| ---: | --- | ---: | ---: |",
    ]
    for i, n in enumerate(r.receivers for r in pipelined[0].results):
        best = min(pipelined, key=lambda r: r.results[i].refit_s)
        refit = best.results[i].refit_s
        lines.append(f"| {n} | {best.label} | {refit * 1e3:.1f} | {refit / alone:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    for bandwidth in args.bandwidth_gb_s:
        link = LinkModel(
            model_bytes=int(args.model_gb * 1e9),
            chunk_bytes=int(max(args.chunk_mib) * MIB),  # star and tree: the fewest reads
            bandwidth=bandwidth * 1e9,
            latency_s=args.latency_us * 1e-6,
            chunk_overhead_s=args.chunk_overhead_us * 1e-6,
            answer_s=args.answer_us * 1e-6,
        )
        rows = sweep(
            receivers=args.receivers,
            link=link,
            chunk_sizes=[int(c * MIB) for c in args.chunk_mib],
            max_children=args.max_children,
        )
        print(
            f"\n#### S = {args.model_gb:g} GB, B = {bandwidth:g} GB/s per source, "
            f"L = {args.latency_us:g} us per hop, {args.chunk_overhead_us:g} us per chunk read, "
            f"{args.answer_us:g} us per answer\n"
        )
        print("Predicted refit time in ms (x one receiver alone, same chunk size):\n")
        print(format_table(rows))
        print()
        print(fastest(rows))


if __name__ == "__main__":
    main()
