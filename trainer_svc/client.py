"""Typed Python client of the trainer service, sync and asyncio, speaking domain types.

    auth = ClientAuth(token_file=Path("tokens/orchestrator"))  # docs/security.md
    with TrainerClient("localhost:50051", auth=auth) as trainer:
        trainer.begin_step("step-1", LossConfig(kind=LossKind.PPO))
        trainer.train_microbatch("step-1", "group-0", batch)
        result = trainer.finish_step("step-1")

Refused requests raise ``InvalidArgument`` (its ``field`` names the request field at fault when
the server named one), ``FailedPrecondition`` or ``AlreadyExists`` (from trainer_svc.domain)
with the server's message; other failures raise ``grpc.RpcError``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainer_refit.auth import ClientAuth, open_aio_channel, open_channel
from trainer_refit.status_details import violated_field
from trainer_refit.v1 import trainer_pb2 as pb
from trainer_refit.v1 import trainer_pb2_grpc as pb_grpc
from trainer_svc.domain import (
    AlreadyExists,
    ExpertLoad,
    ExportDType,
    FailedPrecondition,
    ForwardOutput,
    ForwardResult,
    InvalidArgument,
    LossConfig,
    LossTerms,
    OptimizerOverrides,
    Publication,
    SamplerMismatch,
    SequenceBatch,
    StalenessBound,
    StepCounts,
    StepMetrics,
)
from trainer_svc.server.convert import loss_config_to_proto, staleness_to_proto
from trainer_svc.wire_enums import (
    EXPORT_DTYPES_TO_PROTO,
    FORWARD_OUTPUTS_TO_PROTO,
    PUBLICATION_STATES,
    STEP_GRADIENTS,
)

_MAX_MESSAGE = 256 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.max_send_message_length", _MAX_MESSAGE),
]


@dataclass(frozen=True)
class MicrobatchReceipt:
    duplicate: bool
    accumulated: StepCounts


@dataclass(frozen=True)
class StepResult:
    metrics: StepMetrics
    weights_version: int
    publication: Publication | None = None
    """The version's publication as the answer left (None: the trainer publishes nowhere)."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    weights_version: int
    optimizer_step: int


# -- requests -------------------------------------------------------------------------------


def _fill_sequences(message: pb.Sequences, batch: SequenceBatch) -> None:
    """Writes the batch into the request's own field: building a Sequences and assigning it
    would copy every token once more."""
    message.tokens.extend(batch.tokens.tolist())
    message.offsets.extend(batch.offsets.tolist())


def _fill(field: Any, values: np.ndarray | None) -> None:
    if values is not None:
        field.extend(values.tolist())


def begin_request(
    step_id: str,
    loss: LossConfig,
    optimizer: OptimizerOverrides | None,
    staleness: StalenessBound | None = None,
) -> pb.BeginTrainStepRequest:
    overrides = {k: v for k, v in vars(optimizer or OptimizerOverrides()).items() if v is not None}
    return pb.BeginTrainStepRequest(
        step_id=step_id,
        loss=loss_config_to_proto(loss),
        optimizer=pb.OptimizerParams(**overrides),
        **staleness_to_proto(staleness),
    )


def microbatch_request(
    step_id: str, request_id: str, batch: SequenceBatch
) -> pb.TrainMicrobatchRequest:
    request = pb.TrainMicrobatchRequest(step_id=step_id, request_id=request_id)
    _fill_sequences(request.sequences, batch)
    _fill(request.loss_mask, batch.loss_mask)
    _fill(request.advantages, batch.advantages)
    _fill(request.behaviour_logprobs, batch.behaviour_logprobs)
    _fill(request.reference_logprobs, batch.reference_logprobs)
    _fill(request.sampler_logprobs, batch.sampler_logprobs)
    if batch.weights_versions is not None:
        request.weights_versions.extend(int(v) for v in batch.weights_versions)
    request.weights_version_spans.extend(
        pb.WeightsVersionSpan(sequence=i, start=s.start, end=s.end, version=s.version)
        for i, s in batch.version_spans()
    )
    _fill_routing(request.routed_experts, batch)
    return request


def _fill_routing(field: Any, batch: SequenceBatch) -> None:
    if batch.routed_experts is not None:
        field.extend(np.asarray(batch.routed_experts, dtype=np.int64).reshape(-1).tolist())


def export_request(path: Path | str, dtype: ExportDType, max_file_bytes: int) -> pb.ExportHFRequest:
    return pb.ExportHFRequest(
        path=str(path), dtype=EXPORT_DTYPES_TO_PROTO[dtype], max_file_bytes=max_file_bytes
    )


def forward_request(
    batch: SequenceBatch, outputs: Iterable[ForwardOutput], top_k: int
) -> pb.ForwardRequest:
    request = pb.ForwardRequest(
        outputs=[FORWARD_OUTPUTS_TO_PROTO[o] for o in outputs],
        top_k=top_k,
    )
    _fill_sequences(request.sequences, batch)
    _fill_routing(request.routed_experts, batch)
    return request


# -- replies --------------------------------------------------------------------------------


def _counts(message: pb.StepCounts) -> StepCounts:
    return StepCounts(
        microbatches=message.microbatches,
        sequences=message.sequences,
        valid_tokens=message.valid_tokens,
        valid_sequences=message.valid_sequences,
    )


def _mismatch(message: pb.SamplerMismatch) -> SamplerMismatch:
    return SamplerMismatch(
        ratio_mean=message.ratio_mean,
        ratio_min=message.ratio_min,
        ratio_max=message.ratio_max,
        corrected_fraction=message.corrected_fraction,
        kl=message.kl,
    )


def step_result(reply: pb.FinishTrainStepResponse) -> StepResult:
    m = reply.metrics
    return StepResult(
        metrics=StepMetrics(
            loss=m.loss,
            terms=LossTerms(
                policy=m.terms.policy,
                kl=m.terms.kl,
                clip_fraction=m.terms.clip_fraction,
                importance_ratio=m.terms.importance_ratio,
                entropy=m.terms.entropy,
                sampler=_mismatch(m.terms.sampler) if m.terms.HasField("sampler") else None,
                load_balancing=m.terms.load_balancing,
            ),
            grad_norm=m.grad_norm,
            learning_rate=m.learning_rate,
            counts=_counts(m.counts),
            gradient=STEP_GRADIENTS[m.gradient],
            staleness=tuple((c.versions_behind, c.sequences) for c in m.staleness),
            expert_load=tuple(
                ExpertLoad(layer=e.layer, max_tokens=e.max_tokens, mean_tokens=e.mean_tokens)
                for e in m.expert_load
            ),
        ),
        weights_version=reply.weights_version,
        publication=_publication(reply.publication) if reply.HasField("publication") else None,
    )


def _publication(message: pb.Publication) -> Publication:
    return Publication(
        weights_version=message.weights_version,
        state=PUBLICATION_STATES[message.state],
        reason=message.reason,
    )


def publications(status: pb.GetStatusResponse) -> list[Publication]:
    """GetStatus's publications, oldest first."""
    return [_publication(p) for p in status.publications]


def forward_result(reply: pb.ForwardResponse, num_tokens: int) -> ForwardResult:
    def array(values: Any, dtype: type, width: int = 0) -> np.ndarray | None:
        if not len(values):
            return None
        out: np.ndarray = np.asarray(values, dtype=dtype)
        return out.reshape(num_tokens, width) if width else out

    return ForwardResult(
        logprobs=array(reply.logprobs, np.float32),
        entropy=array(reply.entropy, np.float32),
        top_k_token_ids=array(reply.top_k_token_ids, np.int32, reply.top_k),
        top_k_logprobs=array(reply.top_k_logprobs, np.float32, reply.top_k),
        top_k=reply.top_k,
        weights_version=reply.weights_version,
        reference_logprobs=array(reply.reference_logprobs, np.float32),
        routed_experts=np.asarray(reply.routed_experts, dtype=np.int64).reshape(
            num_tokens, -1, reply.routed_top_k
        )
        if reply.routed_top_k
        else None,
    )


def _translate(error: grpc.RpcError) -> Exception:
    code = error.code() if hasattr(error, "code") else None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(error.details(), field=violated_field(error))
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(error.details())
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return AlreadyExists(error.details())
    return error


class TrainerClient:
    """Blocking client. ``timeout`` (seconds) applies to every call; None waits as needed."""

    def __init__(self, target: str, *, auth: ClientAuth, timeout: float | None = None) -> None:
        self._channel = open_channel(target, auth, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.TrainerServiceStub(self._channel)
        self._timeout = timeout

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self._timeout)
        except grpc.RpcError as error:
            raise _translate(error) from None

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Blocks until the health service reports SERVING."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)
        health = health_pb2_grpc.HealthStub(self._channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"trainer is not serving: {reply.status}")

    def begin_step(
        self,
        step_id: str,
        loss: LossConfig,
        optimizer: OptimizerOverrides | None = None,
        *,
        staleness: StalenessBound | None = None,
    ) -> int:
        """Opens a step; `staleness` bounds how many versions old its sequences may be."""
        request = begin_request(step_id, loss, optimizer, staleness)
        return self._call("BeginTrainStep", request).weights_version

    def train_microbatch(
        self, step_id: str, request_id: str, batch: SequenceBatch
    ) -> MicrobatchReceipt:
        reply = self._call("TrainMicrobatch", microbatch_request(step_id, request_id, batch))
        return MicrobatchReceipt(reply.duplicate, _counts(reply.accumulated))

    def finish_step(
        self, step_id: str, *, wait_for_update: bool = False, wait_for_publication: bool = False
    ) -> StepResult:
        """Applies the step. It answers once the update is queued on the devices (every later
        call sees it; receivers see the version once it is published); `wait_for_update`
        answers once it is applied, `wait_for_publication` once the version is readable or
        its publication failed (`StepResult.publication` says which)."""
        request = pb.FinishTrainStepRequest(
            step_id=step_id,
            wait_for_update=wait_for_update,
            wait_for_publication=wait_for_publication,
        )
        return step_result(self._call("FinishTrainStep", request))

    def abort_step(self, step_id: str) -> bool:
        return self._call("AbortTrainStep", pb.AbortTrainStepRequest(step_id=step_id)).aborted

    def forward(
        self,
        batch: SequenceBatch,
        outputs: Iterable[ForwardOutput] = (ForwardOutput.LOGPROBS,),
        top_k: int = 0,
    ) -> ForwardResult:
        reply = self._call("Forward", forward_request(batch, outputs, top_k))
        return forward_result(reply, batch.num_tokens)

    def save_checkpoint(self, path: Path | str) -> CheckpointInfo:
        reply = self._call("SaveCheckpoint", pb.SaveCheckpointRequest(path=str(path)))
        return CheckpointInfo(Path(reply.path), reply.weights_version, reply.optimizer_step)

    def load_checkpoint(self, path: Path | str) -> CheckpointInfo:
        reply = self._call("LoadCheckpoint", pb.LoadCheckpointRequest(path=str(path)))
        return CheckpointInfo(Path(path), reply.weights_version, reply.optimizer_step)

    def set_reference(self) -> int:
        """Makes the current weights the reference policy's; returns their version."""
        return int(self._call("SetReference", pb.SetReferenceRequest()).weights_version)

    def export_hf(
        self,
        path: Path | str,
        *,
        dtype: ExportDType = ExportDType.BFLOAT16,
        max_file_bytes: int = 0,
    ) -> pb.ExportHFResponse:
        """Writes a sharded HF checkpoint (the weights in `dtype`, files of at most
        `max_file_bytes`, 0 for the trainer's default) into `path` on the trainer's host."""
        return self._call("ExportHF", export_request(path, dtype, max_file_bytes))

    def status(self) -> pb.GetStatusResponse:
        return self._call("GetStatus", pb.GetStatusRequest())


class AsyncTrainerClient:
    """The asyncio twin of TrainerClient (same methods, awaitable)."""

    def __init__(self, target: str, *, auth: ClientAuth, timeout: float | None = None) -> None:
        self._channel = open_aio_channel(target, auth, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.TrainerServiceStub(self._channel)
        self._timeout = timeout

    async def __aenter__(self) -> AsyncTrainerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self._stub, method)(request, timeout=self._timeout)
        except grpc.RpcError as error:
            raise _translate(error) from None

    async def begin_step(
        self,
        step_id: str,
        loss: LossConfig,
        optimizer: OptimizerOverrides | None = None,
        *,
        staleness: StalenessBound | None = None,
    ) -> int:
        request = begin_request(step_id, loss, optimizer, staleness)
        reply = await self._call("BeginTrainStep", request)
        return reply.weights_version

    async def train_microbatch(
        self, step_id: str, request_id: str, batch: SequenceBatch
    ) -> MicrobatchReceipt:
        reply = await self._call("TrainMicrobatch", microbatch_request(step_id, request_id, batch))
        return MicrobatchReceipt(reply.duplicate, _counts(reply.accumulated))

    async def finish_step(
        self, step_id: str, *, wait_for_update: bool = False, wait_for_publication: bool = False
    ) -> StepResult:
        """As `TrainerClient.finish_step`."""
        request = pb.FinishTrainStepRequest(
            step_id=step_id,
            wait_for_update=wait_for_update,
            wait_for_publication=wait_for_publication,
        )
        return step_result(await self._call("FinishTrainStep", request))

    async def abort_step(self, step_id: str) -> bool:
        reply = await self._call("AbortTrainStep", pb.AbortTrainStepRequest(step_id=step_id))
        return reply.aborted

    async def forward(
        self,
        batch: SequenceBatch,
        outputs: Iterable[ForwardOutput] = (ForwardOutput.LOGPROBS,),
        top_k: int = 0,
    ) -> ForwardResult:
        reply = await self._call("Forward", forward_request(batch, outputs, top_k))
        return forward_result(reply, batch.num_tokens)

    async def save_checkpoint(self, path: Path | str) -> CheckpointInfo:
        reply = await self._call("SaveCheckpoint", pb.SaveCheckpointRequest(path=str(path)))
        return CheckpointInfo(Path(reply.path), reply.weights_version, reply.optimizer_step)

    async def load_checkpoint(self, path: Path | str) -> CheckpointInfo:
        reply = await self._call("LoadCheckpoint", pb.LoadCheckpointRequest(path=str(path)))
        return CheckpointInfo(Path(path), reply.weights_version, reply.optimizer_step)

    async def set_reference(self) -> int:
        """As `TrainerClient.set_reference`."""
        return int((await self._call("SetReference", pb.SetReferenceRequest())).weights_version)

    async def export_hf(
        self,
        path: Path | str,
        *,
        dtype: ExportDType = ExportDType.BFLOAT16,
        max_file_bytes: int = 0,
    ) -> pb.ExportHFResponse:
        """As `TrainerClient.export_hf`."""
        return await self._call("ExportHF", export_request(path, dtype, max_file_bytes))

    async def status(self) -> pb.GetStatusResponse:
        return await self._call("GetStatus", pb.GetStatusRequest())
