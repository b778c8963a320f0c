"""The per-rank step engine: every rank applies the same commands in the same order.

Rank 0 calls ``precheck`` before broadcasting a command, so a request that would fail is refused
before any rank changes anything. ``execute`` then runs the command's collectives on every rank;
results that live elsewhere (the last pipeline stage) are brought to rank 0. Its outcome is agreed
by every rank (`runtime/agreement.py`): a command that fails on any rank fails on all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads

from megatron_hf.spec import ModelSpec
from refit_sidecar.core.errors import PublicationPending, SlotsExhausted
from trainer_refit.errors import quoted
from trainer_svc.config import OptimizerConfig, SequenceLayout
from trainer_svc.domain import (
    NO_VERSION,
    AlreadyExists,
    ExpertLoad,
    ExportDType,
    FailedPrecondition,
    ForwardOutput,
    ForwardResult,
    InvalidArgument,
    LossConfig,
    LossTerms,
    Normalization,
    OpenStepInfo,
    OptimizerOverrides,
    SamplerMismatch,
    SequenceBatch,
    StaleData,
    StalenessBound,
    StepCounts,
    StepGradient,
    StepMetrics,
)
from trainer_svc.runtime import commands as cmd
from trainer_svc.runtime import cpu_compat, documents, expert_lockstep
from trainer_svc.runtime.agreement import CommandFailed, phase
from trainer_svc.runtime.checkpointing import Checkpointer, TrainingState
from trainer_svc.runtime.finite import Contents, contents
from trainer_svc.runtime.hf_export import ExportSettings
from trainer_svc.runtime.losses import MAX_FIELDS, SUM_FIELDS, loss_sums
from trainer_svc.runtime.model_factory import BuiltModel
from trainer_svc.runtime.model_runner import ModelRunner
from trainer_svc.runtime.packing import PackedBatch, assign_to_data_parallel, pack
from trainer_svc.runtime.passes import split_passes
from trainer_svc.runtime.publication import Publisher, describe
from trainer_svc.runtime.reference_policy import ReferencePolicy
from trainer_svc.runtime.routing_replay import RoutingReplay
from trainer_svc.runtime.topology import Topology
from trainer_svc.runtime.vocab_parallel import VocabShard, target_logprobs, top_k
from trainer_svc.validation import BatchLimits, check_id, check_sequences, check_training_batch

_EXPORT_DTYPES = {ExportDType.BFLOAT16: torch.bfloat16, ExportDType.FLOAT32: torch.float32}

log = logging.getLogger(__name__)


@dataclass
class _OpenStep:
    step_id: str
    loss: LossConfig
    optimizer: OptimizerOverrides
    counts: StepCounts = field(default_factory=StepCounts)
    request_ids: dict[str, bytes] = field(default_factory=dict)
    """Each applied microbatch's request_id and (on rank 0, which answers duplicates) the
    digest of its batch."""
    sums: torch.Tensor | None = None
    """The loss sums (SUM_FIELDS, float64) on the device, added to without a host
    synchronization: read back once, at FinishTrainStep."""
    maxima: torch.Tensor | None = None
    """Likewise the MAX_FIELDS, kept by maximum."""
    staleness: StalenessBound | None = None
    behind: dict[int, int] = field(default_factory=dict)
    """Sequences by how many versions behind the step's weights they were sampled."""


@dataclass(frozen=True)
class MicrobatchAck:
    step_id: str
    request_id: str
    duplicate: bool
    counts: StepCounts


@dataclass(frozen=True)
class _StepTotals:
    """A finishing step's figures over every rank."""

    sums: dict[str, float]
    """The loss sums (SUM_FIELDS) and maxima (MAX_FIELDS)."""
    non_finite_ranks: int
    """Ranks whose gradient buffers hold inf or NaN: the step is refused."""
    nonzero_ranks: int
    """Ranks whose gradient buffers hold a non-zero value: 0 means the step's reduced gradient
    is exactly zero. (With the distributed optimizer a rank also keeps its unreduced gradients
    outside its shard, so a zero gradient counts as non-zero only if data-parallel ranks'
    gradients cancel exactly, never the other way round.)"""


@dataclass(frozen=True)
class FinishResult:
    step_id: str
    metrics: StepMetrics
    weights_version: int


class StepEngine:
    def __init__(
        self,
        *,
        built: BuiltModel,
        spec: ModelSpec,
        topology: Topology,
        limits: BatchLimits,
        optimizer_defaults: OptimizerConfig,
        padded_vocab: int,
        device: torch.device,
        checkpointer: Checkpointer,
        publisher: Publisher | None = None,
        pass_tokens: int | None = None,
        layout: SequenceLayout = SequenceLayout.PADDED,
        reference: ReferencePolicy | None = None,
    ) -> None:
        """`pass_tokens`: tokens per forward/backward pass (`passes.py`; None: the request
        limit). `layout`: whether a pass's sequences go in as one packed row (`packing.py`),
        as `documents.resolve` settled it.
        `reference`: frozen weights for reference logprobs computed here."""
        self.built = built
        self.spec = spec
        self.topology = topology
        self.limits = limits
        self.optimizer_defaults = optimizer_defaults
        self.padded_vocab = padded_vocab
        self.device = device
        self.checkpointer = checkpointer
        self.training = TrainingState(
            model=built.model, optimizer=built.optimizer, spec=spec, topology=topology
        )
        self.publisher = publisher
        self.pass_tokens = pass_tokens or limits.max_tokens
        self.layout = layout
        self._shard = (
            (topology.tp_rank, topology.layout.tensor_parallel)
            if built.config.sequence_parallel
            else (0, 1)
        )
        """This rank's part of every pass's positions (`packing.pack`)."""
        self.reference = reference
        self.routing = (
            RoutingReplay(built.model, built.config.moe_router_topk)
            if built.config.num_moe_experts
            else None
        )
        self.runner = ModelRunner(
            built.ddp, device, before_pass=built.balancing.set_pass if built.balancing else None
        )
        local_vocab = padded_vocab // topology.layout.tensor_parallel
        self.vocab_shard = VocabShard(
            start=topology.tp_rank * local_vocab,
            end=(topology.tp_rank + 1) * local_vocab,
            vocab_size=spec.vocab_size,
            tp_group=topology.tp_group,
            tp_size=topology.layout.tensor_parallel,
        )
        self.weights_version = 0
        self.optimizer_step = 0
        self.open_step: _OpenStep | None = None
        self._refused_reservation: int | None = None
        """The version whose refit slot a refused LoadCheckpoint reserved, until the next
        version is made: a load that publishes it again gets the same slot, a step that does
        not publish it hands it back (`_publish`)."""

    # -- checks on rank 0, before anything is broadcast ------------------------------------

    def open_step_info(self) -> OpenStepInfo | None:
        step = self.open_step
        if step is None:
            return None
        return OpenStepInfo(step_id=step.step_id, loss=step.loss, counts=step.counts)

    def _require_open(self, step_id: str, action: str) -> _OpenStep:
        if self.open_step is None:
            raise FailedPrecondition(
                f"{action} for step {quoted(step_id)}, but no step is open: call "
                "BeginTrainStep first"
            )
        if self.open_step.step_id != step_id:
            raise FailedPrecondition(
                f"{action} for step {quoted(step_id)}, but the open step is "
                f"{quoted(self.open_step.step_id)}"
            )
        return self.open_step

    def precheck(self, command: cmd.Command) -> Any | None:
        """Raises for a command that must not run; returns a reply for one that needs no ranks."""
        match command:
            case cmd.BeginStep(step_id=step_id, loss=loss):
                check_id(step_id, "step_id")
                service_reference = loss.needs_reference and not loss.needs_reference_logprobs
                if service_reference and self.reference is None:
                    raise FailedPrecondition(
                        "this service keeps no reference weights for the KL term: start "
                        "trainer-svc with --reference-policy initial, or send "
                        "reference_logprobs (reference_source CLIENT)"
                    )
                if self.open_step is not None:
                    raise FailedPrecondition(
                        f"step {quoted(self.open_step.step_id)} is still open: finish or abort "
                        f"it before beginning step {quoted(step_id)}"
                    )
            case cmd.TrainMicrobatch(step_id=step_id, request_id=request_id):
                step = self._require_open(step_id, "TrainMicrobatch")
                check_id(request_id, "request_id")
                if request_id in step.request_ids:
                    return self._duplicate(step, command)
                check_training_batch(command.batch, step.loss, self.limits)
                self._check_staleness(command.batch, step)
                self._check_routing(command.batch, want=False)
            case cmd.RunForward(batch=batch, outputs=outputs, top_k=k):
                check_sequences(batch, self.limits)
                self._check_routing(batch, want=ForwardOutput.ROUTED_EXPERTS in outputs)
                if ForwardOutput.REFERENCE_LOGPROBS in outputs and self.reference is None:
                    raise FailedPrecondition(
                        "this service keeps no reference weights: start trainer-svc with "
                        "--reference-policy initial to ask Forward for REFERENCE_LOGPROBS"
                    )
                if ForwardOutput.TOP_K in outputs and not 1 <= k <= self.spec.vocab_size:
                    raise InvalidArgument(
                        f"top_k must lie in [1, {self.spec.vocab_size}] when TOP_K is asked for, "
                        f"got {k}",
                        field="top_k",
                    )
            case cmd.FinishStep(step_id=step_id):
                step = self._require_open(step_id, "FinishTrainStep")
                if step.counts.valid_tokens == 0:
                    raise FailedPrecondition(
                        f"step {quoted(step_id)} has no valid tokens to train on "
                        f"({step.counts.microbatches} microbatches): send microbatches with "
                        "loss_mask set, or abort the step"
                    )
            case cmd.AbortStep(step_id=step_id):
                if self.open_step is None:
                    return False
                if self.open_step.step_id != step_id:
                    raise FailedPrecondition(
                        f"cannot abort step {quoted(step_id)}: the open step is "
                        f"{quoted(self.open_step.step_id)}"
                    )
            case cmd.SetReference():
                if self.reference is None:
                    raise FailedPrecondition(
                        "this service keeps no reference weights: start trainer-svc with "
                        "--reference-policy initial to set them"
                    )
                if self.open_step is not None:
                    raise FailedPrecondition(
                        f"step {quoted(self.open_step.step_id)} is open: finish or abort it "
                        "before setting the reference weights (its microbatches used the old)"
                    )
            case cmd.LoadCheckpoint(path=path):
                if self.open_step is not None:
                    raise FailedPrecondition(
                        f"step {quoted(self.open_step.step_id)} is open: finish or abort it "
                        "before loading a checkpoint"
                    )
                self.checkpointer.check_loadable(path)
            case cmd.SaveCheckpoint(path=path):
                self.checkpointer.check_savable(path)
            case cmd.ExportHF(path=path):
                self.checkpointer.check_exportable(path)
            case cmd.PublishStart():
                if self.publisher is None or self.weights_version != 0:
                    raise FailedPrecondition(
                        "the start-up weights are published by a trainer with a sidecar, as its "
                        f"first version; this one is at version {self.weights_version}"
                    )
        return None

    def projected_answer(self, command: cmd.BeginStep | cmd.TrainMicrobatch) -> Any:
        """The answer a checked command gets before it runs: for a BeginTrainStep the weights
        version it trains from, for a new microbatch the step's counts with it applied."""
        if isinstance(command, cmd.BeginStep):
            return self.weights_version
        step = self._require_open(command.step_id, "TrainMicrobatch")
        counts = step.counts.plus(command.batch)
        return MicrobatchAck(step.step_id, command.request_id, False, counts)

    @staticmethod
    def _duplicate(step: _OpenStep, command: cmd.TrainMicrobatch) -> MicrobatchAck:
        """A request_id the step applied already: acknowledged again when it carries the same
        batch, refused when it carries another (a client reusing an id for new data)."""
        if step.request_ids[command.request_id] != command.batch.digest():
            raise AlreadyExists(
                f"request_id {quoted(command.request_id)} was applied in step "
                f"{quoted(step.step_id)} with different data (tokens, offsets, masks or "
                "per-token inputs); nothing was changed: give new data a new request_id"
            )
        return MicrobatchAck(step.step_id, command.request_id, True, step.counts)

    def prepare(self, command: cmd.Command) -> cmd.Command:
        """Rank 0, after precheck: reserves the refit slot of the version a checkpoint load,
        or a finish that publishes (`RefitConfig.publish_every`), or the start-up weights' will
        make, before any rank changes anything (a refusal leaves the trainer unchanged)."""
        publishing = cmd.FinishStep | cmd.LoadCheckpoint | cmd.PublishStart
        if not isinstance(command, publishing) or self.publisher is None:
            return command
        if isinstance(command, cmd.FinishStep) and not self.publisher.publishes(
            self.weights_version + 1
        ):
            return command
        try:
            slot = cmd.Reservation(*self.publisher.reserve(self.weights_version + 1))
        except (SlotsExhausted, PublicationPending) as exc:
            raise FailedPrecondition(f"cannot publish the new version: {exc}") from exc
        except Exception as exc:  # the sidecar is unreachable or failed: nothing changed
            problem = self.publisher.health_problem or describe(exc, "reserving a refit slot")
            raise FailedPrecondition(
                f"cannot publish the new version ({problem}); nothing changed: retry when "
                "the refit sidecar is back"
            ) from exc
        return replace(command, slot=slot)

    def _fence(self) -> None:
        """Before the parameters change (the optimizer's update, a checkpoint's load), and
        only then: the last version's snapshot copy reads them on its side stream while the
        next step's passes, which only read them too, run beside it."""
        if self.publisher is not None:
            self.publisher.fence()

    def _publish(self, slot: cmd.Reservation | None) -> None:
        """Publishes the current weights as `weights_version` into the reserved slot (none:
        a step that does not publish, `RefitConfig.publish_every`)."""
        if self.publisher is None:
            return
        refused, self._refused_reservation = self._refused_reservation, None
        if slot is None:
            if refused == self.weights_version and self.topology.is_leader:
                # The sidecar still holds the slot a refused LoadCheckpoint reserved for this
                # version; unpublished, it would stay "being published" and block every later
                # reservation. The next reservation retires it.
                self.publisher.book.failed(
                    self.weights_version, "reserved by a refused LoadCheckpoint"
                )
            self.publisher.made(self.weights_version)
            return
        start = time.perf_counter()
        self.publisher.publish(self.weights_version, slot.slot, slot.generation)
        log.debug(
            "refit: version %d queued for slot %d in %.3f ms",
            self.weights_version,
            slot.slot,
            1e3 * (time.perf_counter() - start),
        )

    # -- execution on every rank ------------------------------------------------------------

    def execute(self, command: cmd.Command) -> Any:
        """Runs the command on this rank; raises `CommandFailed` on every rank if it failed on
        any."""
        return phase(self.topology, lambda: self._execute(command))

    def _execute(self, command: cmd.Command) -> Any:
        match command:
            case cmd.BeginStep():
                return self._begin(command)
            case cmd.TrainMicrobatch():
                return self._microbatch(command)
            case cmd.FinishStep():
                return self._finish(command)
            case cmd.AbortStep():
                return self._abort(command)
            case cmd.RunForward():
                return self._forward(command)
            case cmd.SetReference():
                assert self.reference is not None  # the precheck's
                self.reference.capture()
                return self.weights_version
            case cmd.SaveCheckpoint(path=path):
                return self.checkpointer.save(
                    path,
                    self.training,
                    weights_version=self.weights_version,
                    optimizer_step=self.optimizer_step,
                )
            case cmd.LoadCheckpoint(path=path, slot=slot):
                # Every rank reads the checkpoint into staging and checks it; only once every
                # rank has, does any rank change its weights, optimizer state and version.
                try:
                    read = self.checkpointer.read(path, self.training)
                except CommandFailed:
                    if slot is not None:
                        self._refused_reservation = self.weights_version + 1
                    raise
                self._fence()
                read.install(self.training)
                self.optimizer_step = read.optimizer_step
                self.weights_version += 1
                self._publish(slot)
                return self.weights_version, self.optimizer_step
            case cmd.ExportHF(path=path, dtype=dtype, max_file_bytes=max_file_bytes):
                settings = ExportSettings(_EXPORT_DTYPES.get(dtype), max_file_bytes)
                return self.checkpointer.export_hf(
                    path, self.training, weights_version=self.weights_version, settings=settings
                )
            case cmd.PublishStart(slot=slot):
                self.weights_version += 1
                self._publish(slot)
                return self.weights_version
            case cmd.Shutdown():
                return None
        raise TypeError(f"unknown command {command!r}")

    def _zero_grads(self) -> None:
        self.built.ddp.zero_grad_buffer()
        self.built.optimizer.zero_grad()

    def _begin(self, command: cmd.BeginStep) -> int:
        self._zero_grads()
        if self.built.balancing is not None:
            self.built.balancing.take()  # an account is the step's own
        self.open_step = _OpenStep(
            command.step_id, command.loss, command.optimizer, staleness=command.staleness
        )
        return self.weights_version

    def _passes(self, local: Any) -> list[Any]:
        """This rank's share cut into passes of at most `pass_tokens` tokens (none when the
        share is empty)."""
        if not local.num_sequences:
            return []
        padded = self.layout is SequenceLayout.PADDED
        groups = split_passes(local.lengths(), self.pass_tokens, padded=padded)
        return [local] if len(groups) == 1 else [local.select(g) for g in groups]

    def _local_share(self, command_batch: Any) -> Any:
        parts = assign_to_data_parallel(command_batch.lengths(), self.topology.layout.data_parallel)
        return command_batch.select(parts[self.topology.dp_rank])

    def _microbatch(self, command: cmd.TrainMicrobatch) -> MicrobatchAck:
        step = self.open_step
        assert step is not None and step.step_id == command.step_id
        batch = command.batch
        sampled = batch.sampled_versions()
        if sampled is not None:
            behind = np.where(sampled == NO_VERSION, -1, self.weights_version - sampled)
            # A sequence counts at its oldest token's version.
            oldest = np.maximum.reduceat(behind, batch.offsets[:-1])
            for versions in oldest[oldest >= 0].tolist():
                step.behind[versions] = step.behind.get(versions, 0) + 1
            bound = step.staleness
            if bound is not None and bound.stale is StaleData.MASK:
                batch = batch.without_tokens(behind > bound.max_versions)
        local = self._local_share(batch)
        loss = step.loss

        def loss_function(batch: PackedBatch, logits: torch.Tensor) -> Any:
            logprobs, entropy = target_logprobs(
                logits,
                batch.targets,
                self.vocab_shard,
                with_entropy=loss.entropy_coef > 0 or loss.corrects_sampler,
            )
            sums = loss_sums(logprobs, batch.token_inputs, loss, entropy)
            count = sums["valid_tokens"].detach().to(torch.int)
            return sums["loss"], count, {k: v.detach() for k, v in sums.items()}

        def filler_loss(batch: PackedBatch, logits: torch.Tensor) -> Any:
            value, count, _ = loss_function(batch, logits)
            return value * 0.0, count * 0, {}

        # Gradients and loss sums accumulate over the passes as over microbatches.
        for part, real in expert_lockstep.aligned(self._passes(local), batch, self.topology):
            packed = pack(
                part,
                self.device,
                packed=documents.packs(self.layout, part.lengths()),
                shard=self._shard,
            )
            if packed is None:  # nothing to predict: one-token sequences only
                continue
            if loss.needs_reference and not loss.needs_reference_logprobs:
                assert self.reference is not None  # BeginStep's precheck
                with self._replaying(packed, part):
                    reference = self.reference.logprobs(self.runner, packed, self._score)
                packed.token_inputs.reference_logprobs = reference
            run_loss = loss_function if real else filler_loss
            with self._replaying(packed, part):
                outputs = self.runner.run(packed, run_loss, forward_only=False, trains=real)
            if not real:
                continue
            if self.topology.is_last_stage and self.topology.tp_rank == 0:
                for sums in outputs:
                    values = torch.stack([sums[k].to(torch.float64) for k in SUM_FIELDS])
                    step.sums = values if step.sums is None else step.sums + values
                    peaks = torch.stack([sums[k].to(torch.float64) for k in MAX_FIELDS])
                    step.maxima = (
                        peaks if step.maxima is None else torch.maximum(step.maxima, peaks)
                    )
        # Only rank 0 answers duplicates (`precheck`): the other ranks skip hashing the batch.
        digest = command.batch.digest() if self.topology.is_leader else b""
        step.request_ids[command.request_id] = digest
        step.counts = step.counts.plus(batch)
        return MicrobatchAck(command.step_id, command.request_id, False, step.counts)

    def _score(self, batch: PackedBatch, logits: torch.Tensor) -> torch.Tensor:
        """The targets' logprobs of a pass's logits (the reference policy's forward)."""
        return target_logprobs(logits, batch.targets, self.vocab_shard)[0]

    def _check_staleness(self, batch: SequenceBatch, step: _OpenStep) -> None:
        """Each token's sampled version is at most the step's; with a bound, every trained
        token needs one (its sequence's or its span's), and a refusing bound refuses a
        microbatch with a token past it."""
        versions, bound, current = batch.weights_versions, step.staleness, self.weights_version
        if versions is not None and len(versions) != batch.num_sequences:
            raise InvalidArgument(
                f"weights_versions has {len(versions)} entries for {batch.num_sequences} "
                "sequences: one per sequence",
                field="weights_versions",
            )
        sampled = batch.sampled_versions()
        if sampled is None:
            if bound is not None:
                raise InvalidArgument(
                    f"weights_versions is required: step {quoted(step.step_id)} bounds "
                    f"staleness at {bound.max_versions} versions; send one per sequence "
                    f"({batch.num_sequences}) or weights_version_spans",
                    field="weights_versions",
                )
            return
        if (sampled > current).any():
            sequence, token = self._locate(batch, int(np.argmax(sampled > current)))
            raise InvalidArgument(
                f"token {token} of sequence {sequence} names weights version "
                f"{int(sampled[batch.offsets[sequence] + token])}, after the step's weights "
                f"(version {current})",
                field="weights_version_spans" if versions is None else "weights_versions",
            )
        if bound is None:
            return
        trained = batch.loss_mask if batch.loss_mask is not None else np.ones_like(sampled, bool)
        unnamed = trained & (sampled == NO_VERSION)
        if unnamed.any():
            sequence, token = self._locate(batch, int(np.argmax(unnamed)))
            raise InvalidArgument(
                f"token {token} of sequence {sequence} trains but no weights version names "
                f"it: step {quoted(step.step_id)} bounds staleness at {bound.max_versions} "
                "versions",
                field="weights_version_spans",
            )
        if bound.stale is not StaleData.REFUSE:
            return
        stale = trained & (current - sampled > bound.max_versions)
        if stale.any():
            flat = int(np.argmax(stale))
            sequence, token = self._locate(batch, flat)
            version = int(sampled[flat])
            raise FailedPrecondition(
                f"sequence {sequence} was sampled with weights version {version} (at token "
                f"{token}), {current - version} versions behind step {quoted(step.step_id)}'s "
                f"weights (version {current}), past its max_staleness of {bound.max_versions}: "
                "the microbatch is refused and changes nothing (a step begun with stale_data "
                "MASK trains the rest instead)"
            )

    @staticmethod
    def _locate(batch: SequenceBatch, flat: int) -> tuple[int, int]:
        """(sequence, position in it) of flat token `flat`."""
        sequence = int(np.searchsorted(batch.offsets, flat, side="right")) - 1
        return sequence, flat - int(batch.offsets[sequence])

    def _divisor(self, step: _OpenStep) -> int:
        normalization = step.loss.normalization
        if normalization is Normalization.TOKEN:
            return step.counts.valid_tokens
        if normalization is Normalization.CONSTANT:
            return step.loss.normalization_length * step.counts.sequences
        return step.counts.valid_sequences

    def _apply_hyperparameters(self, overrides: OptimizerOverrides) -> OptimizerConfig:
        defaults = self.optimizer_defaults
        chosen = replace(
            defaults,
            **{k: v for k, v in vars(overrides).items() if v is not None},
        )
        optimizer = self.built.optimizer
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner.config.clip_grad = chosen.max_grad_norm
            for group in inner.param_groups:
                group["lr"] = chosen.learning_rate * group.get("lr_mult", 1.0)
                group["weight_decay"] = chosen.weight_decay * group.get("wd_mult", 1.0)
                if "betas" in group:
                    group["betas"] = (chosen.adam_beta1, chosen.adam_beta2)
                if "eps" in group:
                    group["eps"] = chosen.adam_eps
        return chosen

    def _gradient_contents(self) -> Contents:
        """Whether this rank's gradient buffers hold only finite values, and only zeros."""
        ddp = self.built.ddp
        return contents([b.grad_data for b in ddp.buffers + ddp.expert_parallel_buffers])

    def _global_sums(self, step: _OpenStep) -> _StepTotals:
        """The step's loss sums over every rank, and how many ranks hold a non-finite or a
        non-zero gradient (one all-reduce for all; a second, by maximum, for the sampler
        ratio's extremes with a correction)."""
        sums = [0.0] * len(SUM_FIELDS) if step.sums is None else step.sums.tolist()
        gradient = self._gradient_contents()
        local = [*sums, float(not gradient.finite), float(not gradient.zero)]
        totals = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(totals, group=self.topology.control_group)
        *values, non_finite, nonzero = totals.tolist()
        maxima = dict.fromkeys(MAX_FIELDS, 0.0)
        if step.loss.corrects_sampler:  # one more reduction, only where there is a maximum
            peaks = torch.full((len(MAX_FIELDS),), -math.inf, dtype=torch.float64)
            if step.maxima is not None:
                peaks = step.maxima.to("cpu")
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=self.topology.control_group)
            maxima = dict(zip(MAX_FIELDS, peaks.tolist(), strict=True))
        return _StepTotals(
            sums={**dict(zip(SUM_FIELDS, values, strict=True)), **maxima},
            non_finite_ranks=int(non_finite),
            nonzero_ranks=int(nonzero),
        )

    def _refuse_non_finite(self, step: _OpenStep, loss: float, bad_ranks: int) -> NoReturn:
        """Every rank has the same sums and count, so every rank refuses together, before the
        optimizer runs: the step is closed as failed (its gradients dropped, as by an abort)."""
        self._zero_grads()
        self.open_step = None
        reason = (
            f"its gradients are not finite on {bad_ranks} ranks (loss {loss})"
            if bad_ranks
            else f"its loss is not finite ({loss})"
        )
        raise FailedPrecondition(
            f"step {quoted(step.step_id)} was not applied: {reason}; weights, optimizer state and "
            f"weights version {self.weights_version} are unchanged and the step is closed: "
            "begin a new step"
        )

    def _finish(self, command: cmd.FinishStep) -> FinishResult:
        step = self.open_step
        assert step is not None and step.step_id == command.step_id
        divisor = self._divisor(step)
        chosen = self._apply_hyperparameters(step.optimizer)
        with cpu_compat.active():
            finalize_model_grads([self.built.ddp])
            self.built.ddp.scale_gradients(1.0 / divisor)
        totals = self._global_sums(step)
        sums = totals.sums
        if totals.non_finite_ranks or not math.isfinite(sums["loss"]):
            self._refuse_non_finite(step, sums["loss"] / divisor, totals.non_finite_ranks)
        with cpu_compat.active():
            # No host synchronization after the update unless asked for: the answer goes out
            # while the GPU applies it, so the client's next round trips overlap it. Every
            # later command runs on this stream after the update, and the publication's
            # snapshot copy waits for it on its own stream (`publication.snapshot`): the
            # version becomes readable once the update and the copy are done.
            self._fence()
            _, grad_norm, _ = self.built.optimizer.step()
            if command.wait_for_update and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self.open_step = None
        self.weights_version += 1
        self.optimizer_step += 1
        self._publish(command.slot)
        tokens = max(sums["valid_tokens"], 1.0)
        terms = LossTerms(
            policy=sums["policy"] / divisor,
            kl=sums["kl"] / divisor,
            clip_fraction=sums["clipped_tokens"] / tokens,
            importance_ratio=sums["ratio"] / tokens,
            entropy=sums["entropy"] / tokens,
            sampler=SamplerMismatch(
                ratio_mean=sums["sampler_ratio"] / tokens,
                ratio_min=-sums["sampler_ratio_neg_min"],
                ratio_max=sums["sampler_ratio_max"],
                corrected_fraction=sums["corrected_tokens"] / tokens,
                kl=sums["mismatch_kl"] / tokens,
            )
            if step.loss.corrects_sampler
            else None,
        )
        balance, load = self._routing()
        terms = dataclasses.replace(terms, load_balancing=balance)
        metrics = StepMetrics(
            loss=sums["loss"] / divisor,
            terms=terms,
            grad_norm=float(grad_norm or 0.0),
            learning_rate=chosen.learning_rate,
            counts=step.counts,
            gradient=StepGradient.NONZERO if totals.nonzero_ranks else StepGradient.ZERO,
            staleness=tuple(sorted(step.behind.items())),
            expert_load=load,
        )
        return FinishResult(step.step_id, metrics, self.weights_version)

    def _routing(self) -> tuple[float, tuple[ExpertLoad, ...]]:
        """A mixture-of-experts model's Switch loss per routed token and layer, and each
        layer's expert load, over every rank's training passes (one all-reduce); nothing for a
        dense model. Sequence-parallel, each tensor-parallel rank routes its part of the
        tokens (`SequenceBalancing` keeps the whole loss on rank 0 of each group)."""
        balancing = self.built.balancing
        if balancing is None:
            return 0.0, ()
        account = balancing.take()
        layers, experts = balancing.num_layers, self.built.config.num_moe_experts or 0
        flat = torch.zeros(2 + layers * experts, dtype=torch.float64)
        if account is not None:
            parts = (account.switch[None], account.routed[None], account.load.reshape(-1))
            flat = torch.cat(parts).cpu()  # one copy to the host
        dist.all_reduce(flat, group=self.topology.control_group)
        switch, routed = flat[0].item(), flat[1].item()
        load = flat[2:].reshape(layers, experts)
        per_layer = tuple(
            ExpertLoad(layer=i, max_tokens=float(row.max()), mean_tokens=float(row.mean()))
            for i, row in enumerate(load)
        )
        return (switch / routed if routed else 0.0), per_layer

    def _abort(self, command: cmd.AbortStep) -> bool:
        assert self.open_step is not None and self.open_step.step_id == command.step_id
        self._zero_grads()
        if self.built.balancing is not None:
            self.built.balancing.take()
        self.open_step = None
        return True

    def _forward(self, command: cmd.RunForward) -> ForwardResult | None:
        parts = assign_to_data_parallel(command.batch.lengths(), self.topology.layout.data_parallel)
        local = command.batch.select(parts[self.topology.dp_rank])
        wanted = command.outputs
        k = command.top_k

        def loss_function(batch: PackedBatch, logits: torch.Tensor) -> Any:
            result: dict[str, torch.Tensor] = {}
            logprobs, entropy = target_logprobs(
                logits,
                batch.targets,
                self.vocab_shard,
                with_entropy=ForwardOutput.ENTROPY in wanted,
            )
            result["logprobs"] = logprobs
            if entropy is not None:
                result["entropy"] = entropy
            if ForwardOutput.TOP_K in wanted:
                result["top_k_ids"], result["top_k_logprobs"] = top_k(logits, k, self.vocab_shard)
            zero = logprobs.sum() * 0.0
            return zero, torch.tensor(0, dtype=torch.int), result

        # Per-token outputs of this rank's share, pass after pass (passes are consecutive); a
        # pass with nothing to predict (one-token sequences) gives zeros.
        passes: list[tuple[Any, dict[str, np.ndarray]]] = []
        routing: list[np.ndarray] = []
        """Per pass, its tokens' routing in this rank's layers (ROUTED_EXPERTS)."""
        aligned = expert_lockstep.aligned(self._passes(local), command.batch, self.topology)
        for part, real in aligned:
            packed = pack(
                part,
                self.device,
                packed=documents.packs(self.layout, part.lengths()),
                shard=self._shard,
            )
            found: dict[str, np.ndarray] = {}
            if packed is not None:
                with (
                    self._replaying(packed, part),
                    self._recording(
                        packed, part, ForwardOutput.ROUTED_EXPERTS in wanted
                    ) as recorded,
                ):
                    outputs = self.runner.run(packed, loss_function, forward_only=True)
                if ForwardOutput.REFERENCE_LOGPROBS in wanted:
                    assert self.reference is not None  # the precheck's
                    with self._replaying(packed, part):
                        reference = self.reference.logprobs(self.runner, packed, self._score)
                    if outputs and reference is not None:
                        outputs[0]["reference_logprobs"] = reference
                if outputs and real:
                    found = {
                        k: packed.per_token(v.cpu().numpy(), part) for k, v in outputs[0].items()
                    }
                if recorded and real:
                    routing.append(recorded[0])
            elif real and ForwardOutput.ROUTED_EXPERTS in wanted and self.routing is not None:
                routing.append(np.zeros((part.num_tokens, self.routing.num_layers, 1), np.int64))
            if real:
                passes.append((part, found))
        shapes = {k: v for _, found in passes for k, v in found.items()}
        rows = {
            key: np.concatenate(
                [
                    found.get(key, np.zeros((part.num_tokens, *like.shape[1:]), like.dtype))
                    for part, found in passes
                ]
            )
            for key, like in shapes.items()
        }
        contributes = self.topology.is_last_stage and self.topology.tp_rank == 0
        gathered: list[Any] | None = (
            [None] * self.topology.layout.world_size if self.topology.is_leader else None
        )
        # Each pipeline stage routes its own layers: its tensor-parallel rank 0 sends them, or,
        # sequence-parallel, every rank its part of the tokens (0 elsewhere; added up).
        routed = None
        sends = self.topology.tp_rank == 0 or self._shard[1] > 1
        if routing and self.routing is not None and sends:
            k = self.routing.top_k
            routed = (
                self.routing.first_layer,
                np.concatenate([np.broadcast_to(r, (*r.shape[:2], k)) for r in routing]),
            )
        dist.gather_object(
            (self.topology.dp_rank, rows if contributes else {}, routed)
            if contributes or routed is not None
            else None,
            gathered,
            dst=0,
            group=self.topology.control_group,
        )
        if gathered is None:
            return None
        return self._assemble_forward(command, parts, gathered)

    def _assemble_forward(
        self, command: cmd.RunForward, parts: list[np.ndarray], gathered: list[Any]
    ) -> ForwardResult:
        batch = command.batch
        per_token: dict[str, np.ndarray] = {}
        routing = self._assemble_routing(command, parts, gathered)
        for item in gathered:
            if item is None or not item[1]:
                continue
            dp_rank, rows, _ = item
            for key, values in rows.items():
                target = per_token.setdefault(
                    key, np.zeros((batch.num_tokens, *values.shape[1:]), dtype=values.dtype)
                )
                flat = np.concatenate(
                    [np.arange(batch.offsets[i], batch.offsets[i + 1]) for i in parts[dp_rank]]
                )
                target[flat] = values
        wanted = command.outputs

        def output(key: str, kind: ForwardOutput, dtype: Any, width: int = 0) -> np.ndarray | None:
            if kind not in wanted:
                return None
            shape = (batch.num_tokens, width) if width else (batch.num_tokens,)
            return per_token.get(key, np.zeros(shape, dtype=dtype)).astype(dtype)

        return ForwardResult(
            logprobs=output("logprobs", ForwardOutput.LOGPROBS, np.float32),
            entropy=output("entropy", ForwardOutput.ENTROPY, np.float32),
            top_k_token_ids=output("top_k_ids", ForwardOutput.TOP_K, np.int32, command.top_k),
            top_k_logprobs=output("top_k_logprobs", ForwardOutput.TOP_K, np.float32, command.top_k),
            top_k=command.top_k if ForwardOutput.TOP_K in wanted else 0,
            weights_version=self.weights_version,
            reference_logprobs=output(
                "reference_logprobs", ForwardOutput.REFERENCE_LOGPROBS, np.float32
            ),
            routed_experts=routing,
        )

    def _assemble_routing(
        self, command: cmd.RunForward, parts: list[np.ndarray], gathered: list[Any]
    ) -> np.ndarray | None:
        """Every stage's layers of every data-parallel share's routing, per token."""
        if ForwardOutput.ROUTED_EXPERTS not in command.outputs or self.routing is None:
            return None
        batch = command.batch
        layers = self.built.config.num_layers
        out = np.zeros((batch.num_tokens, layers, self.routing.top_k), dtype=np.int64)
        for item in gathered:
            if item is None or item[2] is None:
                continue
            dp_rank, _, (first, values) = item
            flat = np.concatenate(
                [np.arange(batch.offsets[i], batch.offsets[i + 1]) for i in parts[dp_rank]]
            )
            out[flat, first : first + values.shape[1]] += values
        return out

    def _replaying(self, packed: PackedBatch, part: SequenceBatch) -> Any:
        """The pass routed as `part.routed_experts` says, if it says (a context)."""
        if self.routing is None:
            return contextlib.nullcontext()
        return self.routing.replaying(packed, part)

    def _recording(self, packed: PackedBatch, part: SequenceBatch, wanted: bool) -> Any:
        """A context giving the pass's routing (a list, filled at its end) when `wanted`."""
        if self.routing is None or not wanted:
            return contextlib.nullcontext([])
        return self.routing.recording(packed, part)

    def _check_routing(self, batch: SequenceBatch, *, want: bool) -> None:
        """Routing to replay (or asked for) needs a mixture-of-experts model, and replayed
        routing one valid expert id per layer and top-k slot of every token."""
        if self.routing is None:
            if batch.routed_experts is not None or want:
                raise FailedPrecondition(
                    "this model has no experts: routed_experts (and the ROUTED_EXPERTS "
                    "output) are for a mixture-of-experts model"
                )
            return
        routed = batch.routed_experts
        if routed is None:
            return
        layers, k = self.built.config.num_layers, self.routing.top_k
        experts = int(self.built.config.num_moe_experts or 0)
        if routed.shape != (batch.num_tokens, layers * k):
            raise InvalidArgument(
                f"routed_experts holds {routed.size} entries for {batch.num_tokens} tokens; "
                f"the model needs num_tokens x num_layers x top_k = {batch.num_tokens} x "
                f"{layers} x {k}",
                field="routed_experts",
            )
        inputs = np.ones(batch.num_tokens, dtype=bool)
        inputs[batch.offsets[1:] - 1] = False  # a sequence's last token is no input
        used = routed[inputs]
        if used.size and (used.min() < 0 or used.max() >= experts):
            raise InvalidArgument(
                f"routed_experts names expert {int(used.max())}; the model has {experts}",
                field="routed_experts",
            )
        per_token = used.reshape(len(used), layers, k)
        if k > 1 and (np.diff(np.sort(per_token, axis=-1), axis=-1) == 0).any():
            raise InvalidArgument(
                "routed_experts names one expert twice for a token in a layer: each of its "
                f"top {k} must differ",
                field="routed_experts",
            )
