"""Refit into a transformers model on another GPU: from FinishTrainStep's return to the weights
installed, against a torch peer copy of the same bytes.

* ``python -m refit_sidecar`` and the real trainer, ``python -m trainer_svc --model DIR --tp 1
  --device cuda --sidecar ADDR --refit-slots 2`` (one rank on GPU 0, bf16 parameters, the
  config-only Llama directory of ``benchmarks.refit_pull``), run as subprocesses, with
  authentication on as deployed (``benchmarks.trainer_step.tokens_for``: the trainer presents the
  trainer role's token to the sidecar, the receiver the receiver role's, this process the
  orchestrator's).
* A receiver subprocess (this script with ``--receiver-settings``) builds the HF model
  (``AutoModelForCausalLM.from_config`` of the same ``config.json``, in the trainer's dtype) on
  GPU ``--dest-gpu`` and an ``inference_ext.receiver.Receiver`` (TP=1 layout, staging on the same
  GPU) whose installer ``copy_()``s each (HF name, tensor) into the model's parameter of that
  name, then synchronizes the GPU. A mixture of experts' receiver names each layer's fused
  expert targets instead of the per-expert tensors: the model's own fused ``gate_up_proj`` and
  ``down_proj`` (``benchmarks.hf_model``). With ``--install in-place`` (the default) the
  receiver is handed the model's parameters (``Receiver.fetch(version, in_place=...)``): from
  the second refit of a slot's layout on they live in staging, the pull lands in them, the
  receiver casts the ones the model holds in another dtype, and the installer gets only the
  rest (inference_ext/staged_tensors.py); ``--install copy`` copies every tensor in after the
  pull. It is started before the trainer, so its setup is not timed.
* This process trains ``--warmup + --steps`` steps over gRPC, each FinishTrainStep asked to answer
  once its update is applied (``wait_for_update``: the clock starts when the new weights exist,
  not when their update is queued). Right after each FinishTrainStep returns it reads
  ``time.monotonic()`` and writes the new version and that instant down a pipe to the receiver,
  which at once runs ``Receiver.fetch(version)`` (lease, manifest, plan or replayed plan, NIXL
  pull into staging) and ``Receiver.install`` and answers once the model's stream has run what
was queued (the in-place backup's copy, on a stream of its own, is not waited for). Before
  each step after the first, the receiver asks the sidecar ahead for the version that step will
  make (``Receiver.expect``, as a follower does; ``--no-expect``: not), so its lease is answered
  the moment the version is published. **Latency** = the receiver's ``time.monotonic()`` then
  minus the driver's instant: CLOCK_MONOTONIC is one clock for every process of the machine, so
  the number covers everything from the trainer's reply to installed weights, the pipe hop
  included (tens of microseconds; reported as ``notify``). The sidecar's WatchVersions would
  announce a version no earlier than the RPC returns (the version is readable just before the
  reply), so the pipe does not flatter the result. The driver waits for the answer before the next
  step: the refit runs on idle GPUs, not under training.
* The phases come from ``RefitStats`` (plan: lease + manifest + plan/rebase; pull; translate;
  install: the copies and the synchronize) and the receiver's own clock (``fetch``). The first
  refit connects, plans, registers staging and prepares the NIXL requests of its slot and is
  reported apart; the first refit on each of the trainer's slots is a warm-up (``--warmup``,
  default the slot count); later ones replay the plan (``rebase``) onto cached requests.
* Baseline, in the receiver process and alternating with the refits (before the step on odd
  steps, after the refit on even ones): one tensor of each HF parameter's shape and dtype on
  GPU 0 ``copy_()``d into a tensor of the same shape on the receiver's GPU, both GPUs
  synchronized, timed with the same clock: the GPUs' own peer copy of the bytes a refit moves.
* Once, after the last refit and untimed: the HF model's state_dict against ExportHF of that
  version, bit for bit (its per-expert tensors fused as transformers fuses them), and the HF
  model's logprobs on a fixed batch against the trainer's Forward (reported as a gap: bf16
  kernels differ between Megatron and transformers).

``--device cpu`` runs the same path on the CPU (DRAM slots and staging, host copies as the
baseline) as a smoke test. The summary gives each refit's control plane (lease, manifest and
plan: the refit's time before its first read) and the tensors installed.

    python -m benchmarks.refit_install --preset 1b --device cuda --dest-gpu 1 --out runs/ri.json
    python -m benchmarks.refit_install --preset moe --device cuda --dest-gpu 1 --out runs/moe.json
    python -m benchmarks.refit_install --preset tiny --device cpu --out /tmp/refit_install.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

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
from benchmarks.hf_model import (
    as_loaded,
    build_hf_model,
    expert_tensors,
    hf_parameters,
    model_name,
)
from benchmarks.refit_pull import _MODEL_KEYS
from benchmarks.refit_pull import PRESETS as PULL_PRESETS
from benchmarks.trainer_step import make_batches, write_config_model
from benchmarks.trainer_step import write_model as _write_model
from inference_ext.expert_slices import parse_target, receiver_names
from megatron_hf.spec import ModelFamily, ModelSpec, MoESpec
from refit_sidecar.publish.slot_layout import DEFAULT_FIRST_PIECE_BYTES
from refit_sidecar.pull.chunking import DEFAULT_REQUESTS_IN_FLIGHT
from refit_sidecar.pull.pipelined import DEFAULT_CHUNK_BYTES
from refit_sidecar.pull.running_check import DEFAULT_PART_BYTES
from trainer_refit.auth import Role
from trainer_svc.client import TrainerClient
from trainer_svc.domain import ExportDType, LossConfig, SequenceBatch

log = logging.getLogger("benchmarks.refit_install")

_BATCH_KEYS = ("seq_len", "seqs_per_microbatch", "microbatches")
PRESETS: dict[str, dict[str, Any]] = {
    name: {
        **{k: PULL_PRESETS[name][k] for k in (*_MODEL_KEYS, *_BATCH_KEYS)},
        "steps": steps,
    }
    for name, steps in (("1b", 10), ("3b", 8), ("tiny", 3))
}
# Qwen3-30B-A3B's routing (128 experts, top-8, renormalised) and attention (hidden 2048, 32
# query heads of 128, 4 KV heads), its experts narrowed from 768 to 128 wide and its 48 layers
# cut to 14: 14 x 128 x 3 = 5,376 per-expert HF tensors, installed as 28 fused ones. Per layer:
# attention 2 x 4096 x 2048 + 2 x 512 x 2048 = 18.9M parameters, router 128 x 2048 = 0.3M,
# experts 128 x 3 x 128 x 2048 = 100.7M; x 14 = 1.68B, with the 32k vocabulary's embedding
# and head (2 x 65.5M) 1.81B: 3.6 GB of bf16 a refit. One 139 GiB GPU holds the trainer at 18
# bytes a parameter (bf16 weights, fp32 gradients, fp32 main weights, Adam's two fp32 moments:
# 33 GB), its two refit slots (7 GB) and the receiver's model, staging, in-place backup and the
# peer copy's two tensors (5 x 3.6 = 18 GB): about 58 GB before activations, trainer and
# receiver on one GPU included. `ffn` is the config's dense width, which no layer uses.
PRESETS["moe"] = dict(
    layers=14,
    hidden=2048,
    heads=32,
    kv_heads=4,
    head_dim=128,
    ffn=6144,
    vocab=32000,
    max_positions=4096,
    experts=MoESpec(num_experts=128, top_k=8, ffn_hidden_size=128, norm_topk_prob=True),
    **{k: PULL_PRESETS["1b"][k] for k in _BATCH_KEYS},
    steps=10,
)
# The same family and routing at a CPU test's size: 8 experts, top-2, 4 heads of 32 over a
# hidden size of 64 (heads wider than hidden / heads, as Qwen3's).
PRESETS["tiny-moe"] = dict(
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=32,
    ffn=128,
    vocab=128,
    max_positions=256,
    experts=MoESpec(num_experts=8, top_k=2, ffn_hidden_size=32, norm_topk_prob=True),
    **{k: PULL_PRESETS["tiny"][k] for k in _BATCH_KEYS},
    steps=3,
)
_DTYPES = ("float32", "bfloat16")
INSTALLS = {
    "in-place": "the HF model's parameters live in staging once the first refit of the slot's "
    "layout installed them: later pulls land in them (Receiver.fetch(..., in_place=...))",
    "copy": "every tensor is copied into the model after the pull",
}
_CHECK_SEQUENCES, _CHECK_LENGTH = 4, 32


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one run needs, resolved from the command line and the preset."""

    preset: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_positions: int
    device: str
    dest_gpu: int
    params_dtype: str
    seq_len: int
    seqs_per_microbatch: int
    microbatches: int
    slots: int
    warmup: int
    steps: int
    verify: bool
    checksums: bool
    expect: bool
    """Receivers ask for each next version before its step (`Receiver.expect`)."""
    requests_in_flight: int
    """The direct receiver's `RefitOptions.direct.requests_in_flight`."""
    request_taper: int
    """The direct receiver's `RefitOptions.direct.request_taper`."""
    install: str
    """How the direct receiver installs (`INSTALLS`)."""
    trace: bool
    """The receivers record each pull's timeline (`RefitOptions.trace_pull`)."""
    before_readable: bool
    """Asked ahead, the lease comes at the slot's reservation and the pull starts on the
    trainer's version words (`RefitOptions.direct.read_before_readable`)."""
    behind_copy: bool
    """Before readable, each request waits for its pieces of the trainer's snapshot copy, not
    for the whole copy (`RefitOptions.direct.read_behind_copy`)."""
    first_piece_bytes: int
    """The trainer's `--refit-first-piece-bytes`."""
    publish_start: bool
    """The trainer publishes its start-up weights (`--refit-publish-start`) and the receiver
    installs them before the first step, as a replica does at start: its first step's refit
    is then timed like the rest (`--warmup` may be 0)."""
    lr: float
    seed: int
    timeout: float
    refit_timeout: float
    out: Path
    log_dir: Path
    work_dir: Path | None
    trainer_log_level: str
    head_dim: int | None = None
    """None: hidden / heads (a Llama preset)."""
    experts: MoESpec | None = None
    """A mixture-of-experts preset's experts (a Qwen3-MoE model); None: a dense Llama."""

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def moe_spec(self) -> ModelSpec:
        """The Qwen3-MoE model of a mixture-of-experts preset (its config directory's)."""
        if self.experts is None:
            raise ValueError(f"preset {self.preset!r} has no experts")
        return ModelSpec(
            family=ModelFamily.QWEN3_MOE,
            architecture="Qwen3MoeForCausalLM",
            num_layers=self.layers,
            hidden_size=self.hidden,
            ffn_hidden_size=self.ffn,
            num_attention_heads=self.heads,
            num_query_groups=self.kv_heads,
            head_dim=self.head_dim or self.hidden // self.heads,
            vocab_size=self.vocab,
            max_position_embeddings=self.max_positions,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            qkv_bias=False,
            qk_layernorm=True,
            moe=self.experts,
        )

    @property
    def refits(self) -> int:
        return self.warmup + self.steps

    def trainer_args(self, model_dir: Path) -> list[str]:
        """The model and run flags; the caller adds the sidecar, tokens and work dir."""
        return [
            *("--model", str(model_dir), "--tp", "1", "--device", self.device),
            *("--params-dtype", self.params_dtype, "--lr", str(self.lr), "--seed", str(self.seed)),
            *("--max-seq-len", str(self.seq_len), "--log-level", self.trainer_log_level),
            *("--refit-slots", str(self.slots)),
            *("--refit-first-piece-bytes", str(self.first_piece_bytes)),
            *(["--refit-publish-start"] if self.publish_start else []),
        ]


@dataclass(frozen=True, kw_only=True)
class ReceiverSettings:
    """What the receiver subprocess is told (as JSON, in a file)."""

    sidecar: str
    token_file: str
    """The receiver role's bearer token for the sidecar."""
    model_dir: str
    params_dtype: str
    dest: str
    """The receiver's device: staging, HF model, peer-copy destinations."""
    source: str
    """Where the peer copy's sources live (the trainer's GPU)."""
    timeout_s: float
    """A refit's lease and pull timeout."""
    receiver_id: str = "refit-install-benchmark"
    tree: bool = False
    """Also hold a receiver that reads through the sidecar's source tree (refit mode
    "tree"), beside the one reading from the trainer's ranks (mode "direct")."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """The tree receiver's chunk size."""
    chunk_taper: int = 0
    """The tree receiver's halvings of its chunk size towards each end (`ChunkConfig.taper`)."""
    check_part_bytes: int = DEFAULT_PART_BYTES
    """The tree receiver's bytes per part of its running check."""
    trace: bool = False
    """The receivers record each pull's timeline (`RefitOptions.trace_pull`)."""
    checksums: bool = True
    """Verify the trainer's checksums after each pull (WSUM-64 on the receiver's GPU)."""
    before_readable: bool = True
    """`RefitOptions.direct.read_before_readable` of the receivers."""
    behind_copy: bool = True
    """`RefitOptions.direct.read_behind_copy` of the receivers."""
    requests_in_flight: int = DEFAULT_REQUESTS_IN_FLIGHT
    """`RefitOptions.direct.requests_in_flight` of the receivers."""
    request_taper: int = 0
    """`RefitOptions.direct.request_taper` of the direct receiver."""
    install: str = "in-place"
    """How the direct receiver installs (`INSTALLS`)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ReceiverSettings:
        values = json.loads(text)
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


# -- the receiver (a subprocess of this script) ---------------------------------------------------


def _synchronize(*devices: Any) -> None:
    import torch

    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class PeerCopy:
    """The baseline: one tensor per installed parameter (same shape and dtype) on the source
    device, copied into one of the same shape on the destination device."""

    def __init__(self, params: dict[str, Any], source: Any, dest: Any) -> None:
        import torch

        self.devices = (source, dest)
        self.sources = [torch.ones_like(p, device=source) for p in params.values()]
        self.dests = [torch.empty_like(p, device=dest) for p in params.values()]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.sources)
        self.seconds()  # untimed: the first peer copy enables peer access

    def seconds(self) -> float:
        _synchronize(*self.devices)
        start = time.monotonic()
        for src, dst in zip(self.sources, self.dests, strict=True):
            dst.copy_(src, non_blocking=True)
        _synchronize(*self.devices)
        return time.monotonic() - start


class InstallEndpoint:
    """The receiver process's state and its answers to the driver's requests."""

    def __init__(self, settings: ReceiverSettings) -> None:
        import torch

        from inference_ext.receiver import Receiver
        from inference_ext.refit_options import (
            DirectOptions,
            FanOutOptions,
            ReceiverAuth,
            RefitOptions,
        )
        from inference_ext.slices import ReceiverLayout
        from megatron_hf.convert import hf_names

        self.dest, source = torch.device(settings.dest), torch.device(settings.source)
        if self.dest.type == "cuda":
            torch.cuda.set_device(self.dest)  # staging and the installer's copies run here
        started = time.monotonic()
        self.spec = ModelSpec.from_pretrained_dir(settings.model_dir)
        self.model = build_hf_model(settings.model_dir, settings.params_dtype, settings.dest)
        # lm_head omitted when tied; a mixture of experts' fused expert targets last
        names = receiver_names(self.spec, hf_names(self.spec))
        self.params = hf_parameters(self.model, self.spec, names)
        options = RefitOptions(
            auth=ReceiverAuth(token_file=settings.token_file),
            receiver_id=settings.receiver_id,
            lease_ttl_s=settings.timeout_s,
            pull_timeout_s=settings.timeout_s,
            verify_checksums=settings.checksums,
            direct=DirectOptions(
                read_before_readable=settings.before_readable,
                read_behind_copy=settings.behind_copy,
                requests_in_flight=settings.requests_in_flight,
                request_taper=settings.request_taper,
            ),
            trace_pull=settings.trace,
        )
        self.receivers = {
            "direct": Receiver(
                settings.sidecar,
                self.spec,
                ReceiverLayout(0, 1),
                names,
                options=options,
                device=self.dest,
            )
        }
        if settings.tree:
            tree = replace(
                options,
                receiver_id=f"{settings.receiver_id}-tree",
                fanout=FanOutOptions(
                    enabled=True,
                    chunk_bytes=settings.chunk_bytes,
                    chunk_taper=settings.chunk_taper,
                    check_part_bytes=settings.check_part_bytes,
                ),
                trace_pull=settings.trace,
            )
            self.receivers["tree"] = Receiver(
                settings.sidecar,
                self.spec,
                ReceiverLayout(0, 1),
                names,
                options=tree,
                device=self.dest,
            )
        self.receiver = self.receivers["direct"]
        self.install_mode = settings.install
        self.peer = PeerCopy(self.params, source, self.dest)
        self.setup_s = time.monotonic() - started

    def ready(self) -> dict[str, Any]:
        import torch

        names = {}
        if self.dest.type == "cuda":
            names = {str(d): torch.cuda.get_device_name(d) for d in self.peer.devices}
        return dict(
            setup_s=self.setup_s,
            installed_tensors=len(self.params),
            fused_expert_tensors=sum(parse_target(n) is not None for n in self.params),
            expert_tensors=expert_tensors(self.spec),
            installed_bytes=self.peer.nbytes,
            hf_model_class=type(self.model).__name__,
            device_names=names,
        )

    def install(self, tensors: Iterator[tuple[str, Any]]) -> None:
        import torch

        with torch.no_grad():
            for name, tensor in tensors:
                param = self.params[name]
                if param.shape != tensor.shape:
                    raise RuntimeError(
                        f"{name}: {tuple(tensor.shape)} does not fit {tuple(param.shape)}"
                    )
                # Megatron keeps RMSNorm weights in fp32 under bf16 params; copy_ casts them.
                param.copy_(tensor, non_blocking=True)
        _synchronize(self.dest)

    def refit(self, version: int, finished_at: float, mode: str = "direct") -> dict[str, Any]:
        import torch

        received = time.monotonic()
        receiver = self.receivers[mode]
        how = self.install_mode if mode == "direct" else "copy"
        receiver.fetch(version, in_place=self.params if how == "in-place" else None)
        fetched = time.monotonic()
        stats = receiver.install(self.install)
        if self.dest.type == "cuda":
            # What the receiver queued after the installer (its casts), on the stream the
            # model computes on; not the whole device, whose backup copy of staging
            # (in place) runs on a stream of its own, off the refit's path.
            torch.cuda.current_stream(self.dest).synchronize()
        installed = time.monotonic()
        return dict(
            version=version,
            agent=receiver.agent,
            latency_s=installed - finished_at,
            notify_s=received - finished_at,
            fetch_s=fetched - received,
            install_call_s=installed - fetched,
            stats=stats.to_dict(),
        )

    def expect(self, version: int, mode: str = "direct") -> dict[str, Any]:
        """Ask ahead for `version` (answered when it is readable): before its step."""
        self.receivers[mode].expect(version)
        return {}

    def peer_copy(self) -> dict[str, Any]:
        return dict(seconds=self.peer.seconds(), nbytes=self.peer.nbytes)

    def check(self, export: str, prompts: list[list[int]], logprobs: list[list[float]]) -> Any:
        import torch

        from megatron_hf.checkpoint import load_hf_state_dict

        files = load_hf_state_dict(export)  # per-expert tensors, as checkpoints hold them
        exported = as_loaded(files, self.spec)
        state = {k: v.cpu() for k, v in self.model.state_dict().items()}
        # Exported tensors keep the trainer's dtype (fp32 norms under bf16 params); the
        # model holds them in its own dtype, so compare after the same cast the install did.
        differing = sorted(
            name
            for name, tensor in exported.items()
            if name not in state or not torch.equal(state[name], tensor.to(state[name].dtype))
        )
        cast = sorted(n for n, t in exported.items() if n in state and state[n].dtype != t.dtype)
        gaps = [
            float(np.abs(np.asarray(a) - np.asarray(b)).max())
            for a, b in zip(self.logprobs(prompts), logprobs, strict=True)
        ]
        not_exported = sorted({model_name(self.spec, n) for n in self.params} - set(exported))
        return dict(
            checked_tensors=len(exported),
            exported_tensors=len(files),
            identical=not differing and not not_exported,
            cast_to_model_dtype=len(cast),
            not_exported=not_exported[:10],
            differing=differing[:10],
            max_logprob_gap=max(gaps),
            logprob_gap_per_sequence=gaps,
        )

    def logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        """Each token's logprob given the tokens before it (from the second token on), as
        Forward reports them."""
        import torch

        out = []
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=self.dest)
                logits = self.model(input_ids=ids).logits[0, :-1].float()
                picked = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
                out.append(picked.cpu().tolist())
        return out

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()


def receiver_main(settings_path: Path, command_fd: int, reply_fd: int) -> None:
    """Serves the driver's requests, one JSON line each way, until "stop" or end of input."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s [receiver] %(levelname)s %(message)s"
    )
    settings = ReceiverSettings.from_json(settings_path.read_text())
    with os.fdopen(command_fd, "r") as commands, os.fdopen(reply_fd, "w") as replies:

        def reply(message: dict[str, Any]) -> None:
            replies.write(json.dumps(message) + "\n")
            replies.flush()

        endpoint = InstallEndpoint(settings)
        try:
            reply(endpoint.ready())
            for line in commands:
                request = json.loads(line)
                op = request.pop("op")
                if op == "stop":
                    break
                result = getattr(endpoint, op)(**request)
                log.info("%s: %s", op, result)
                reply(result)
        finally:
            endpoint.close()


# -- the driver's side of the receiver -----------------------------------------------------------


class ReceiverProcess:
    """The receiver subprocess and the two pipes to it."""

    def __init__(self, settings: ReceiverSettings, run_dir: Path, log_path: Path) -> None:
        settings_path = run_dir / "receiver-settings.json"
        settings_path.write_text(settings.to_json())
        command_r, command_w = os.pipe()
        reply_r, reply_w = os.pipe()
        self.log_path = log_path
        self._log = log_path.open("ab")
        command = [sys.executable, "-m", "benchmarks.refit_install"]
        self.process = subprocess.Popen(
            [
                *command,
                "--receiver-settings",
                str(settings_path),
                "--command-fd",
                str(command_r),
                "--reply-fd",
                str(reply_w),
            ],
            cwd=REPO,
            env=child_env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(command_r, reply_w),
            start_new_session=True,
        )
        os.close(command_r)  # the child's ends: EOF reaches each side when the other goes
        os.close(reply_w)
        self._commands: IO[str] = os.fdopen(command_w, "w")
        self._replies: IO[str] = os.fdopen(reply_r, "r")

    def send(self, op: str, **request: Any) -> None:
        self._commands.write(json.dumps({"op": op, **request}) + "\n")
        self._commands.flush()

    def reply(self, timeout_s: float) -> dict[str, Any]:
        ready, _, _ = select.select([self._replies], [], [], timeout_s)
        line = self._replies.readline() if ready else ""
        if not line:
            why = "exited" if ready else f"did not answer within {timeout_s} s"
            raise RuntimeError(f"the receiver {why}, {self.log_path}:\n{tail(self.log_path)}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def request(self, op: str, timeout_s: float, **request: Any) -> dict[str, Any]:
        self.send(op, **request)
        return self.reply(timeout_s)

    def stop(self) -> None:
        if self.process.poll() is None and not self._commands.closed:
            with contextlib.suppress(BrokenPipeError):
                self.send("stop")
        with contextlib.suppress(BrokenPipeError):
            self._commands.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # the group of the receiver we started
            self.process.wait()
        self._replies.close()
        self._log.close()


@contextlib.contextmanager
def receiver_process(
    settings: ReceiverSettings, run_dir: Path, log_path: Path
) -> Iterator[ReceiverProcess]:
    process = ReceiverProcess(settings, run_dir, log_path)
    try:
        yield process
    finally:
        process.stop()


# -- the driver: steps, refits, copies ------------------------------------------------------------


def train_step(client: TrainerClient, step_id: str, batches: list[Any]) -> dict[str, Any]:
    """One step; ``finished_at`` is time.monotonic() right after FinishTrainStep returned
    (``finished_wall`` the wall clock then, the clock of each refit's stats' times). It
    asks FinishTrainStep to answer once the update is applied (``wait_for_update``), so the
    refit is timed from the moment the new weights exist, not from when the update was
    queued (the trainer's default answer, which would count the update's own time too)."""
    start = time.monotonic()
    client.begin_step(step_id, LossConfig())
    for j, batch in enumerate(batches):
        client.train_microbatch(step_id, f"{step_id}-mb{j}", batch)
    sent = time.monotonic()
    result = client.finish_step(step_id, wait_for_update=True)
    finished_at, finished_wall = time.monotonic(), time.time()
    return dict(
        version=result.weights_version,
        finished_at=finished_at,
        finished_wall=finished_wall,
        step_s=finished_at - start,
        finish_s=finished_at - sent,
        loss=result.metrics.loss,
    )


def run_refits(
    client: TrainerClient,
    receiver: ReceiverProcess,
    batches: list[Any],
    config: RunConfig,
    installed: int | None = None,
) -> list[dict[str, Any]]:
    """`installed`: the version the receiver holds already (the start-up one), whose
    successor it asks for ahead of the first step like every later one."""
    records = []
    version = installed
    for index in range(config.refits):
        peer_first = index % 2 == 1
        peer = receiver.request("peer_copy", config.timeout) if peer_first else None
        if config.expect and version is not None:
            receiver.request("expect", config.timeout, version=version + 1)
        step = train_step(client, f"step-{index}", batches)
        version = step["version"]
        receiver.send("refit", version=step["version"], finished_at=step["finished_at"])
        refit = receiver.reply(config.refit_timeout + 30)
        if not peer_first:
            peer = receiver.request("peer_copy", config.timeout)
        assert peer is not None
        records.append(
            dict(index=index, warmup=index < config.warmup, step=step, refit=refit, peer_copy=peer)
        )
        log.info(
            "refit %d (version %d%s): %.2f ms from Finish to installed, peer copy %.2f ms",
            index,
            step["version"],
            ", warm-up" if index < config.warmup else "",
            1e3 * refit["latency_s"],
            1e3 * peer["seconds"],
        )
    return records


def check_batch(config: RunConfig) -> list[list[int]]:
    rng = np.random.default_rng(config.seed + 1)
    length = min(_CHECK_LENGTH, config.seq_len)
    return [rng.integers(0, config.vocab, size=length).tolist() for _ in range(_CHECK_SEQUENCES)]


def verify(
    client: TrainerClient, receiver: ReceiverProcess, root: Path, config: RunConfig
) -> dict[str, Any]:
    """The installed model against ExportHF (into the trainer's path root `root`) and Forward
    of the same (the latest) version."""
    export = root / "export"
    shutil.rmtree(export, ignore_errors=True)  # an earlier run's, in the same work dir
    client.export_hf(export, dtype=ExportDType.PARAMS)
    prompts = check_batch(config)
    batch = SequenceBatch.from_lists(prompts, loss_mask=[[True] * len(p) for p in prompts])
    result = client.forward(batch)
    assert result.logprobs is not None
    bounds = np.cumsum([0, *map(len, prompts)])
    trainer = [result.logprobs[a + 1 : b].tolist() for a, b in itertools.pairwise(bounds)]
    check = receiver.request(
        "check", config.timeout, export=str(export), prompts=prompts, logprobs=trainer
    )
    check["version"] = result.weights_version
    return check


# -- summary --------------------------------------------------------------------------------------

_PHASES = (
    "notify_s",
    "fetch_s",
    "lease_s",
    "plan_s",
    "pull_s",
    "gated_s",
    "gate_first_s",
    "lag_s",
    "checksums_wait_s",
    "check_s",
    "translate_s",
    "install_s",
)


def _phases(refit: dict[str, Any]) -> dict[str, float]:
    flat = {**refit, **refit["stats"]}
    return {k: flat.get(k, 0.0) for k in ("latency_s", *_PHASES)}


def summarize(
    records: list[dict[str, Any]], slots: int, startup: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`slots`: the trainer's; refits after the first on each slot are steady (every layout
    met, planned and adopted), the baseline of the first refit's ratio. A refit's control
    plane, its time with the sidecar before its first read, is its `plan` phase: the lease
    (`lease`: its answer waited for, or the one asked ahead taken), then the manifest and
    plan (or their replay)."""
    timed = [r for r in records if not r["warmup"]]
    if not timed:
        raise RuntimeError("no timed refits: --steps must be >= 1")
    phases = [_phases(r["refit"]) for r in timed]
    median = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    peer_s = statistics.median(r["peer_copy"]["seconds"] for r in timed)
    refit_bytes = timed[-1]["refit"]["stats"]["bytes_pulled"]
    peer_bytes = timed[-1]["peer_copy"]["nbytes"]
    return dict(
        refit_bytes=refit_bytes,
        peer_copy_bytes=peer_bytes,
        timed_refits=len(timed),
        median_ms={k.removesuffix("_s"): 1e3 * v for k, v in median.items()},
        peer_copy_ms=1e3 * peer_s,
        latency_over_peer_copy=median["latency_s"] / peer_s,
        gb_per_s=dict(
            refit=refit_bytes / median["latency_s"] / 1e9,
            pull=refit_bytes / median["pull_s"] / 1e9,
            peer_copy=peer_bytes / peer_s / 1e9,
        ),
        first_refit_ms={
            k.removesuffix("_s"): 1e3 * v for k, v in _phases(records[0]["refit"]).items()
        },
        first_refit_over_steady=records[0]["refit"]["latency_s"]
        / statistics.median(r["refit"]["latency_s"] for r in records[slots:] or records),
        startup_refit_ms=None
        if startup is None
        else {k.removesuffix("_s"): 1e3 * v for k, v in _phases(startup).items()},
        warmup_latency_ms=[1e3 * r["refit"]["latency_s"] for r in records if r["warmup"]],
        replanned=[r["refit"]["stats"]["replanned"] for r in records],
        in_place_bytes=timed[-1]["refit"]["stats"].get("in_place_bytes", 0),
        finish_median_ms=1e3 * statistics.median(r["step"]["finish_s"] for r in timed),
        step_median_ms=1e3 * statistics.median(r["step"]["step_s"] for r in timed),
        trace_ms=_trace_medians(timed),
        gate_first_pieces=[r["refit"]["stats"].get("gate_first_pieces", 0) for r in timed],
        gate_rounds=[r["refit"]["stats"].get("gate_rounds", 0) for r in timed],
    )


_TRACED = ("prepared", "saw", "readable", "posted", "landed", "verified")
"""The events of a direct pull's timeline (`trace.TraceEvent`) the summary times: the
first of each, and the last landing."""


def _trace_medians(timed: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the refits recorded with `--trace`: ms from the pull's start to the first
    of each event of `_TRACED` (to the last landing for "landed")."""
    times: dict[str, list[float]] = {name: [] for name in _TRACED}
    for record in timed:
        events = record["refit"]["stats"].get("trace") or []
        began = next((t for t, name, _, _ in events if name == "began"), None)
        if began is None:
            continue
        for name in _TRACED:
            at = [t for t, event, _, _ in events if event == name]
            if at:
                times[name].append(1e3 * ((at[-1] if name == "landed" else at[0]) - began))
    return {name: statistics.median(v) for name, v in times.items() if v}


def print_summary(
    summary: dict[str, Any], check: dict[str, Any] | None, receiver: dict[str, Any]
) -> None:
    m = summary["median_ms"]
    print(
        f"\nbytes per refit: {summary['refit_bytes']:,} (peer copy {summary['peer_copy_bytes']:,})"
    )
    print(
        f"{summary['timed_refits']} timed refits, FinishTrainStep returned -> installed, medians:"
    )
    print(
        f"  latency {m['latency']:.3f} ms; phases: notify {m['notify']:.3f}, fetch "
        f"{m['fetch']:.3f} (plan {m['plan']:.3f}, pull {m['pull']:.3f} (first request after "
        f"{m['gated']:.3f}, first look at the pieces after {m['gate_first']:.3f}), lag "
        f"{m['lag']:.3f}, checksums wait {m['checksums_wait']:.3f}, check {m['check']:.3f}), "
        f"translate {m['translate']:.3f}, install {m['install']:.3f} ms; "
        f"{summary['in_place_bytes']:,} bytes pulled straight into the model's tensors"
    )
    g = summary["gb_per_s"]
    print(
        f"  peer copy {summary['peer_copy_ms']:.3f} ms; latency / peer copy "
        f"{summary['latency_over_peer_copy']:.3f}"
    )
    print(
        f"  GB/s: refit {g['refit']:.1f}, pull alone {g['pull']:.1f}, "
        f"peer copy {g['peer_copy']:.1f}"
    )
    first = summary["first_refit_ms"]
    startup = summary["startup_refit_ms"]
    if startup is not None:
        print(
            f"start-up version installed before the first step: {startup['latency']:.1f} ms "
            f"(plan {startup['plan']:.1f}, pull {startup['pull']:.1f}, lag {startup['lag']:.1f})"
        )
    print(
        f"first refit: {first['latency']:.1f} ms = {summary['first_refit_over_steady']:.2f}x "
        f"the steady refits' median (plan {first['plan']:.1f}, pull {first['pull']:.1f}, lag "
        f"{first['lag']:.1f}); warm-up refits "
        + ", ".join(f"{v:.1f}" for v in summary["warmup_latency_ms"])
        + " ms"
    )
    m = summary["median_ms"]
    print(
        f"  control plane per refit (before its first read): median {m['plan']:.3f} ms (lease "
        f"{m['lease']:.3f}) = {m['plan'] / m['latency']:.1%} of the latency"
    )
    experts = (
        f" ({receiver['fused_expert_tensors']} fused expert tensors of "
        f"{receiver['expert_tensors']:,} per-expert HF ones)"
        if receiver["expert_tensors"]
        else ""
    )
    print(f"  tensors installed per refit: {receiver['installed_tensors']:,}{experts}")
    if summary["trace_ms"]:
        print(
            "pull timeline, ms from its start (medians): "
            + ", ".join(f"{name} {ms:.3f}" for name, ms in summary["trace_ms"].items())
        )
    if any(summary["gate_rounds"]):
        print(
            "pieces holding the version at each refit's first look: "
            + " ".join(map(str, summary["gate_first_pieces"]))
            + "; looks per pull: "
            + " ".join(map(str, summary["gate_rounds"]))
        )
    print(
        f"FinishTrainStep median {summary['finish_median_ms']:.2f} ms, "
        f"step {summary['step_median_ms']:.1f} ms"
    )
    if check is not None:
        print(
            f"installed model equals ExportHF of version {check['version']}: {check['identical']} "
            f"({check['checked_tensors']} tensors"
            + (
                f", fused from ExportHF's {check['exported_tensors']:,}"
                if check["exported_tensors"] != check["checked_tensors"]
                else ""
            )
            + f", {check['cast_to_model_dtype']} cast to the "
            f"model's dtype); max |logprob gap| HF vs Forward "
            f"{check['max_logprob_gap']:.3g}"
        )


# -- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.refit_install",
        description=(
            "Time from FinishTrainStep's return to the new weights installed in a transformers "
            "model on another GPU (Receiver: lease, NIXL pull, translate, copy), against a torch "
            "peer copy of the same bytes."
        ),
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    shape = p.add_argument_group(
        "model (config-only: megatron initialises it; Llama, the moe presets Qwen3-MoE)"
    )
    for key in _MODEL_KEYS:
        shape.add_argument(f"--{key.replace('_', '-')}", type=int)
    run = p.add_argument_group("run")
    run.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    run.add_argument(
        "--dest-gpu",
        type=int,
        default=1,
        help="the receiver's GPU (the trainer: 0); 0 shares the trainer's GPU (a one-GPU host: "
        "its figures compare only with a baseline of the same placement)",
    )
    run.add_argument(
        "--params-dtype", choices=_DTYPES, help="default: bfloat16 on cuda, else float32"
    )
    run.add_argument("--seq-len", type=int)
    run.add_argument("--seqs-per-microbatch", type=int)
    run.add_argument("--microbatches", type=int)
    run.add_argument("--slots", type=int, default=2, help="--refit-slots of the trainer")
    run.add_argument("--warmup", type=int, help="untimed refits first (default: --slots)")
    run.add_argument("--steps", type=int, help="timed steps, each refitted")
    run.add_argument("--no-verify", action="store_true", help="skip the checks against the trainer")
    run.add_argument(
        "--no-checksums",
        action="store_true",
        help="receivers skip verifying the trainer's checksums (WSUM-64 on the GPU)",
    )
    run.add_argument(
        "--publish-start",
        action="store_true",
        help="the trainer publishes its start-up weights (--refit-publish-start) and the "
        "receiver installs them before the first step, as a new replica does",
    )
    run.add_argument(
        "--no-expect",
        action="store_true",
        help="receivers ask for a version once told of it, not before its step "
        "(Receiver.expect, as a follower does)",
    )
    run.add_argument(
        "--not-before-readable",
        action="store_true",
        help="a version asked for ahead is leased once readable, not at its slot's "
        "reservation (RefitOptions.direct.read_before_readable off)",
    )
    run.add_argument(
        "--not-behind-copy",
        action="store_true",
        help="a version leased before it is readable is read once the trainer's whole "
        "snapshot copy landed, not piece by piece behind it "
        "(RefitOptions.direct.read_behind_copy off)",
    )
    run.add_argument(
        "--first-piece-bytes",
        type=int,
        default=DEFAULT_FIRST_PIECE_BYTES,
        help="the trainer's --refit-first-piece-bytes (0: the copy in one piece)",
    )
    run.add_argument(
        "--requests-in-flight",
        type=int,
        default=DEFAULT_REQUESTS_IN_FLIGHT,
        help="READ requests of a direct pull in flight at once (0: all; default: the "
        "receivers' default)",
    )
    run.add_argument(
        "--request-taper",
        type=int,
        default=0,
        help="halvings of a direct pull's last (and first) requests and check parts",
    )
    run.add_argument(
        "--trace",
        action="store_true",
        help="receivers record each pull's timeline (diagnosis): where a direct pull's set-up "
        "went; through the tree (refit_fanout), when each level saw its parent's last fill",
    )
    run.add_argument(
        "--install",
        choices=sorted(INSTALLS),
        default="in-place",
        help="how the direct receiver installs: "
        + "; ".join(f"{k}: {v}" for k, v in INSTALLS.items()),
    )
    run.add_argument("--lr", type=float, default=1e-5)
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument(
        "--timeout", type=float, default=600.0, help="seconds for a start or a request"
    )
    run.add_argument(
        "--refit-timeout", type=float, default=120.0, help="seconds for one refit's pull"
    )
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("runs/refit_install.json"))
    out.add_argument("--log-dir", type=Path, help="default: beside --out")
    out.add_argument(
        "--work-dir",
        type=Path,
        help="the run's files: model, tokens, the trainer's work dir (default: a temporary one)",
    )
    out.add_argument(
        "--trainer-log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    p.add_argument("--receiver-settings", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--command-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--reply-fd", type=int, help=argparse.SUPPRESS)
    return p


def resolve(args: argparse.Namespace) -> RunConfig:
    values = {k: getattr(args, k) for k in vars(args) if getattr(args, k) is not None}
    values = {**PRESETS[args.preset], **values}
    if "device" not in values:
        import torch  # only to pick the default device

        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    values.setdefault("params_dtype", "bfloat16" if values["device"] == "cuda" else "float32")
    values.setdefault("warmup", values["slots"])
    values.setdefault("log_dir", args.out.parent)
    values.setdefault("work_dir", None)
    values["verify"] = not values.pop("no_verify")
    values["checksums"] = not values.pop("no_checksums")
    values["expect"] = not values.pop("no_expect")
    values["before_readable"] = not values.pop("not_before_readable")
    values["behind_copy"] = not values.pop("not_behind_copy")
    values.setdefault("head_dim", None)  # dense presets: hidden / heads
    values.setdefault("experts", None)
    config = RunConfig(**{f.name: values[f.name] for f in fields(RunConfig)})
    if config.seq_len > config.max_positions:
        raise SystemExit(
            f"--seq-len {config.seq_len} exceeds --max-positions {config.max_positions}"
        )
    if config.steps < 1 or config.slots < 1 or config.warmup < (0 if config.publish_start else 1):
        raise SystemExit(
            "--steps and --slots must be >= 1, and --warmup too unless --publish-start (the "
            "first refit sets the receiver up)"
        )
    return config


def gpus() -> list[str]:
    """The machine's GPUs by name (`nvidia-smi`; none where it is missing): the cards a
    result was measured on, without starting CUDA in the driver."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.splitlines() if line.strip()]


def write_model(path: Path, config: RunConfig) -> Path:
    if config.experts is not None:
        return write_config_model(path, config.moe_spec, config.params_dtype)
    return _write_model(path, argparse.Namespace(**asdict(config), hf_weights=False))


def receiver_settings(
    config: RunConfig, sidecar: str, token_file: Path, model_dir: Path
) -> ReceiverSettings:
    """A receiver on `--dest-gpu` (or the CPU) for this run's model and sidecar."""
    return ReceiverSettings(
        sidecar=sidecar,
        token_file=str(token_file),
        model_dir=str(model_dir),
        params_dtype=config.params_dtype,
        dest=f"cuda:{config.dest_gpu}" if config.cuda else "cpu",
        source="cuda:0" if config.cuda else "cpu",
        timeout_s=config.refit_timeout,
        checksums=config.checksums,
        before_readable=config.before_readable,
        behind_copy=config.behind_copy,
        requests_in_flight=config.requests_in_flight,
        install=config.install,
        request_taper=config.request_taper,
        trace=config.trace,
    )


def run(config: RunConfig, work: Path) -> dict[str, Any]:
    model_dir = write_model(work / "model", config)
    batches = make_batches(asdict(config))
    logs = config.log_dir
    tokens = tokens_for(work)
    orchestrator = tokens.client(Role.ORCHESTRATOR)
    root = trainer_root(work)  # the trainer's path root: `verify` exports there
    with contextlib.ExitStack() as stack:
        sidecar = stack.enter_context(
            sidecar_server(work, logs / "sidecar.log", config.timeout, tokens)
        )
        settings = receiver_settings(config, sidecar, tokens.file(Role.RECEIVER), model_dir)
        # Started first: its setup (imports, model build) overlaps the trainer's start.
        receiver = stack.enter_context(receiver_process(settings, work, logs / "receiver.log"))
        trainer_args = [
            *config.trainer_args(model_dir),
            *tokens.publisher_args(sidecar),
            *tokens.server_args(),
            *("--work-dir", str(root)),
        ]
        log.info("trainer args: %s", " ".join(trainer_args))
        plan = dict(trainer_args=trainer_args, timeout_s=config.timeout)
        target, startup_s = stack.enter_context(
            trainer_server(plan, work, logs / "trainer.log", auth=orchestrator)
        )
        ready = receiver.reply(config.timeout)
        log.info("receiver ready: %s", ready)
        with TrainerClient(target, auth=orchestrator) as client:
            status = client.status()
            startup, installed = None, None
            if config.publish_start:
                # As a replica started before the first step: the start-up version installed,
                # timed from the request (its set-up: connection, registration, plan).
                receiver.send("refit", version=status.weights_version, finished_at=time.monotonic())
                startup = receiver.reply(config.refit_timeout + 30)
                log.info("start-up version installed in %.1f ms", 1e3 * startup["latency_s"])
                installed = status.weights_version
            records = run_refits(client, receiver, batches, config, installed)
            check = verify(client, receiver, root, config) if config.verify else None
        receiver.stop()
    return dict(
        receiver=ready,
        trainer=dict(
            startup_s=startup_s,
            num_parameters=status.model.num_parameters,
            device=status.device,
            refit_snapshot_bytes=status.refit_snapshot_bytes,
            args=trainer_args,
        ),
        records=records,
        startup=startup,
        check=check,
    )


def _meta(config: RunConfig, argv: list[str] | None) -> dict[str, Any]:
    return dict(
        run_meta("benchmarks.refit_install", argv),
        config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        gpus=gpus(),
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.receiver_settings is not None:
        receiver_main(args.receiver_settings, args.command_fd, args.reply_fd)
        return
    config = resolve(args)
    # Stopped from outside, still stop the sidecar, trainer and receiver this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [bench] %(levelname)s %(message)s")
    config.log_dir.mkdir(parents=True, exist_ok=True)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="refit-install-bench-") as scratch:
        work = (config.work_dir or Path(scratch)).absolute()
        work.mkdir(parents=True, exist_ok=True)
        result = run(config, work)
    summary = summarize(result["records"], config.slots, result["startup"])
    output = dict(meta=_meta(config, argv), summary=summary, **result)
    config.out.write_text(json.dumps(output, indent=1) + "\n")
    print_summary(summary, result["check"], result["receiver"])
    print(f"results: {config.out}")


if __name__ == "__main__":
    main()
