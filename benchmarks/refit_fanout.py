"""Refit of several receivers at once: one alone, all from the trainer (star), and through the
sidecar's source tree (docs/fanout.md), from FinishTrainStep's return until the last receiver
has installed.

The harness is `benchmarks.refit_install`'s: the real sidecar and trainer (``--tp 1`` on GPU 0,
bf16, the config-only Llama of the preset) as subprocesses with authentication on, and
``--receivers`` receiver processes on GPU ``--dest-gpu`` (or one GPU each,
``--receiver-gpus``: a receiver may sit on the trainer's GPU beside it, except receiver 0, the
one-receiver baseline), each a transformers model and two
`Receiver`s: "direct" (reads the trainer's ranks) and "tree" (``FanOutOptions(enabled=True)``:
asks the sidecar where to read, reads its parent's chunks as they land, serves its own copy).
The sidecar runs with ``--max-children`` and ``--max-root-children`` set to ``--max-children``,
and ``--hold-parents-seconds`` as given (0 shows the tree changing shape with the order
receivers ask in).

Each timed round trains one step and, right after FinishTrainStep returns (answered once the
update is applied, as in refit_install: ``wait_for_update``), tells the receivers
of one mode to refit the new version at once (the same pipe message as refit_install):

* ``one``: receiver 0 alone, direct (the baseline);
* ``one-tree``: the tree's root alone (receiver 0 until a ``tree`` round says otherwise),
  through the tree (the tree's own overhead);
* ``star``: every receiver, direct: the trainer's links carry the model N times;
* ``tree``: every receiver through the tree.

A mode's latency is the last receiver's installed time minus the driver's instant (one
CLOCK_MONOTONIC for the machine). The modes rotate round by round, so drift hits them alike;
the first round of each mode on each trainer slot is a warm-up. A torch peer copy GPU 0 ->
``--dest-gpu`` of the same bytes is timed in receiver 0 every round. At the end, untimed, every
receiver refits one more version through the tree, and its model is checked against ExportHF
bit for bit and its logprobs against Forward.

    python -m benchmarks.refit_fanout --preset 1b --receivers 3 --max-children 1 \\
        --out runs/refit_fanout.json
    python -m benchmarks.refit_fanout --preset tiny --device cpu --receivers 3 --rounds 2 \\
        --out /tmp/refit_fanout.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks import refit_install as ri
from benchmarks.harness import run_meta, sidecar_server, tokens_for, trainer_root, trainer_server
from benchmarks.trainer_step import make_batches
from refit_sidecar.core.tree_records import TreeConfig
from refit_sidecar.pull.pipelined import DEFAULT_CHUNK_BYTES
from refit_sidecar.pull.running_check import DEFAULT_PART_BYTES
from trainer_refit.auth import Role
from trainer_svc.client import TrainerClient

log = logging.getLogger("benchmarks.refit_fanout")

MODES = ("one", "one-tree", "star", "tree")


def _receivers_of(mode: str, n: int, root: int) -> tuple[list[int], str]:
    """Who refits in `mode`, and how. `one-tree` is the tree's root alone (the receiver that
    read from the trainer in the last `tree` round): any other receiver would wait out the
    sidecar's hold for its parent of that round, which skips this version."""
    if mode == "one":
        return [0], "direct"
    if mode == "one-tree":
        return [root], "tree"
    return list(range(n)), "tree" if mode == "tree" else "direct"


def _reads_the_trainer(refit: dict[str, Any]) -> bool:
    """Every byte came from the trainer's ranks (`trainer_svc.runtime.publication` names
    their agents `trainer-rank<r>-<hex>`)."""
    return all(s.startswith("trainer-rank") for s in refit["stats"]["bytes_by_source"])


def run_rounds(
    client: TrainerClient,
    receivers: list[ri.ReceiverProcess],
    batches: list[Any],
    config: ri.RunConfig,
    rounds: int,
) -> list[dict[str, Any]]:
    records = []
    warm: set[tuple[str, int]] = set()
    index = root = 0
    version: int | None = None
    for r in range(rounds):
        for m in range(len(MODES)):
            mode = MODES[(m + r) % len(MODES)]
            which, kind = _receivers_of(mode, len(receivers), root)
            if config.expect and version is not None:
                for i in which:
                    receivers[i].request("expect", config.timeout, version=version + 1, mode=kind)
            step = ri.train_step(client, f"step-{index}", batches)
            version = step["version"]
            for i in which:
                receivers[i].send(
                    "refit", version=step["version"], finished_at=step["finished_at"], mode=kind
                )
            refits = [receivers[i].reply(config.refit_timeout + 30) for i in which]
            if mode == "tree":
                root = next(
                    (i for i, x in zip(which, refits, strict=True) if _reads_the_trainer(x)), root
                )
            peer = receivers[0].request("peer_copy", config.timeout)
            slot = step["version"] % config.slots
            warmup = (mode, slot) not in warm
            warm.add((mode, slot))
            latency = max(x["latency_s"] for x in refits)
            records.append(
                dict(
                    index=index,
                    round=r,
                    mode=mode,
                    warmup=warmup,
                    step=step,
                    latency_s=latency,
                    refits=refits,
                    peer_copy=peer,
                )
            )
            sources = [sorted(x["stats"]["bytes_by_source"]) for x in refits]
            log.info(
                "round %d %-8s version %d: per receiver, ms after FinishTrainStep returned: %s",
                r,
                mode,
                step["version"],
                [_timeline(x, step["finished_wall"]) for x in refits],
            )
            log.info(
                "round %d %-8s version %d%s: %.2f ms to the last install (peer copy %.2f ms); "
                "per receiver: latency %s, asking the sidecar %s, reading %s ms (reads in "
                "flight %s, waiting on a parent %s ms; requests prepared %s); sources %s",
                r,
                mode,
                step["version"],
                ", warm-up" if warmup else "",
                1e3 * latency,
                1e3 * peer["seconds"],
                [round(1e3 * x["latency_s"], 1) for x in refits],
                [round(1e3 * x["stats"]["ask_s"], 1) for x in refits],
                [
                    round(1e3 * (x["stats"]["pull_finished"] - x["stats"]["pull_started"]), 1)
                    for x in refits
                ],
                [round(1e3 * x["stats"]["reading_s"], 1) for x in refits],
                [round(1e3 * x["stats"]["gated_s"], 1) for x in refits],
                [x["stats"]["prepared"] for x in refits],
                sources,
            )
            chain = _chain(refits, step["finished_wall"])
            if chain:
                log.info("round %d %-8s version %d: traced, %s", r, mode, step["version"], chain)
            index += 1
    return records


_MARKS = (
    ("readable", "sidecar_readable_at"),
    ("answered", "sidecar_answered_at"),
    ("leased", "leased_at"),
    ("first read", "pull_started"),
    ("pulled", "pull_finished"),
)


def _timeline(refit: dict[str, Any], finished_wall: float) -> str:
    """One receiver's refit as times after the step's return: the version readable and the
    answer built (the sidecar's clock), the answer in hand, the first and last read, the
    install (the receiver's clock; one host, so one clock)."""
    stats = refit["stats"]
    marks = [
        f"{name} {1e3 * (stats[key] - finished_wall):.1f}" for name, key in _MARKS if stats[key]
    ]
    return ", ".join([*marks, f"installed {1e3 * refit['latency_s']:.1f}"])


def _chain(refits: list[dict[str, Any]], finished_wall: float) -> str:
    """From the receivers' pull traces (`--trace`), ms after FinishTrainStep returned: each
    one's first post, last landing, last fill stored for its children (the store begun) and
    check's end, and, for one reading a peer, when it saw the peer's last fill, and how long
    after the peer began storing it (what each level of a chain adds). "" without traces."""

    def ms(at: float) -> str:
        return f"{1e3 * (at - finished_wall):.1f}"

    traced = [x for x in refits if x["stats"].get("trace")]
    stored: dict[str, float] = {}
    for x in traced:
        fills = [(value, at) for at, name, _, value in x["stats"]["trace"] if name == "filled"]
        if fills:
            stored[x["agent"]] = max(fills)[1]
    items = []
    for x in traced:
        events = x["stats"]["trace"]
        times = {
            name: [at for at, kind, _, _ in events if kind == name]
            for name in ("posted", "landed", "verified")
        }
        parts = [x["agent"]]
        if times["posted"]:
            parts.append(f"first post {ms(times['posted'][0])}")
        if times["landed"]:
            parts.append(f"last landed {ms(times['landed'][-1])}")
        if x["agent"] in stored:
            parts.append(f"last fill stored {ms(stored[x['agent']])}")
        if times["verified"]:
            parts.append(f"verified {ms(times['verified'][-1])}")
        saw = [(value, at, peer) for at, kind, peer, value in events if kind == "saw"]
        if saw:
            _, at, peer = max(saw, key=lambda s: (s[0], -s[1]))
            lag = f", {1e3 * (at - stored[peer]):+.1f} after" if peer in stored else ""
            parts.append(f"saw {peer}'s last fill {ms(at)}{lag}")
        items.append(": ".join([parts[0], ", ".join(parts[1:])]))
    return "; ".join(items)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    timed = [r for r in records if not r["warmup"]]
    median = {
        mode: statistics.median(r["latency_s"] for r in timed if r["mode"] == mode)
        for mode in MODES
        if any(r["mode"] == mode for r in timed)
    }
    if "one" not in median:
        raise RuntimeError("no timed round of mode 'one': raise --rounds")
    peer = statistics.median(r["peer_copy"]["seconds"] for r in timed)
    last_tree = next((r for r in reversed(timed) if r["mode"] == "tree"), None)
    return dict(
        median_ms={m: 1e3 * v for m, v in median.items()},
        over_one={m: v / median["one"] for m, v in median.items()},
        paired_over_one=_paired(timed),
        peer_copy_ms=1e3 * peer,
        refit_bytes=timed[-1]["refits"][0]["stats"]["bytes_pulled"],
        timed_rounds={m: sum(r["mode"] == m for r in timed) for m in MODES},
        tree_sources=None
        if last_tree is None
        else [x["stats"]["bytes_by_source"] for x in last_tree["refits"]],
        tree_fallbacks=sum(x["stats"]["fallbacks"] for r in timed for x in r["refits"]),
    )


def _paired(timed: list[dict[str, Any]]) -> dict[str, float]:
    """Per mode, the median over rounds of its latency over the direct receiver's in the same
    round (the GPU host's speed drifts between rounds as well as between runs)."""
    rounds: dict[int, dict[str, float]] = {}
    for record in timed:
        rounds.setdefault(record["round"], {})[record["mode"]] = record["latency_s"]
    ratios: dict[str, list[float]] = {}
    for modes in rounds.values():
        if "one" in modes:
            for mode, latency in modes.items():
                ratios.setdefault(mode, []).append(latency / modes["one"])
    return {mode: statistics.median(values) for mode, values in ratios.items()}


def run(config: ri.RunConfig, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model_dir = ri.write_model(work / "model", config)
    batches = make_batches(asdict(config))
    logs = config.log_dir
    tokens = tokens_for(work)
    orchestrator = tokens.client(Role.ORCHESTRATOR)
    root = trainer_root(work)
    tree_flags = ["--max-children", str(args.max_children)]
    tree_flags += ["--max-root-children", str(args.max_children)]
    tree_flags += ["--hold-parents-seconds", str(args.hold_parents_seconds)]
    tree_flags += ["--log-level", args.sidecar_log_level]
    with contextlib.ExitStack() as stack:
        sidecar = stack.enter_context(
            sidecar_server(work, logs / "sidecar.log", config.timeout, tokens, tree_flags)
        )
        base = replace(
            ri.receiver_settings(config, sidecar, tokens.file(Role.RECEIVER), model_dir),
            tree=True,
            chunk_bytes=args.chunk_bytes,
            chunk_taper=args.chunk_taper,
            check_part_bytes=args.check_part_bytes,
            trace=args.trace,
        )
        receivers = []
        for i, gpu in enumerate(placement(config, args)):
            settings = replace(base, receiver_id=f"fanout-{i}")
            if gpu is not None:
                settings = replace(settings, dest=f"cuda:{gpu}")
            run_dir = work / f"receiver-{i}"
            run_dir.mkdir(parents=True, exist_ok=True)
            receivers.append(
                stack.enter_context(
                    ri.receiver_process(settings, run_dir, logs / f"receiver-{i}.log")
                )
            )
        trainer_args = [
            *config.trainer_args(model_dir),
            *tokens.publisher_args(sidecar),
            *tokens.server_args(),
            *("--work-dir", str(root)),
        ]
        plan = dict(trainer_args=trainer_args, timeout_s=config.timeout)
        target, startup_s = stack.enter_context(
            trainer_server(plan, work, logs / "trainer.log", auth=orchestrator)
        )
        ready = [r.reply(config.timeout) for r in receivers]
        log.info("receivers ready: %s", ready[0])
        with TrainerClient(target, auth=orchestrator) as client:
            status = client.status()
            records = run_rounds(client, receivers, batches, config, args.rounds)
            # Untimed: every receiver on the newest version, through the tree, for the checks.
            step = ri.train_step(client, "final", batches)
            for r in receivers:
                r.send(
                    "refit", version=step["version"], finished_at=step["finished_at"], mode="tree"
                )
            final = [r.reply(config.refit_timeout + 30) for r in receivers]
            log.info("final tree refit: %s", [x["stats"]["bytes_by_source"] for x in final])
            checks = (
                [ri.verify(client, r, root, config) for r in receivers] if config.verify else []
            )
    return dict(
        receivers=ready,
        trainer=dict(
            startup_s=startup_s,
            num_parameters=status.model.num_parameters,
            device=status.device,
            args=trainer_args,
        ),
        records=records,
        checks=checks,
    )


def placement(config: ri.RunConfig, args: argparse.Namespace) -> list[int | None]:
    """Each receiver's GPU (None: the CPU): `--receiver-gpus` where given, else `--dest-gpu`
    for all. Receiver 0 is the one-receiver baseline: it stays off the trainer's GPU."""
    if not config.cuda:
        return [None] * args.receivers
    if args.receiver_gpus is None:
        return [config.dest_gpu] * args.receivers
    gpus = [int(g) for g in args.receiver_gpus.split(",")]
    if len(gpus) != args.receivers or any(g < 0 for g in gpus):
        raise SystemExit(f"--receiver-gpus needs {args.receivers} GPU indices, got {gpus}")
    if gpus[0] == 0:
        raise SystemExit("--receiver-gpus: receiver 0 (the baseline) must not share GPU 0")
    return list(gpus)


def print_summary(summary: dict[str, Any], checks: list[dict[str, Any]], n: int) -> None:
    print(f"\nbytes per receiver: {summary['refit_bytes']:,}; {n} receivers")
    print("FinishTrainStep returned -> last receiver installed, medians:")
    paired = summary["paired_over_one"]
    for mode, ms in summary["median_ms"].items():
        print(
            f"  {mode:9s} {ms:9.3f} ms  x one: {summary['over_one'][mode]:.3f}"
            + (f"  (per round: {paired[mode]:.3f})" if mode in paired else "")
        )
    print(f"  peer copy {summary['peer_copy_ms']:.3f} ms; fallbacks {summary['tree_fallbacks']}")
    print(f"tree sources (last timed round): {summary['tree_sources']}")
    for i, check in enumerate(checks):
        print(
            f"receiver {i}: equals ExportHF of version {check['version']}: {check['identical']}; "
            f"max |logprob gap| {check['max_logprob_gap']:.3g}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = ri.build_parser()
    p.prog = "python -m benchmarks.refit_fanout"
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    fan = p.add_argument_group("fan-out")
    fan.add_argument("--receivers", type=int, default=3)
    fan.add_argument("--max-children", type=int, default=1, help="the sidecar's tree fan-out")
    fan.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    fan.add_argument(
        "--receiver-gpus",
        default=None,
        help="comma-separated GPU per receiver (default: all on --dest-gpu); the trainer is "
        "on GPU 0, where a receiver may sit beside it; receiver 0, the one-receiver "
        "baseline, may not",
    )
    fan.add_argument(
        "--chunk-taper",
        type=int,
        default=0,
        help="halvings of the chunk size towards each end of a source's reads",
    )
    fan.add_argument(
        "--check-part-bytes",
        type=int,
        default=DEFAULT_PART_BYTES,
        help="bytes per part of a tree receiver's running check (the last part is summed "
        "after the pull)",
    )
    fan.add_argument("--rounds", type=int, default=4, help="rounds of the four modes")
    fan.add_argument(
        "--hold-parents-seconds",
        type=float,
        default=TreeConfig.hold_parents_s,
        help="the sidecar's holding of the tree's shape (0: off, the tree as receivers ask)",
    )
    fan.add_argument(
        "--sidecar-log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="DEBUG: when each version became readable and each receiver was answered",
    )
    p.set_defaults(out=Path("runs/refit_fanout.json"), warmup=1, steps=1)
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.receiver_settings is not None:
        ri.receiver_main(args.receiver_settings, args.command_fd, args.reply_fd)
        return
    if args.receivers < 1 or args.rounds < 2:
        parser.error("--receivers must be >= 1 and --rounds >= 2 (the first are warm-ups)")
    fan = {
        k: getattr(args, k)
        for k in (
            "receivers",
            "max_children",
            "chunk_bytes",
            "receiver_gpus",
            "chunk_taper",
            "check_part_bytes",
            "rounds",
            "hold_parents_seconds",
            "sidecar_log_level",
        )
    }
    for key in fan:
        delattr(args, key)
    fan["trace"] = args.trace  # the harness's option, read by both
    config = ri.resolve(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [bench] %(levelname)s %(message)s")
    config.log_dir.mkdir(parents=True, exist_ok=True)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    options = argparse.Namespace(**fan)
    placement(config, options)  # checked before anything starts
    with tempfile.TemporaryDirectory(prefix="refit-fanout-bench-") as scratch:
        work = (config.work_dir or Path(scratch)).absolute()
        work.mkdir(parents=True, exist_ok=True)
        result = run(config, options, work)
    summary = summarize(result["records"])
    meta = dict(
        run_meta("benchmarks.refit_fanout", argv),
        config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        fanout=fan,
        gpus=ri.gpus(),
    )
    config.out.write_text(json.dumps(dict(meta=meta, summary=summary, **result), indent=1) + "\n")
    print_summary(summary, result["checks"], fan["receivers"])
    print(f"results: {config.out}")


if __name__ == "__main__":
    main()
