"""Tokens/s of the trainer's split training step over gRPC against the same steps in-process.

Both modes run the same steps on the same model and data: one TP=1 rank, the same seed (so the
same initial weights), cross-entropy on fixed synthetic token sequences, k microbatches a step.

* ``grpc``: ``python -m trainer_svc --model DIR --tp 1 --port 0 --port-file F ...`` runs as a
  subprocess (the real CLI path: launcher, one rank, gRPC server, command thread); this process
  drives BeginTrainStep -> TrainMicrobatch x k -> FinishTrainStep through ``TrainerClient``.
* ``inprocess``: a subprocess of this script sets RANK=0 WORLD_SIZE=1 MASTER_ADDR/PORT, joins the
  process group and builds the engine with trainer_svc.runtime.rank's own functions
  (``_device``, ``_join_world``, ``_init_model_parallel``, ``build_engine``; a one-rank world
  has no peers, so no liveness links), then calls ``engine.precheck`` and ``engine.execute``
  with the commands the servicer would build. No gRPC, no server, no protobuf conversion and no
  command broadcast.
* ``leader`` (optional): like inprocess, but each command goes through rank 0's own command path,
  ``trainer_svc.runtime.control.Leader.submit`` (asyncio lock, hop to the command thread,
  precheck, broadcast over the control group, execute), so the gap between grpc and inprocess
  splits into the server's command plumbing and gRPC itself.
* ``grpc-pipelined`` (optional): like grpc, but a step's TrainMicrobatch calls are all sent at
  once from the asyncio client; the service still runs them one at a time.

A step is timed from just before BeginTrainStep is sent until FinishTrainStep has returned, the
same way in every mode and with no extra synchronisation. Neither a microbatch nor
FinishTrainStep waits for the GPU to finish (FinishTrainStep returns once the loss sums and the
gradient norm are on the host, with the update queued), so a step's GPU work runs on while the
next one is sent; the GPU waits only where the host cannot keep it fed, and steady-state step
times compare across modes.
Warm-up steps run first and are not counted. The modes alternate over ``--repeats`` (the --modes
order in even repeats, reversed in odd ones), each run in a fresh process, so drift of the
machine falls on all of them.

Tokens/s counts every token sent (the sum of the step's sequence lengths); the trained
(predicted) tokens are one fewer per sequence and are reported too. ``--length-mix MIN:MAX``
draws the lengths uniformly, as RL rollouts come, and ``--sequence-layouts packed,padded`` runs
every mode with the trainer's sequences packed into one row and right-padded, giving the
tokens/s ratio of the two on the same steps (padding is computed but never counted);
``--packed-attentions cudnn,flash`` runs each layout that may pack once per packed-row kernel
(the trainer's ``--packed-attention``), padded once.

The services run as deployed, with authentication on (`tokens_for`: a fresh bearer token per role
under the run's work dir, as ``examples.local_stack`` does); the trainer's path root is
its own directory beside them (`trainer_root`).

    python -m benchmarks.trainer_step --preset 1b --out results.json          # GPU, ~1B model
    python -m benchmarks.trainer_step --preset tiny --device cpu --out /tmp/r.json   # CPU smoke
    python -m benchmarks.trainer_step --preset 1b --modes inprocess \
        --sequence-layouts packed,padded --length-mix 64:4096 --out packing.json
    python -m benchmarks.trainer_step --preset 1b --modes inprocess --sequence-layouts \
        packed,padded --packed-attentions cudnn,flash --length-mix 64:4096 --out kernels.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    REPO,
    child_env,
    run_meta,
    tail,
    tokens_for,
    trainer_root,
    trainer_server,
    versions,
)
from megatron_hf.spec import ModelSpec
from trainer_refit.auth import ClientAuth, Role
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import trainer_pb2 as pb
from trainer_svc.cli import parse_config
from trainer_svc.client import AsyncTrainerClient, TrainerClient, microbatch_request
from trainer_svc.domain import ExportDType, LossConfig, OptimizerOverrides, SequenceBatch
from trainer_svc.runtime import commands as cmd
from trainer_svc.server import convert

MODES = ("grpc", "inprocess", "leader", "grpc-pipelined")
DEFAULT_MODES = "grpc,inprocess"

# Llama-family shapes. "1b": hidden 2048 / 18 layers / 16 heads of 128 / 8 KV heads / SwiGLU
# 5632 / vocab 32000 (untied) = 980.5M parameters.
PRESETS: dict[str, dict[str, Any]] = {
    "1b": dict(
        layers=18,
        hidden=2048,
        heads=16,
        kv_heads=8,
        ffn=5632,
        vocab=32000,
        max_positions=4096,
        seq_len=1024,
        seqs_per_microbatch=8,
        microbatches=4,
        warmup=2,
        steps=5,
        repeats=2,
    ),
    # About 3.0B parameters (Llama-3.2-3B's shape with a 32k vocabulary): the refit benchmarks'
    # larger model.
    "3b": dict(
        layers=28,
        hidden=3072,
        heads=24,
        kv_heads=8,
        ffn=8192,
        vocab=32000,
        max_positions=4096,
        seq_len=1024,
        seqs_per_microbatch=4,
        microbatches=2,
        warmup=2,
        steps=5,
        repeats=2,
    ),
    "tiny": dict(
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn=128,
        vocab=128,
        max_positions=256,
        seq_len=64,
        seqs_per_microbatch=2,
        microbatches=2,
        warmup=1,
        steps=3,
        repeats=2,
    ),
}

log = logging.getLogger("benchmarks.trainer_step")


# -- the model and the data ----------------------------------------------------------------------


def write_model(path: Path, args: argparse.Namespace) -> Path:
    """A config-only Llama directory (megatron initialises it randomly), or with --hf-weights a
    random float32 HF checkpoint from megatron_hf.tiny (its tokenizer fixes the vocab at 101)."""
    path.mkdir(parents=True, exist_ok=True)
    if args.hf_weights:
        from megatron_hf.tiny import write_tiny_checkpoint  # torch, transformers: only here

        return write_tiny_checkpoint(
            path,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            intermediate_size=args.ffn,
            max_position_embeddings=args.max_positions,
            seed=args.seed,
        )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.max_positions,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": args.params_dtype,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def write_config_model(path: Path, spec: ModelSpec, params_dtype: str) -> Path:
    """A config-only directory of `spec` (megatron initialises it randomly): a model family
    `write_model`'s Llama does not cover, such as a mixture of experts."""
    path.mkdir(parents=True, exist_ok=True)
    config = {**spec.to_hf_config(), "bos_token_id": 1, "eos_token_id": 2, "dtype": params_dtype}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def make_batches(plan: dict[str, Any]) -> list[Any]:
    """k microbatches of `seqs` random sequences of `seq_len` tokens, or with a length mix
    (MIN, MAX) of lengths drawn uniformly from MIN..MAX, as RL rollouts come; every token but
    each sequence's first is trained on. Deterministic in plan["seed"]."""
    rng = np.random.default_rng(plan["seed"])
    n = plan["seqs_per_microbatch"]
    mix = plan.get("length_mix")
    batches = []
    for _ in range(plan["microbatches"]):
        if mix:
            lengths = rng.integers(mix[0], mix[1] + 1, size=n, dtype=np.int64)
        else:
            lengths = np.full(n, plan["seq_len"], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = rng.integers(0, plan["vocab"], size=int(offsets[-1]), dtype=np.int64)
        mask = np.ones(len(tokens), dtype=bool)
        mask[offsets[:-1]] = False
        batches.append(SequenceBatch(tokens=tokens, offsets=offsets, loss_mask=mask))
    return batches


def step_tokens(plan: dict[str, Any]) -> tuple[int, int]:
    """Tokens sent per step, and the trained (predicted) ones: one fewer per sequence."""
    batches = make_batches(plan)
    sent = sum(b.num_tokens for b in batches)
    return sent, sent - sum(b.num_sequences for b in batches)


def data_checksum(batches: list[Any]) -> int:
    return int(sum(int(b.tokens.astype(np.int64).sum()) * (i + 1) for i, b in enumerate(batches)))


# -- the step loop, shared by both modes ------------------------------------------------------


@dataclass
class Driver:
    begin: Callable[[str], Any]
    microbatch: Callable[[str, str, Any], Any]
    finish: Callable[[str], tuple[float, float, int]]
    all_microbatches: Callable[[str, list[Any]], Any] | None = None
    """Sends a step's microbatches at once (grpc-pipelined); None sends them one by one."""


def run_steps(driver: Driver, batches: list[Any], warmup: int, steps: int) -> list[dict[str, Any]]:
    records = []
    for index in range(warmup + steps):
        step_id = f"step-{index}"
        start = time.perf_counter()
        driver.begin(step_id)
        begun = time.perf_counter()
        microbatch_s = []
        last = begun
        if driver.all_microbatches is not None:
            driver.all_microbatches(step_id, batches)
            last = time.perf_counter()
            microbatch_s = [(last - begun) / len(batches)] * len(batches)
        else:
            for j, batch in enumerate(batches):
                driver.microbatch(step_id, f"{step_id}-mb{j}", batch)
                now = time.perf_counter()
                microbatch_s.append(now - last)
                last = now
        loss, grad_norm, valid_tokens = driver.finish(step_id)
        end = time.perf_counter()
        records.append(
            dict(
                step=index,
                warmup=index < warmup,
                seconds=end - start,
                begin_s=begun - start,
                microbatch_s=microbatch_s,
                finish_s=end - last,
                loss=loss,
                grad_norm=grad_norm,
                valid_tokens=valid_tokens,
            )
        )
        log.info(
            "step %d%s: %.4f s, loss %.6f, grad norm %.4f",
            index,
            " (warm-up)" if index < warmup else "",
            end - start,
            loss,
            grad_norm,
        )
    return records


# -- modes "inprocess" and "leader" (run in a worker subprocess) -----------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker_inprocess(plan_path: Path, result_path: Path) -> None:
    plan = json.loads(plan_path.read_text())
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    # torch and megatron only here: the driving process stays light (it is the gRPC client).
    import torch
    import torch.distributed as dist

    from trainer_svc.runtime.rank import (
        RankIdentity,
        _device,
        _init_model_parallel,
        _join_world,
        build_engine,
    )

    config, level = parse_config(plan["trainer_args"])
    logging.basicConfig(level=level, format="%(asctime)s [inprocess] %(levelname)s %(message)s")
    identity = RankIdentity.from_env()
    assert identity is not None
    device = _device(config, identity)
    _join_world(config, identity, device)
    _init_model_parallel(config, device)
    engine, info = build_engine(config, Path(plan["model_dir"]), device)
    # Like grpc's "process start to SERVING": from this process's launch to a built engine.
    startup_s = time.time() - plan["launched_at"]
    log.info(
        "ready %.1f s after launch: %d parameters on %s", startup_s, info.num_parameters, device
    )

    if plan["mode"] == "leader":
        # Rank 0's own command path without gRPC: the asyncio lock, the hop to the command
        # thread, precheck, the broadcast over the control group, execute.
        from trainer_svc.runtime.control import Leader

        leader = Leader(engine)
        loop = asyncio.new_event_loop()

        def run(command: Any) -> Any:
            return loop.run_until_complete(leader.submit(command))
    else:

        def run(command: Any) -> Any:
            immediate = engine.precheck(command)
            return immediate if immediate is not None else engine.execute(command)

    def finish(step_id: str) -> tuple[float, float, int]:
        result = run(cmd.FinishStep(step_id=step_id))
        m = result.metrics
        return m.loss, m.grad_norm, m.counts.valid_tokens

    loss = LossConfig()  # what the servicer builds from a cross-entropy LossConfig message
    driver = Driver(
        begin=lambda step_id: run(
            cmd.BeginStep(step_id=step_id, loss=loss, optimizer=OptimizerOverrides())
        ),
        microbatch=lambda step_id, request_id, batch: run(
            cmd.TrainMicrobatch(step_id=step_id, request_id=request_id, batch=batch)
        ),
        finish=finish,
    )
    batches = make_batches(plan)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    records = run_steps(driver, batches, plan["warmup"], plan["steps"])
    extra: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        extra["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        extra["device_name"] = torch.cuda.get_device_name()
    if plan.get("weights_digest"):
        assert config.work_dir is not None  # the trainer's path root (main sets it)
        exported = config.work_dir / "exports" / f"{plan['mode']}-{os.getpid()}"
        run(cmd.ExportHF(path=exported, dtype=ExportDType.PARAMS))
        extra["weights_sha256"] = weights_digest(exported)
    if plan.get("profile_finish") and plan["mode"] == "inprocess":
        extra["finish_profile"] = profile_finish(
            run,
            driver,
            batches,
            plan["profile_finish"],
            adam_update_bytes(info.num_parameters, info.params_dtype.value),
        )
    if plan.get("forward_memory") and plan["mode"] == "inprocess":
        extra["forward_memory"] = forward_memory(run, batches[0], device)
    if device.type == "cuda" and plan["mode"] == "inprocess":
        extra["matmul_tflops"] = matmul_peak_tflops(device)
    result_path.write_text(
        json.dumps(
            dict(
                mode=plan["mode"],
                startup_s=startup_s,
                num_parameters=info.num_parameters,
                params_dtype=info.params_dtype.value,
                device=device.type,
                data_checksum=data_checksum(batches),
                records=records,
                versions=versions(),
                **extra,
            ),
            indent=1,
        )
    )
    if plan["mode"] == "leader":
        loop.run_until_complete(leader.shutdown())
        loop.close()
    dist.destroy_process_group()


def profile_finish(
    run: Callable[[Any], Any],
    driver: Driver,
    batches: list[Any],
    steps: int,
    update_bytes: int,
) -> dict[str, Any]:
    """Where a FinishTrainStep's time goes: `steps` more steps whose finish waits for the
    update (as a light RL step's would), timed alone (the microbatches' work drained first),
    then as many again under torch's profiler (kernels, host operators) and cProfile (the
    Python functions of the microbatches and of the finish, host synchronizations included).
    The update's device time is set beside its bandwidth-bound floor: `update_bytes` at the
    device's measured copy bandwidth."""
    import cProfile
    import io
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()

    microbatches, finishes = cProfile.Profile(), cProfile.Profile()

    def step(step_id: str, profiled: bool = False) -> float:
        driver.begin(step_id)
        for j, batch in enumerate(batches):
            if profiled:
                microbatches.enable()
            driver.microbatch(step_id, f"{step_id}-mb{j}", batch)
            if profiled:
                microbatches.disable()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if profiled:
            finishes.enable()
        run(cmd.FinishStep(step_id=step_id, wait_for_update=True))
        if profiled:
            finishes.disable()
        return (time.perf_counter() - start) * 1e3

    finish_ms = [step(f"timed-{index}") for index in range(steps)]
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as kernels:
        for index in range(steps):
            step(f"profiled-{index}", profiled=True)
    stream = io.StringIO()
    for title, python in (("TrainMicrobatch", microbatches), ("FinishTrainStep", finishes)):
        stream.write(f"-- {title}, Python functions --\n")
        pstats.Stats(python, stream=stream).sort_stats("cumulative").print_stats(45)
    averages = kernels.key_averages()
    update = [e for e in averages if e.key.startswith("Optimizer.step#")]
    update_device_ms = (
        sum(e.device_time_total for e in update) / 1e3 / steps if cuda and update else None
    )
    bandwidth = copy_bandwidth() if cuda else None
    found = dict(
        finish_ms=finish_ms,
        update_device_ms=update_device_ms,
        update_bytes=update_bytes,
        copy_bandwidth_gbs=bandwidth,
        update_floor_ms=update_bytes / bandwidth / 1e6 if bandwidth else None,
        device_ops=averages.table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30
        ),
        host_ops=averages.table(sort_by="cpu_time_total", row_limit=30),
        python=stream.getvalue(),
    )
    log.info(
        "FinishTrainStep (wait_for_update) alone: %s ms; the update on the device %s ms "
        "against a floor of %s ms",
        [f"{t:.1f}" for t in finish_ms],
        found["update_device_ms"],
        found["update_floor_ms"],
    )
    return found


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """The device's copy bandwidth in GB/s, counting the bytes read and written."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9


def adam_update_bytes(num_parameters: int, params_dtype: str) -> int:
    """The bytes one Adam(W) update must move at least: the fp32 main weight, both moments
    (read and written) and the fp32 gradient (read), plus the bf16 model weight written from
    the main weight under mixed precision."""
    per_parameter = 4 * 2 + 4 * 2 + 4 * 2 + 4
    if params_dtype == "bfloat16":
        per_parameter += 2
    return num_parameters * per_parameter


def matmul_peak_tflops(device: Any, n: int = 8192, repeats: int = 20) -> float:
    """bf16 TFLOP/s of an n x n x n matrix product on `device`: the peak MFU is measured
    against, in the same process as the steps."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def same_top_k_up_to_ties(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], tol: float = 1e-5
) -> bool:
    """Whether two top-k answers ((ids, log-probabilities), best first) are equally right: the
    same log-probabilities, and ids that differ only where a value is tied (bfloat16 logits
    tie often, and each path may order tied ids, or pick among those tied at the k-th place,
    its own way)."""
    (a_ids, a_values), (b_ids, b_values) = a, b
    if not np.allclose(a_values, b_values, rtol=0.0, atol=tol):
        return False
    tied = (np.abs(a_values[..., :, None] - a_values[..., None, :]) <= tol).sum(-1) > 1
    at_the_boundary = np.abs(a_values - a_values[..., -1:]) <= tol
    return bool(np.all((a_ids == b_ids) | tied | at_the_boundary))


def forward_memory(run: Callable[[Any], Any], batch: Any, device: Any) -> dict[str, Any]:
    """A Forward of `batch` asking for log-probabilities, entropy and the top 20, through the
    chunked vocab-parallel path and through the unfused one it replaced (swapped into the
    engine for the measurement): each one's peak memory above what was allocated before it,
    its time, and how far the two agree."""
    import torch

    from trainer_svc.domain import ForwardOutput
    from trainer_svc.runtime import engine as engine_module
    from trainer_svc.runtime import vocab_parallel as vp

    paths = {
        "unfused": (vp.target_logprobs_unfused, vp.top_k_unfused),
        "chunked": (vp.target_logprobs, vp.top_k),
    }
    saved = engine_module.target_logprobs, engine_module.top_k
    outputs = frozenset(ForwardOutput)
    measured: dict[str, Any] = {}
    results = {}
    try:
        for name, (logprobs_fn, top_k_fn) in paths.items():
            engine_module.target_logprobs = logprobs_fn  # type: ignore[assignment]
            engine_module.top_k = top_k_fn  # type: ignore[assignment]
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            result = run(cmd.RunForward(batch=batch, outputs=outputs, top_k=20))
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            results[name] = result
            measured[name] = dict(
                seconds=seconds,
                peak_above_base_gib=(torch.cuda.max_memory_allocated() - base) / 2**30
                if cuda
                else None,
            )
    finally:
        engine_module.target_logprobs, engine_module.top_k = saved
    a, b = results["chunked"], results["unfused"]
    measured["max_logprob_difference"] = float(np.abs(a.logprobs - b.logprobs).max())
    measured["max_entropy_difference"] = float(np.abs(a.entropy - b.entropy).max())
    measured["max_top_k_logprob_difference"] = float(
        np.abs(a.top_k_logprobs - b.top_k_logprobs).max()
    )
    measured["same_top_k_ids"] = bool(np.array_equal(a.top_k_token_ids, b.top_k_token_ids))
    measured["same_top_k_up_to_ties"] = same_top_k_up_to_ties(
        (a.top_k_token_ids, a.top_k_logprobs), (b.top_k_token_ids, b.top_k_logprobs)
    )
    if measured["unfused"]["peak_above_base_gib"]:
        measured["peak_ratio"] = (
            measured["chunked"]["peak_above_base_gib"] / measured["unfused"]["peak_above_base_gib"]
        )
    log.info("forward memory: %s", measured)
    return measured


def _inprocess_env() -> dict[str, str]:
    env = child_env()
    # As trainer_svc.launch gives a rank of a one-rank world.
    env.setdefault("OMP_NUM_THREADS", str(max(1, os.cpu_count() or 1)))
    return env


def run_worker(mode: str, plan: dict[str, Any], run_dir: Path, log_path: Path) -> dict[str, Any]:
    plan_path = run_dir / "plan.json"
    result_path = run_dir / "inprocess-result.json"
    result_path.unlink(missing_ok=True)
    plan_path.write_text(json.dumps({**plan, "mode": mode, "launched_at": time.time()}))
    command = [
        sys.executable,
        "-m",
        "benchmarks.trainer_step",
        "--worker-plan",
        str(plan_path),
        "--worker-result",
        str(result_path),
    ]
    with log_path.open("ab") as out:
        code = subprocess.run(
            command,
            cwd=REPO,
            env=_inprocess_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=plan["timeout_s"] + 3600,
            check=False,
        ).returncode
    if code != 0 or not result_path.exists():
        raise RuntimeError(f"{mode} run failed ({code}), {log_path}:\n{tail(log_path)}")
    return json.loads(result_path.read_text())


# -- mode "grpc" -------------------------------------------------------------------------------


def _pipelined_sender(
    target: str, auth: ClientAuth
) -> tuple[Callable[[str, list[Any]], Any], Callable[[], None]]:
    """grpc-pipelined: all of a step's TrainMicrobatch calls are in flight at once (asyncio
    client), so the server converts request j+1 while microbatch j runs; the service still
    executes them one at a time, in arrival order."""
    loop = asyncio.new_event_loop()

    async def open_client() -> AsyncTrainerClient:
        return AsyncTrainerClient(target, auth=auth)

    client = loop.run_until_complete(open_client())

    async def send(step_id: str, batches: list[Any]) -> None:
        calls = []
        for j, batch in enumerate(batches):
            calls.append(
                asyncio.ensure_future(client.train_microbatch(step_id, f"{step_id}-mb{j}", batch))
            )
            await asyncio.sleep(0)  # let call j go out before call j+1
        await asyncio.gather(*calls)

    def close() -> None:
        loop.run_until_complete(client.close())
        loop.close()

    return (lambda step_id, batches: loop.run_until_complete(send(step_id, batches))), close


def run_grpc(
    plan: dict[str, Any], run_dir: Path, log_path: Path, *, auth: ClientAuth, pipelined: bool
) -> dict[str, Any]:
    batches = make_batches(plan)
    with (
        trainer_server(plan, run_dir, log_path, auth=auth) as (target, startup_s),
        TrainerClient(target, auth=auth) as client,
    ):
        status = client.status()
        loss = LossConfig()

        def finish(step_id: str) -> tuple[float, float, int]:
            m = client.finish_step(step_id).metrics
            return m.loss, m.grad_norm, m.counts.valid_tokens

        driver = Driver(
            begin=lambda step_id: client.begin_step(step_id, loss),
            microbatch=client.train_microbatch,
            finish=finish,
        )
        close: Callable[[], None] = lambda: None  # noqa: E731
        if pipelined:
            driver.all_microbatches, close = _pipelined_sender(target, auth)
        try:
            records = run_steps(driver, batches, plan["warmup"], plan["steps"])
        finally:
            close()
        extra: dict[str, Any] = {}
        if plan.get("weights_digest"):
            exported = trainer_root(run_dir) / "exports" / f"{log_path.stem}"
            client.export_hf(exported, dtype=ExportDType.PARAMS)
            extra["weights_sha256"] = weights_digest(exported)
    return dict(
        **extra,
        mode="grpc-pipelined" if pipelined else "grpc",
        startup_s=startup_s,
        num_parameters=status.model.num_parameters,
        params_dtype=common_pb2.DType.Name(status.model.params_dtype)
        .removeprefix("DTYPE_")
        .lower(),
        device=status.device,
        data_checksum=data_checksum(batches),
        records=records,
    )


def weights_digest(export: Path) -> str:
    """SHA-256 over an export's safetensors files in name order: equal for equal weights."""
    digest = hashlib.sha256()
    for path in sorted(export.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def reproducibility(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether every run of every mode had the same loss at each step and, where recorded, the
    same weights at the end."""
    losses = [[r["loss"] for r in run["records"]] for run in runs]
    spread = max(max(step) - min(step) for step in zip(*losses, strict=True))
    digests = {run["weights_sha256"] for run in runs if "weights_sha256" in run}
    return dict(
        max_loss_difference_any_runs=spread,
        losses_identical=spread == 0,
        weights_identical=len(digests) == 1 if digests else None,
    )


# -- host-side cost of one TrainMicrobatch request, without the GPU --------------------------------


def conversion_costs(plan: dict[str, Any], repeats: int = 30) -> dict[str, float]:
    """Median milliseconds of each host-side conversion one TrainMicrobatch goes through (one
    microbatch of this run's shape): what explains the gap between the modes."""
    batch = make_batches(plan)[0]
    request = microbatch_request("step", "request", batch)
    wire = request.SerializeToString()
    parsed = pb.TrainMicrobatchRequest.FromString(wire)
    command = cmd.TrainMicrobatch(step_id="step", request_id="request", batch=batch)
    stages: dict[str, Callable[[], Any]] = {
        "client_build_request": lambda: microbatch_request("step", "request", batch),
        "serialize": request.SerializeToString,
        "parse": lambda: pb.TrainMicrobatchRequest.FromString(wire),
        "server_to_domain": lambda: convert.training_batch(parsed),
        "leader_pickle_command": lambda: pickle.loads(pickle.dumps(command)),
    }
    out: dict[str, float] = {"request_bytes": float(len(wire))}
    for name, stage in stages.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            stage()
            times.append(time.perf_counter() - start)
        out[f"{name}_ms"] = 1e3 * statistics.median(times)
    return out


# -- summary --------------------------------------------------------------------------------------


def variant(mode: str, layout: str, layouts: list[str]) -> str:
    """A run's name in the summary: its mode, and its sequence layout when several are run."""
    return mode if len(layouts) == 1 else f"{mode}-{layout}"


def layout_runs(layouts: list[str], attentions: list[str]) -> list[tuple[str, list[str]]]:
    """(name, trainer arguments) of each sequence layout to run: a layout that may pack once
    per packed-row kernel (named ``layout-kernel`` when there are several), padded once (the
    kernel of packed rows does not touch it)."""
    runs = []
    for layout in layouts:
        chosen = attentions[:1] if layout == "padded" else attentions
        for attention in chosen:
            name = layout if len(chosen) == 1 else f"{layout}-{attention}"
            runs.append((name, ["--sequence-layout", layout, "--packed-attention", attention]))
    return runs


def summarize(runs: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    tokens, trained = step_tokens(plan)
    modes: dict[str, Any] = {}
    for mode in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == mode]
        timed = [s for r in mine for s in r["records"] if not s["warmup"]]
        seconds = [s["seconds"] for s in timed]
        median = statistics.median(seconds)
        modes[mode] = dict(
            runs=len(mine),
            timed_steps=len(timed),
            step_s_median=median,
            step_s_min=min(seconds),
            step_s_max=max(seconds),
            tokens_per_s=tokens / median,
            trained_tokens_per_s=trained / median,
            tokens_per_s_each_run=[
                tokens * len(t) / sum(t)
                for t in ([s["seconds"] for s in r["records"] if not s["warmup"]] for r in mine)
            ],
            begin_s_median=statistics.median(s["begin_s"] for s in timed),
            microbatch_s_median=statistics.median(x for s in timed for x in s["microbatch_s"]),
            finish_s_median=statistics.median(s["finish_s"] for s in timed),
            startup_s=[r["startup_s"] for r in mine],
            approx_model_tflops=6 * mine[0]["num_parameters"] * trained / median / 1e12,
        )
    summary: dict[str, Any] = dict(
        tokens_per_step=tokens, trained_tokens_per_step=trained, modes=modes
    )
    summary["reproducibility"] = reproducibility(runs)
    # The same steps with the sequences packed into one row against right-padded rows (keyed
    # by the mode, and the packed-row kernel where several ran: "inprocess-cudnn").
    summary["packed_over_padded"] = {
        mode + name.removeprefix(f"{mode}-packed"): modes[name]["tokens_per_s"]
        / modes[f"{mode}-padded"]["tokens_per_s"]
        for mode in MODES
        for name in modes
        if name.startswith(f"{mode}-packed") and f"{mode}-padded" in modes
    }
    if "inprocess" not in modes:
        return summary
    base = modes["inprocess"]
    base_run = next(r for r in runs if r["variant"] == "inprocess")
    peaks = [r["matmul_tflops"] for r in runs if r.get("matmul_tflops")]
    if peaks:
        summary["matmul_peak_tflops"] = max(peaks)
        summary["mfu_inprocess"] = base["approx_model_tflops"] / max(peaks)
    commands = plan["microbatches"] + 2
    summary["against_inprocess"] = {}
    for mode in [m for m in modes if m != "inprocess"]:
        m = modes[mode]
        # Same seed, same data, same commands: every mode should train identically.
        run = next(r for r in runs if r["variant"] == mode)
        overhead_ms = 1e3 * (m["step_s_median"] - base["step_s_median"])
        summary["against_inprocess"][mode] = dict(
            ratio=m["tokens_per_s"] / base["tokens_per_s"],
            overhead_ms_per_step=overhead_ms,
            overhead_ms_per_call=overhead_ms / commands,
            max_loss_difference=max(
                abs(a["loss"] - b["loss"])
                for a, b in zip(run["records"], base_run["records"], strict=True)
            ),
            same_data=run["data_checksum"] == base_run["data_checksum"],
        )
    if "grpc" in summary["against_inprocess"]:
        summary["ratio_grpc_over_inprocess"] = summary["against_inprocess"]["grpc"]["ratio"]
    return summary


def print_table(summary: dict[str, Any], meta: dict[str, Any]) -> None:
    print()
    print(
        f"model: {meta['num_parameters'] / 1e9:.3f}B parameters, {meta['params_dtype']}, "
        f"{meta['device']}; step = {meta['microbatches']} microbatches x "
        f"{meta['seqs_per_microbatch']} seqs x "
        + (
            f"{meta['length_mix'][0]}-{meta['length_mix'][1]} tokens"
            if meta.get("length_mix")
            else f"{meta['seq_len']} tokens"
        )
        + f" = {summary['tokens_per_step']} tokens ({summary['trained_tokens_per_step']} trained)"
    )
    header = (
        f"{'mode':<26} {'runs':>4} {'steps':>5} {'step s (median)':>16} {'tokens/s':>10} "
        f"{'tokens/s per run':>22} {'mb call ms':>10} {'finish ms':>9} {'startup s':>10}"
    )
    print(header)
    print("-" * len(header))
    for mode, m in summary["modes"].items():
        each = ", ".join(f"{v:.0f}" for v in m["tokens_per_s_each_run"])
        startup = ", ".join(f"{v:.0f}" for v in m["startup_s"])
        print(
            f"{mode:<26} {m['runs']:>4} {m['timed_steps']:>5} {m['step_s_median']:>16.4f} "
            f"{m['tokens_per_s']:>10.0f} {each:>22} {1e3 * m['microbatch_s_median']:>10.1f} "
            f"{1e3 * m['finish_s_median']:>9.1f} {startup:>10}"
        )
    costs = summary.get("host_costs", {})
    if costs:
        print(
            "one TrainMicrobatch request on the host ("
            f"{costs['request_bytes']:.0f} bytes): "
            + ", ".join(
                f"{k.removesuffix('_ms')} {v:.2f} ms" for k, v in costs.items() if k.endswith("_ms")
            )
        )
    for mode, ratio in summary.get("packed_over_padded", {}).items():
        print(f"{mode}: packed/padded tokens/s (same tokens, same steps): {ratio:.3f}")
    for mode, c in summary.get("against_inprocess", {}).items():
        print(
            f"{mode}/inprocess tokens/s: {c['ratio']:.4f}; overhead "
            f"{c['overhead_ms_per_step']:.2f} ms/step ({c['overhead_ms_per_call']:.2f} ms per "
            f"call); max |loss difference| {c['max_loss_difference']:.3g}; "
            f"same data: {c['same_data']}"
        )


# -- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.trainer_step",
        description=(
            "Tokens/s of the trainer's split training step (BeginTrainStep -> TrainMicrobatch x k "
            "-> FinishTrainStep) over gRPC against the same steps in-process, on one TP=1 rank."
        ),
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="1b",
        help="model and batch shapes (default 1b); the options below override it",
    )
    shape = p.add_argument_group("model (Llama family)")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--hidden", type=int)
    shape.add_argument("--heads", type=int)
    shape.add_argument("--kv-heads", type=int)
    shape.add_argument("--ffn", type=int)
    shape.add_argument("--vocab", type=int)
    shape.add_argument("--max-positions", type=int)
    shape.add_argument(
        "--hf-weights",
        action="store_true",
        help="write random HF safetensors with megatron_hf.tiny (vocab 101, float32 on disk) "
        "instead of a config-only directory that megatron initialises",
    )
    run = p.add_argument_group("run")
    run.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available"
    )
    run.add_argument(
        "--params-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    run.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default="none",
        help="the trainer's --recompute (activation recompute)",
    )
    run.add_argument(
        "--cuda-graphs",
        choices=["none", "layers"],
        default="none",
        help="the trainer's --cuda-graphs (CUDA graphs of the layers for small passes)",
    )
    run.add_argument(
        "--deterministic",
        action="store_true",
        help="the trainer's --deterministic (bit-identical steps from run to run)",
    )
    run.add_argument(
        "--weights-digest",
        action="store_true",
        help="after each run's steps, export its weights bit for bit (ExportHF, params dtype) "
        "and record their SHA-256: whether every run and mode trained the same weights",
    )
    run.add_argument(
        "--update-kernels",
        choices=["fused", "stock"],
        default="fused",
        help="the trainer's --update-kernels (the optimizer update's kernels)",
    )
    run.add_argument(
        "--attention",
        choices=["auto", "sdpa", "local"],
        default="auto",
        help="the trainer's --attention (core attention kernel)",
    )
    run.add_argument(
        "--sequence-layouts",
        default="auto",
        help="comma-separated trainer --sequence-layout values, each run with every mode "
        "(auto, packed, padded; default auto); packed,padded gives their tokens/s ratio",
    )
    run.add_argument(
        "--packed-attentions",
        default="auto",
        help="comma-separated trainer --packed-attention values (auto, cudnn, flash; default "
        "auto), each run with every layout that may pack",
    )
    run.add_argument(
        "--length-mix",
        metavar="MIN:MAX",
        default=None,
        help="sequence lengths drawn uniformly from MIN..MAX tokens (as RL rollouts come) "
        "instead of all --seq-len; --seq-len becomes MAX",
    )
    run.add_argument("--seq-len", type=int)
    run.add_argument("--seqs-per-microbatch", type=int)
    run.add_argument("--microbatches", type=int, help="microbatches per step (k)")
    run.add_argument("--warmup", type=int, help="untimed steps first")
    run.add_argument("--steps", type=int, help="timed steps per run")
    run.add_argument("--repeats", type=int, help="runs of each mode, alternating their order")
    run.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help=f"comma-separated, of {','.join(MODES)} (default {DEFAULT_MODES}); leader: in-process "
        "through rank 0's command path (lock, command thread, broadcast) without gRPC",
    )
    run.add_argument("--lr", type=float, default=1e-5)
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument("--timeout", type=float, default=900.0, help="seconds for one run's start")
    run.add_argument(
        "--forward-memory",
        action="store_true",
        help="inprocess: after the steps, a Forward of the first microbatch with "
        "log-probabilities, entropy and top-20, through the chunked and the unfused "
        "vocab-parallel paths: peak memory of each above what was allocated before it",
    )
    run.add_argument(
        "--profile-finish",
        type=int,
        default=0,
        metavar="N",
        help="inprocess: after the steps, N more whose FinishTrainStep waits for the update, "
        "profiled (kernels, host operators, Python functions); printed and in the JSON",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--out",
        type=Path,
        default=Path("runs/trainer_step.json"),
        help="results JSON (default runs/trainer_step.json, git-ignored)",
    )
    out.add_argument(
        "--log-dir", type=Path, default=None, help="one log per run (default: beside --out)"
    )
    out.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="the run's files: the model directory, the token files, the trainer's work dir "
        "(default: a temporary directory)",
    )
    out.add_argument(
        "--trainer-log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    p.add_argument("--worker-plan", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-result", type=Path, help=argparse.SUPPRESS)
    return p


def apply_preset(args: argparse.Namespace, presets: dict[str, dict[str, Any]]) -> None:
    """Fill the options left unset from `args.preset`; the device defaults to CUDA when there
    is one, params to bf16 on CUDA and fp32 on the CPU."""
    for key, value in presets[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device is None:
        import torch  # only to pick the default device

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.params_dtype is None:
        args.params_dtype = "bfloat16" if args.device == "cuda" else "float32"


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    apply_preset(args, PRESETS)
    if args.hf_weights:
        args.vocab = 101  # megatron_hf.tiny's character tokenizer
    if args.seq_len > args.max_positions:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds --max-positions {args.max_positions}")
    if args.length_mix:
        low, _, high = args.length_mix.partition(":")
        args.length_mix = (int(low), int(high))
        if not 2 <= args.length_mix[0] <= args.length_mix[1]:
            raise SystemExit(f"--length-mix needs 2 <= MIN <= MAX, got {args.length_mix}")
        args.seq_len = args.length_mix[1]
        if args.seq_len > args.max_positions:
            raise SystemExit(f"--length-mix MAX {args.seq_len} exceeds --max-positions")
    args.layouts = [x.strip() for x in args.sequence_layouts.split(",") if x.strip()]
    if not args.layouts or any(x not in ("auto", "packed", "padded") for x in args.layouts):
        raise SystemExit("--sequence-layouts must be a subset of auto,packed,padded")
    args.row_attentions = [x.strip() for x in args.packed_attentions.split(",") if x.strip()]
    if not args.row_attentions or any(
        x not in ("auto", "cudnn", "flash") for x in args.row_attentions
    ):
        raise SystemExit("--packed-attentions must be a subset of auto,cudnn,flash")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        raise SystemExit(f"--modes must be a subset of {','.join(MODES)}")
    return args


def _meta(
    args: argparse.Namespace, argv: list[str] | None, plan: dict[str, Any], runs: list[Any]
) -> dict[str, Any]:
    first = runs[0]
    inproc: dict[str, Any] = next((r for r in runs if r["mode"] == "inprocess"), {})
    return dict(
        run_meta("benchmarks.trainer_step", argv),
        preset=args.preset,
        model=dict(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            ffn=args.ffn,
            vocab=args.vocab,
            max_positions=args.max_positions,
            hf_weights=args.hf_weights,
        ),
        num_parameters=first["num_parameters"],
        params_dtype=first["params_dtype"],
        device=first["device"],
        device_name=inproc.get("device_name"),
        peak_memory_gib_inprocess=inproc.get("peak_memory_gib"),
        versions=inproc.get("versions"),
        seq_len=args.seq_len,
        length_mix=args.length_mix,
        sequence_layouts=args.layouts,
        packed_attentions=args.row_attentions,
        seqs_per_microbatch=args.seqs_per_microbatch,
        microbatches=args.microbatches,
        warmup=args.warmup,
        steps=args.steps,
        repeats=args.repeats,
        runs_done=len(runs),
        trainer_args=plan["trainer_args"],
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker_plan is not None:
        worker_inprocess(args.worker_plan, args.worker_result)
        return
    args = resolve(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [bench] %(levelname)s %(message)s")
    log_dir = args.log_dir or args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="trainer-step-bench-") as scratch:
        work = (args.work_dir or Path(scratch)).absolute()
        model_dir = write_model(work / "model", args)
        tokens = tokens_for(work)
        trainer_args = [
            "--model",
            str(model_dir),
            "--tp",
            "1",
            "--device",
            args.device,
            "--params-dtype",
            args.params_dtype,
            "--attention",
            args.attention,
            "--update-kernels",
            args.update_kernels,
            "--recompute",
            args.recompute,
            "--cuda-graphs",
            args.cuda_graphs,
            *(["--deterministic"] if args.deterministic else []),
            "--lr",
            str(args.lr),
            "--seed",
            str(args.seed),
            "--max-seq-len",
            str(args.seq_len),
            "--log-level",
            args.trainer_log_level,
            "--work-dir",
            str(trainer_root(work)),
            *tokens.server_args(),
        ]
        plan = dict(
            model_dir=str(model_dir),
            trainer_args=trainer_args,
            vocab=args.vocab,
            seq_len=args.seq_len,
            length_mix=args.length_mix,
            seqs_per_microbatch=args.seqs_per_microbatch,
            microbatches=args.microbatches,
            warmup=args.warmup,
            steps=args.steps,
            seed=args.seed,
            timeout_s=args.timeout,
            forward_memory=args.forward_memory,
            profile_finish=args.profile_finish,
            weights_digest=args.weights_digest,
        )
        log.info("trainer args: %s", " ".join(trainer_args))
        costs = conversion_costs(plan)
        log.info("host-side cost of one TrainMicrobatch: %s", costs)
        layouts = dict(layout_runs(args.layouts, args.row_attentions))
        variants = [(mode, layout) for layout in layouts for mode in args.modes]
        for repeat in range(args.repeats):
            order = variants if repeat % 2 == 0 else list(reversed(variants))
            for mode, layout in order:
                name = variant(mode, layout, list(layouts))
                log_path = log_dir / f"{name}-run{repeat}.log"
                log_path.unlink(missing_ok=True)
                log.info("run %d: %s (log %s)", repeat, name, log_path)
                started = time.perf_counter()
                laid_out = dict(plan, trainer_args=[*trainer_args, *layouts[layout]])
                if mode.startswith("grpc"):
                    run = run_grpc(
                        laid_out,
                        work,
                        log_path,
                        auth=tokens.client(Role.ORCHESTRATOR),
                        pipelined=mode == "grpc-pipelined",
                    )
                else:
                    run = run_worker(mode, laid_out, work, log_path)
                run.update(
                    variant=name,
                    layout=layout,
                    repeat=repeat,
                    position=order.index((mode, layout)),
                    wall_s=time.perf_counter() - started,
                )
                runs.append(run)
                timed = [s["seconds"] for s in run["records"] if not s["warmup"]]
                log.info(
                    "run %d %s: median step %.4f s, startup %.1f s",
                    repeat,
                    name,
                    statistics.median(timed),
                    run["startup_s"],
                )
                # Rewritten after every run, so a run cut short still leaves its results.
                summary = summarize(runs, plan)
                summary["host_costs"] = costs
                meta = _meta(args, argv, plan, runs)
                args.out.write_text(
                    json.dumps(dict(meta=meta, summary=summary, runs=runs), indent=1) + "\n"
                )
    print_table(summary, meta)
    same = summary["reproducibility"]
    print(
        f"every run and mode: losses identical {same['losses_identical']} (largest difference "
        f"{same['max_loss_difference_any_runs']:.3g}), weights identical "
        f"{same['weights_identical']}"
    )
    if "mfu_inprocess" in summary:
        print(
            f"MFU in-process: {summary['mfu_inprocess']:.3f} of a measured bf16 matmul peak of "
            f"{summary['matmul_peak_tflops']:.0f} TFLOP/s (model FLOPs: 6 x parameters x tokens)"
        )
    for r in runs:
        if r.get("finish_profile"):
            profile = r["finish_profile"]
            print(
                f"FinishTrainStep alone, waiting for the update: {profile['finish_ms']} ms; the "
                f"update on the device {profile['update_device_ms']} ms, its floor "
                f"{profile['update_floor_ms']} ms ({profile['update_bytes'] / 1e9:.1f} GB at "
                f"{profile['copy_bandwidth_gbs']} GB/s)"
            )
            for key in ("device_ops", "host_ops", "python"):
                print(profile[key])
        if r.get("forward_memory"):
            print(f"forward with log-probabilities, entropy and top-20: {r['forward_memory']}")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
