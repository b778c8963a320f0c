"""Refit on two GPUs: NIXL pulls of a published version against a torch peer copy of the same
bytes, and what publication adds to FinishTrainStep.

* ``python -m refit_sidecar`` and the real trainer, ``python -m trainer_svc --model DIR --tp 1
  --device cuda --sidecar ADDR --refit-slots 2`` (its one rank on GPU 0, a config-only Llama
  directory as in ``benchmarks.trainer_step``), run as subprocesses, with authentication on as
  deployed (``benchmarks.trainer_step.tokens_for``: each process and client holds its role's
  token). This process trains a few steps over gRPC; every FinishTrainStep publishes the new
  version into a VRAM snapshot slot.
* A puller subprocess (this script with ``--puller-plan``) leases the latest version, plans the
  whole model (``plan_pull(manifest, whole(manifest))``) and pulls it ``--pulls`` times with
  ``NixlTransport`` into one VRAM buffer on GPU ``--dest-gpu`` (registered once; the first pull,
  which connects and prepares the requests, is reported apart). Alternating with the pulls it
  times a torch peer copy (``.copy_()`` from GPU 0 to the same destination spans, one tensor of
  the same size per parameter) and a copy of the same tensors within GPU 0, the device-local copy
  that publication is allowed to cost. Once, untimed, the pulled weights are checked bit for bit
  against ExportHF of the same version.
* The same steps then run on a trainer without ``--sidecar``: the difference of the median
  FinishTrainStep times is what publication costs a step. Two processes differ by more than
  that, though (FinishTrainStep's median moved by 10-20 ms between trainer processes of the
  same code on the GPU hosts), so a third trainer, with a sidecar and ``--refit-publish-every
  3``, runs ``--interleaved-steps`` steps: within one process, each publishing step and the one
  after it against the two steps around them untouched by publication (`interleaved`). That
  is the publication's hold-up of the training loop, wherever it falls (the step's own
  FinishTrainStep, or the next step, which the copy, checksums and report run beside), given
  with a 95 % interval. Those steps are light (``--interleaved-microbatches`` of
  ``--interleaved-seqs-per-microbatch`` sequences; one of one for the GPU presets): the
  publication moves as many bytes as after a full step with less of the step's own work to
  hide behind, and shorter steps, whose spread is the estimate's noise, let more periods fit
  the same time.

Bytes/s count the bytes moved (the model's parameters once); the ratio is NIXL bytes/s over peer
copy bytes/s. ``--device cpu`` runs the whole path on the CPU (DRAM slots and destination, host
copies as the baseline) as a smoke test.

    python -m benchmarks.refit_pull --out runs/refit_pull.json                       # 2 GPUs
    python -m benchmarks.refit_pull --preset tiny --device cpu --out /tmp/refit.json  # CPU smoke
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    REPO,
    child_env,
    run_meta,
    sidecar_server,
    tail,
    tokens_for,
    trainer_root,
    trainer_server,
)
from benchmarks.trainer_step import (
    PRESETS as STEP_PRESETS,
)
from benchmarks.trainer_step import (
    Driver,
    apply_preset,
    make_batches,
    run_steps,
    write_model,
)
from refit_sidecar.service.client import SidecarClient
from trainer_refit.auth import ClientAuth, Role, TokenDir
from trainer_svc.client import TrainerClient
from trainer_svc.domain import ExportDType, LossConfig

log = logging.getLogger("benchmarks.refit_pull")

_MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_positions")
_RUN = dict(
    seq_len=512,
    seqs_per_microbatch=4,
    microbatches=2,
    warmup=2,
    steps=8,
    pulls=10,
    interleaved_steps=2100,
    interleaved_microbatches=1,
    interleaved_seqs_per_microbatch=1,
)
PRESETS: dict[str, dict[str, Any]] = {
    "1b": {**{k: STEP_PRESETS["1b"][k] for k in _MODEL_KEYS}, **_RUN},
    "3b": {**{k: STEP_PRESETS["3b"][k] for k in _MODEL_KEYS}, **_RUN},
    "tiny": {
        **{k: STEP_PRESETS["tiny"][k] for k in _MODEL_KEYS},
        **dict(
            _RUN,
            seq_len=64,
            seqs_per_microbatch=2,
            warmup=1,
            steps=3,
            pulls=5,
            interleaved_steps=8,
            interleaved_seqs_per_microbatch=2,
        ),
    },
}


# -- the puller (a subprocess of this script) -----------------------------------------------------


def _synchronize(*devices: Any) -> None:
    import torch

    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _timed(run: Callable[[], Any], *devices: Any) -> float:
    _synchronize(*devices)
    start = time.perf_counter()
    run()
    _synchronize(*devices)
    return time.perf_counter() - start


def _check_against_export(
    pulled: dict[str, Any], model_dir: Path, export_dir: Path
) -> dict[str, Any]:
    """The pulled Megatron tensors, translated to HF, against ExportHF's safetensors."""
    import torch

    from megatron_hf.checkpoint import load_hf_state_dict
    from megatron_hf.convert import megatron_to_hf
    from megatron_hf.spec import ModelSpec

    spec = ModelSpec.from_pretrained_dir(model_dir)
    hf = megatron_to_hf({k: v.cpu() for k, v in pulled.items()}, spec)
    exported = load_hf_state_dict(export_dir)
    differing = sorted(
        name for name in exported if name not in hf or not torch.equal(hf[name], exported[name])
    )
    return dict(
        checked_tensors=len(exported),
        identical=not differing and hf.keys() == exported.keys(),
        differing=differing[:10],
    )


def puller_main(plan_path: Path, result_path: Path) -> None:
    plan = json.loads(plan_path.read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [puller] %(levelname)s %(message)s")
    # torch, NIXL and the data plane only here: the driving process stays light.
    import torch

    from refit_sidecar.core.manifest import MemType
    from refit_sidecar.core.plan import plan_pull, whole
    from refit_sidecar.memory.region import Region
    from refit_sidecar.memory.tensor_arena import TorchArena
    from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dest_device, source_device = torch.device(plan["dest"]), torch.device(plan["source"])
    if dest_device.type == "cuda":
        torch.cuda.set_device(dest_device)  # the puller's own GPU
    auth = ClientAuth(token_file=Path(plan["token_file"]))  # the receiver role's
    client = SidecarClient(plan["sidecar"], timeout=60, auth=auth)
    lease = client.acquire_lease(plan["version"], "refit-pull-benchmark", ttl=600)
    manifest = client.manifest(plan["version"])
    pull_plan = plan_pull(manifest, whole(manifest))
    targets = pull_plan.targets
    arena = TorchArena.allocate(pull_plan.nbytes, 256, device=dest_device)
    dest = Region(arena.address, arena.nbytes, arena.mem_type, arena.device_id, owner=arena)
    # The first pull checks the trainer's checksums where dest is (CRC-32 on the host, WSUM-64
    # on the GPU); the timed pulls check host CRCs only, as a GPU-side pull is compared with
    # a bare peer copy.
    verify = dest.mem_type is MemType.DRAM
    transport = NixlTransport.create(NixlConfig(name="refit-pull-benchmark", pull_timeout_s=600))
    try:
        register_s = _timed(lambda: transport.register(dest))
        start = time.perf_counter()
        first = transport.pull(pull_plan, dest, verify=True)
        first_s = time.perf_counter() - start
        log.info("first pull: %d bytes in %.4f s (%s)", first.nbytes, first_s, first)
        check = None
        if plan["export"]:
            pulled = {
                t.name: arena.tensor[t.span].view(dtypes[t.dtype.value]).reshape(t.box.shape)
                for t in targets
            }
            check = _check_against_export(pulled, Path(plan["model_dir"]), Path(plan["export"]))
            log.info("pulled weights against ExportHF: %s", check)

        sizes = [t.nbytes for t in targets]
        sources = [torch.ones(n, dtype=torch.uint8, device=source_device) for n in sizes]
        peer_dests = [arena.tensor[t.span] for t in targets]
        local_dests = [torch.empty_like(s) for s in sources]

        def copy(dests: list[Any]) -> None:
            for src, dst in zip(sources, dests, strict=True):
                dst.copy_(src, non_blocking=True)

        copy(peer_dests)  # untimed: the first peer copy enables peer access
        copy(local_dests)
        _synchronize(source_device, dest_device)
        times: dict[str, list[float]] = {"nixl": [], "peer_copy": [], "local_copy": []}
        stats = []
        for repeat in range(plan["pulls"]):
            order = ["nixl", "peer_copy", "local_copy"]
            for what in order if repeat % 2 == 0 else reversed(order):
                if what == "nixl":
                    start = time.perf_counter()
                    stats.append(transport.pull(pull_plan, dest, verify=verify))
                    times[what].append(time.perf_counter() - start)
                elif what == "peer_copy":
                    times[what].append(_timed(lambda: copy(peer_dests), source_device, dest_device))
                else:
                    times[what].append(_timed(lambda: copy(local_dests), source_device))
            log.info(
                "repeat %d: %s",
                repeat,
                ", ".join(f"{k} {1e3 * v[-1]:.2f} ms" for k, v in times.items()),
            )
        client.release_lease(lease)
    finally:
        transport.close()
        client.close()
    result = dict(
        version=plan["version"],
        num_tensors=len(targets),
        plan_bytes_read=pull_plan.bytes_read,
        copy_bytes=sum(sizes),
        dest=str(dest_device),
        dest_mem_type=dest.mem_type.value,
        source=str(source_device),
        source_mem_types=sorted(
            {s.location.mem_type.value for p in manifest.parameters for s in p.shards}
        ),
        register_s=register_s,
        first_pull_s=first_s,
        seconds=times,
        reads=stats[-1].reads,
        transfers=stats[-1].transfers,
        reposted=[s.reposted for s in stats],
        verified_shards=[s.verified_shards for s in stats],
        check_against_export=check,
        device_names=(
            {str(d): torch.cuda.get_device_name(d) for d in {dest_device, source_device}}
            if dest_device.type == "cuda"
            else {}
        ),
    )
    result_path.write_text(json.dumps(result, indent=1))


def run_puller(plan: dict[str, Any], run_dir: Path, log_path: Path) -> dict[str, Any]:
    plan_path, result_path = run_dir / "puller-plan.json", run_dir / "puller-result.json"
    result_path.unlink(missing_ok=True)
    plan_path.write_text(json.dumps(plan))
    command = [sys.executable, "-m", "benchmarks.refit_pull", "--puller-plan", str(plan_path)]
    with log_path.open("ab") as out:
        code = subprocess.run(
            [*command, "--puller-result", str(result_path)],
            cwd=REPO,
            env=child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=plan["timeout_s"],
            check=False,
        ).returncode
    if code != 0 or not result_path.exists():
        raise RuntimeError(f"the puller failed ({code}), {log_path}:\n{tail(log_path)}")
    return json.loads(result_path.read_text())


# -- the trainer runs -----------------------------------------------------------------------------


def _watch_readable(
    sidecar: str, auth: ClientAuth, readable_at: dict[int, float]
) -> Callable[[], None]:
    """Records when each version becomes readable (perf_counter, this process) from a
    WatchVersions stream on a thread; returns the function that stops it."""

    client = SidecarClient(sidecar, auth=auth)
    versions = client.watch(0)

    def watch() -> None:
        with contextlib.suppress(Exception):  # ends when the client closes
            for version in versions:
                readable_at.setdefault(version, time.perf_counter())

    thread = threading.Thread(target=watch, name="watch-versions", daemon=True)
    thread.start()

    def stop() -> None:
        client.close()
        thread.join(10)

    return stop


def train(
    target: str,
    batches: list[Any],
    args: argparse.Namespace,
    tokens: TokenDir,
    sidecar: str | None = None,
    *,
    steps: int | None = None,
    every: int = 1,
) -> dict[str, Any]:
    """Runs the steps (`steps` timed ones, default `--steps`); with `sidecar`, also when each
    version became readable, in ms after its FinishTrainStep returned (watched as a
    receiver), of a trainer that publishes versions that are multiples of `every`."""
    returned_at: dict[int, float] = {}
    readable_at: dict[int, float] = {}
    stop_watch = None
    if sidecar:
        stop_watch = _watch_readable(sidecar, tokens.client(Role.RECEIVER), readable_at)
    with TrainerClient(target, auth=tokens.client(Role.ORCHESTRATOR)) as client:
        status = client.status()
        loss = LossConfig()

        def finish(step_id: str) -> tuple[float, float, int]:
            # Answered once the update is applied: FinishTrainStep's time with and without
            # the sidecar then differs by what publication adds, and "readable after it
            # returns" is counted from the new weights' existence.
            result = client.finish_step(step_id, wait_for_update=True)
            returned_at[result.weights_version] = time.perf_counter()
            m = result.metrics
            return m.loss, m.grad_norm, m.counts.valid_tokens

        driver = Driver(
            begin=lambda step_id: client.begin_step(step_id, loss),
            microbatch=client.train_microbatch,
            finish=finish,
        )
        records = run_steps(driver, batches, args.warmup, args.steps if steps is None else steps)
        end = client.status()
    if stop_watch is not None:
        last = end.weights_version - end.weights_version % every  # the last one published
        deadline = time.monotonic() + 30
        while last and last not in readable_at and time.monotonic() < deadline:
            time.sleep(0.01)  # until the watcher has stamped the last version
        stop_watch()
    readable_ms = {
        v: 1e3 * (readable_at[v] - t) for v, t in returned_at.items() if v in readable_at
    }
    return dict(
        records=records,
        readable_after_finish_ms=[readable_ms.get(v) for v in sorted(returned_at)],
        num_parameters=status.model.num_parameters,
        device=status.device,
        refit_snapshot_bytes=status.refit_snapshot_bytes,
        weights_version=end.weights_version,
    )


def _holdup_s(records: list[dict[str, Any]]) -> list[float]:
    """FinishTrainStep plus the next BeginTrainStep of each timed step: what a step's end
    holds the next one up."""
    return [
        done["finish_s"] + after["begin_s"]
        for done, after in itertools.pairwise(records)
        if not done["warmup"]
    ]


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def _spread_ms(values: list[float]) -> dict[str, float]:
    """Differences (seconds): their median, mean and the mean's standard error, in ms."""
    error = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return dict(
        median=_median_ms(values),
        mean=1e3 * statistics.fmean(values),
        standard_error=1e3 * error,
    )


def median_interval(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of `values` (95 % for z =
    1.96): the order statistics n/2 -+ z sqrt(n)/2 (the sign test's normal approximation),
    clamped to the sample."""
    ranked = sorted(values)
    n = len(ranked)
    half = z * n**0.5 / 2
    low = max(0, math.floor(n / 2 - half))
    high = min(n - 1, math.ceil(n / 2 + half) - 1)
    return ranked[low], ranked[high]


EVERY = 3
"""The interleaved run's trainer publishes versions that are multiples of this: each
publishing step, the step after it and a step untouched by publication, in turn."""


def interleaved(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of a trainer publishing every `EVERY`-th version (step i makes version i + 1):
    each publishing step k and the step after it (which the publication's copy, checksums and
    report may slow down, on the GPU or the host) against the two steps around them that
    neither publish nor follow a publication, k - 1 and k + 2:
    D_k = t(k) + t(k + 1) - t(k - 1) - t(k + 2), t a step's time from BeginTrainStep until
    FinishTrainStep returned. Without a hold-up the four steps are exchangeable and D_k is
    symmetric about 0, a drift of the step's time cancels, and a hold-up of h shifts it by h:
    the hold-up is D's median, with its distribution-free 95 % interval (a step's time has a
    long tail, which the median resists and a mean does not), besides the mean and its
    standard error. Also steps k and k + 1 each against the clean neighbours, and D split
    into the steps' work before FinishTrainStep (the host's: its spread is small, so what the
    report's work takes from the next step's launches shows there) and FinishTrainStep. In
    ms."""
    seconds = [r["seconds"] for r in records]
    finish = [r["finish_s"] for r in records]
    held: list[float] = []
    parts: dict[str, list[float]] = {"before_finish": [], "finish": []}
    on_publishing: list[float] = []
    on_after: list[float] = []
    for k in range(1, len(records) - 2):
        if records[k - 1]["warmup"] or (k + 1) % EVERY:
            continue  # a warm-up step beside it, or a step that did not publish
        before, after = seconds[k - 1], seconds[k + 2]
        held.append(seconds[k] + seconds[k + 1] - before - after)
        # D split between the steps' work before FinishTrainStep and FinishTrainStep itself.
        on_finish = finish[k] + finish[k + 1] - finish[k - 1] - finish[k + 2]
        parts["finish"].append(on_finish)
        parts["before_finish"].append(held[-1] - on_finish)
        # Each against the neighbours weighted to its own place (a drift cancels); the two
        # add up to the difference above.
        on_publishing.append(seconds[k] - (2 * before + after) / 3)
        on_after.append(seconds[k + 1] - (before + 2 * after) / 3)
    timed = [(k, r) for k, r in enumerate(records) if not r["warmup"]]

    def median_of(role: int) -> float:  # role: (k + 1) % EVERY of the steps counted
        return _median_ms([r["seconds"] for k, r in timed if (k + 1) % EVERY == role])

    spread = _spread_ms(held)
    low, high = median_interval(held)
    return dict(
        every=EVERY,
        steps=len(timed),
        periods=len(held),
        step_median_ms=dict(publishing=median_of(0), after=median_of(1), clean=median_of(2)),
        publishing_ms=_spread_ms(on_publishing),
        after_ms=_spread_ms(on_after),
        before_finish_ms=_spread_ms(parts["before_finish"]),
        finish_ms=_spread_ms(parts["finish"]),
        holdup_ms=spread["median"],
        holdup_interval_ms=[1e3 * low, 1e3 * high],
        holdup_mean_ms=spread["mean"],
        holdup_standard_error_ms=spread["standard_error"],
    )


def summarize(pull: dict[str, Any], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    nbytes = pull["copy_bytes"]
    seconds = {k: statistics.median(v) for k, v in pull["seconds"].items()}
    rates = {k: nbytes / v for k, v in seconds.items()}
    pair = {mode: runs[mode] for mode in ("publish", "plain")}
    finish = {
        mode: _median_ms([r["finish_s"] for r in run["records"] if not r["warmup"]])
        for mode, run in pair.items()
    }
    holdup = {mode: _median_ms(_holdup_s(run["records"])) for mode, run in pair.items()}
    third = runs.get("interleaved")
    timed = [r["warmup"] for r in runs["publish"]["records"]]
    readable = [
        ms
        for ms, warmup in zip(runs["publish"]["readable_after_finish_ms"], timed, strict=False)
        if ms is not None and not warmup
    ]
    losses = [[r["loss"] for r in runs[mode]["records"]] for mode in ("publish", "plain")]
    return dict(
        bytes=nbytes,
        median_ms={k: 1e3 * v for k, v in seconds.items()},
        gb_per_s={k: v / 1e9 for k, v in rates.items()},
        nixl_over_peer_copy=rates["nixl"] / rates["peer_copy"],
        first_pull_ms=1e3 * pull["first_pull_s"],
        finish_median_ms=finish,
        publication_ms=finish["publish"] - finish["plain"],
        holdup_median_ms=holdup,
        publication_holdup_ms=holdup["publish"] - holdup["plain"],
        readable_after_finish_ms=statistics.median(readable) if readable else None,
        local_copy_ms=1e3 * seconds["local_copy"],
        max_loss_difference=max(abs(a - b) for a, b in zip(*losses, strict=True)),
        pulled_equals_export=(pull["check_against_export"] or {}).get("identical"),
        interleaved=interleaved(third["records"]) if third else None,
    )


def print_summary(summary: dict[str, Any]) -> None:
    print(f"\nbytes moved per copy: {summary['bytes']:,}")
    print(f"{'path':<12} {'median ms':>10} {'GB/s':>8}")
    for name in ("nixl", "peer_copy", "local_copy"):
        ms, rate = summary["median_ms"][name], summary["gb_per_s"][name]
        print(f"{name:<12} {ms:>10.3f} {rate:>8.1f}")
    print(f"NIXL / peer copy (bytes/s): {summary['nixl_over_peer_copy']:.3f}")
    print(f"first NIXL pull (connect, prepare): {summary['first_pull_ms']:.1f} ms")
    f = summary["finish_median_ms"]
    print(
        f"FinishTrainStep median: {f['publish']:.2f} ms publishing, {f['plain']:.2f} ms without "
        f"({summary['publication_ms']:+.2f} ms; device-local copy {summary['local_copy_ms']:.2f} "
        "ms)"
    )
    h = summary["holdup_median_ms"]
    print(
        f"FinishTrainStep + next BeginTrainStep median: {h['publish']:.2f} ms publishing, "
        f"{h['plain']:.2f} ms without ({summary['publication_holdup_ms']:+.2f} ms)"
    )
    a = summary["interleaved"]
    if a is not None:
        m = a["step_median_ms"]
        low, high = a["holdup_interval_ms"]
        print(
            f"one trainer publishing the multiples of {a['every']} ({a['steps']} steps): step "
            f"median {m['publishing']:.2f} ms publishing, {m['after']:.2f} ms after it, "
            f"{m['clean']:.2f} ms neither; against the clean steps around them, the publishing "
            f"step {a['publishing_ms']['median']:+.2f} ms, the step after it "
            f"{a['after_ms']['median']:+.2f} ms (medians); of the hold-up, before the "
            f"FinishTrainStep calls {a['before_finish_ms']['mean']:+.2f} ± "
            f"{a['before_finish_ms']['standard_error']:.2f} ms, in them "
            f"{a['finish_ms']['mean']:+.2f} ± {a['finish_ms']['standard_error']:.2f} ms (means)"
        )
        print(
            f"publication's hold-up of the loop, over {a['periods']} periods: "
            f"{a['holdup_ms']:+.2f} ms (median; 95 % interval {low:+.2f} to {high:+.2f} ms), "
            f"{a['holdup_mean_ms']:+.2f} ± {a['holdup_standard_error_ms']:.2f} ms (mean, "
            f"standard error); device-local copy {summary['local_copy_ms']:.2f} ms"
        )
    if summary["readable_after_finish_ms"] is not None:
        print(
            "version readable after FinishTrainStep returned: median "
            f"{summary['readable_after_finish_ms']:.2f} ms"
        )
    print(
        f"pulled weights equal ExportHF: {summary['pulled_equals_export']}; "
        f"max |loss difference| between the runs: {summary['max_loss_difference']:.3g}"
    )


# -- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.refit_pull",
        description=(
            "NIXL pull bytes/s of a trainer's published weights (trainer on GPU 0, puller on "
            "another GPU) against a torch peer copy of the same bytes, and FinishTrainStep with "
            "and without publication."
        ),
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    shape = p.add_argument_group("model (Llama family, config-only: megatron initialises it)")
    for key in _MODEL_KEYS:
        shape.add_argument(f"--{key.replace('_', '-')}", type=int)
    run = p.add_argument_group("run")
    run.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available"
    )
    run.add_argument(
        "--dest-gpu", type=int, default=1, help="the puller's GPU (the trainer's rank uses GPU 0)"
    )
    run.add_argument(
        "--params-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    run.add_argument("--seq-len", type=int)
    run.add_argument("--seqs-per-microbatch", type=int)
    run.add_argument("--microbatches", type=int)
    run.add_argument("--warmup", type=int, help="untimed steps first")
    run.add_argument("--steps", type=int, help="timed steps per trainer run")
    run.add_argument("--pulls", type=int, help="timed pulls (and copies of each kind)")
    run.add_argument(
        "--interleaved-steps",
        type=int,
        help="timed steps of the trainer publishing every third version (0: no such run)",
    )
    run.add_argument("--interleaved-microbatches", type=int, help="microbatches of those steps")
    run.add_argument(
        "--interleaved-seqs-per-microbatch",
        type=int,
        help="sequences (of --seq-len tokens) per microbatch of those steps",
    )
    run.add_argument("--slots", type=int, default=2, help="--refit-slots of the trainer")
    run.add_argument("--no-verify", action="store_true", help="skip the check against ExportHF")
    run.add_argument("--lr", type=float, default=1e-5)
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument("--timeout", type=float, default=900.0, help="seconds for a process's start")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("runs/refit_pull.json"))
    out.add_argument("--log-dir", type=Path, default=None, help="default: beside --out")
    out.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="the run's files: model, tokens, the trainer's work dir (default: a temporary one)",
    )
    out.add_argument(
        "--trainer-log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    p.add_argument("--puller-plan", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--puller-result", type=Path, help=argparse.SUPPRESS)
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    apply_preset(args, PRESETS)
    if args.seq_len > args.max_positions:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds --max-positions {args.max_positions}")
    if min(args.steps, args.pulls) < 1:
        raise SystemExit("--steps and --pulls must be >= 1")
    if args.interleaved_steps < 0 or 0 < args.interleaved_steps < 8:
        raise SystemExit("--interleaved-steps must be 0 or >= 8")
    if min(args.interleaved_microbatches, args.interleaved_seqs_per_microbatch) < 1:
        raise SystemExit(
            "--interleaved-microbatches and --interleaved-seqs-per-microbatch must be >= 1"
        )
    args.hf_weights = False  # write_model: a config-only directory
    return args


def _meta(
    args: argparse.Namespace, argv: list[str] | None, publish: dict[str, Any]
) -> dict[str, Any]:
    """What the results file says about the run: its command, model, batch and versions."""
    return dict(
        run_meta("benchmarks.refit_pull", argv),
        preset=args.preset,
        model={k: getattr(args, k) for k in _MODEL_KEYS},
        params_dtype=args.params_dtype,
        num_parameters=publish["num_parameters"],
        device=publish["device"],
        refit_snapshot_bytes=publish["refit_snapshot_bytes"],
        slots=args.slots,
        batch=dict(
            seq_len=args.seq_len,
            seqs_per_microbatch=args.seqs_per_microbatch,
            microbatches=args.microbatches,
        ),
        warmup=args.warmup,
        steps=args.steps,
        interleaved_steps=args.interleaved_steps,
        interleaved_batch=dict(
            seq_len=args.seq_len,
            seqs_per_microbatch=args.interleaved_seqs_per_microbatch,
            microbatches=args.interleaved_microbatches,
        ),
        pulls=args.pulls,
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.puller_plan is not None:
        puller_main(args.puller_plan, args.puller_result)
        return
    args = resolve(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [bench] %(levelname)s %(message)s")
    log_dir = args.log_dir or args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory(prefix="refit-pull-bench-") as scratch:
        work = (args.work_dir or Path(scratch)).absolute()
        work.mkdir(parents=True, exist_ok=True)
        model_dir = write_model(work / "model", args)
        tokens = tokens_for(work)
        orchestrator = tokens.client(Role.ORCHESTRATOR)
        root = trainer_root(work)  # the trainer's path root: the export below goes there
        trainer_args = [
            *("--model", str(model_dir), "--tp", "1", "--device", args.device),
            *("--params-dtype", args.params_dtype, "--lr", str(args.lr), "--seed", str(args.seed)),
            *("--max-seq-len", str(args.seq_len), "--log-level", args.trainer_log_level),
            *("--work-dir", str(root), *tokens.server_args()),
        ]
        batches = make_batches(dict(vars(args)))
        runs: dict[str, dict[str, Any]] = {}
        with sidecar_server(work, log_dir / "sidecar.log", args.timeout, tokens) as sidecar:
            publishing = [
                *trainer_args,
                *tokens.publisher_args(sidecar),
                *("--refit-slots", str(args.slots)),
            ]
            plan = dict(trainer_args=publishing, timeout_s=args.timeout)
            log.info("trainer args: %s", " ".join(publishing))
            trainer_log = log_dir / "trainer-publish.log"
            with trainer_server(plan, work, trainer_log, auth=orchestrator) as (target, _):
                runs["publish"] = train(target, batches, args, tokens, sidecar)
                export = None
                if not args.no_verify:
                    export = root / "export"
                    shutil.rmtree(export, ignore_errors=True)  # an earlier run's, same work dir
                    with TrainerClient(target, auth=orchestrator) as client:
                        client.export_hf(export, dtype=ExportDType.PARAMS)
                puller_plan = dict(
                    sidecar=sidecar,
                    token_file=str(tokens.file(Role.RECEIVER)),
                    version=runs["publish"]["weights_version"],
                    dest=f"cuda:{args.dest_gpu}" if cuda else "cpu",
                    source="cuda:0" if cuda else "cpu",
                    pulls=args.pulls,
                    export=str(export) if export else None,
                    model_dir=str(model_dir),
                    timeout_s=args.timeout + 600,
                )
                pull = run_puller(puller_plan, work, log_dir / "puller.log")
        plan = dict(trainer_args=trainer_args, timeout_s=args.timeout)
        trainer_log = log_dir / "trainer-plain.log"
        with trainer_server(plan, work, trainer_log, auth=orchestrator) as (target, _):
            runs["plain"] = train(target, batches, args, tokens)
        if args.interleaved_steps:
            sidecar_log = log_dir / "sidecar-interleaved.log"
            with sidecar_server(work, sidecar_log, args.timeout, tokens) as sidecar:
                every_third = [
                    *trainer_args,
                    *tokens.publisher_args(sidecar),
                    *("--refit-slots", str(args.slots), "--refit-publish-every", str(EVERY)),
                ]
                plan = dict(trainer_args=every_third, timeout_s=args.timeout)
                trainer_log = log_dir / "trainer-interleaved.log"
                with trainer_server(plan, work, trainer_log, auth=orchestrator) as (target, _):
                    light = make_batches(
                        dict(
                            vars(args),
                            microbatches=args.interleaved_microbatches,
                            seqs_per_microbatch=args.interleaved_seqs_per_microbatch,
                        )
                    )
                    runs["interleaved"] = train(
                        target,
                        light,
                        args,
                        tokens,
                        sidecar,
                        steps=args.interleaved_steps,
                        every=EVERY,
                    )
    summary = summarize(pull, runs)
    meta = _meta(args, argv, runs["publish"])
    args.out.write_text(
        json.dumps(dict(meta=meta, summary=summary, pull=pull, runs=runs), indent=1) + "\n"
    )
    print_summary(summary)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
