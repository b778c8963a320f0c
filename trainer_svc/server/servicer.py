"""TrainerService over gRPC: converts at the edge, maps domain errors to status codes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import grpc

from megatron_hf.export_plan import DEFAULT_FILE_BYTES
from trainer_refit.serving import status_codes
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import trainer_pb2 as pb
from trainer_refit.v1 import trainer_pb2_grpc as pb_grpc
from trainer_svc.domain import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PathNotAllowed,
    Publication,
)
from trainer_svc.runtime import commands as cmd
from trainer_svc.runtime.control import Leader, WorldLost
from trainer_svc.server import convert
from trainer_svc.server.status import ServiceInfo

log = logging.getLogger(__name__)


_grpc_errors = status_codes(
    [
        (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
        (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
        (PathNotAllowed, grpc.StatusCode.PERMISSION_DENIED),
        (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
        (Internal, grpc.StatusCode.INTERNAL),
        (WorldLost, grpc.StatusCode.UNAVAILABLE),
    ]
)


class TrainerServicer(pb_grpc.TrainerServiceServicer):
    def __init__(self, leader: Leader, info: ServiceInfo) -> None:
        self.leader = leader
        self.info = info

    def _path(self, value: str) -> Path:
        """A checkpoint or export path confined to the trainer's path roots and resolved here,
        once: every rank then acts on the same absolute directory (PathNotAllowed if none)."""
        return self.leader.engine.checkpointer.confine(convert.path(value, "path"))

    @_grpc_errors
    async def BeginTrainStep(self, request: pb.BeginTrainStepRequest, context: Any) -> Any:
        command = cmd.BeginStep(
            step_id=request.step_id,
            loss=convert.loss_config(request.loss),
            optimizer=convert.optimizer_overrides(request.optimizer),
            staleness=convert.staleness_bound(request),
        )
        version = await self.leader.submit(command)
        return pb.BeginTrainStepResponse(step_id=request.step_id, weights_version=version)

    @_grpc_errors
    async def TrainMicrobatch(self, request: pb.TrainMicrobatchRequest, context: Any) -> Any:
        command = cmd.TrainMicrobatch(
            step_id=request.step_id,
            request_id=request.request_id,
            batch=convert.training_batch(request),
        )
        ack = await self.leader.submit(command)
        return pb.TrainMicrobatchResponse(
            step_id=ack.step_id,
            request_id=ack.request_id,
            duplicate=ack.duplicate,
            accumulated=convert.counts_to_proto(ack.counts),
        )

    @_grpc_errors
    async def FinishTrainStep(self, request: pb.FinishTrainStepRequest, context: Any) -> Any:
        result = await self.leader.submit(
            cmd.FinishStep(step_id=request.step_id, wait_for_update=request.wait_for_update)
        )
        response = pb.FinishTrainStepResponse(
            step_id=result.step_id,
            metrics=convert.metrics_to_proto(result.metrics),
            weights_version=result.weights_version,
        )
        publication = await self._publication(
            result.weights_version, wait=request.wait_for_publication
        )
        if publication is not None:
            response.publication.CopyFrom(convert.publication_to_proto(publication))
        return response

    async def _publication(self, version: int, *, wait: bool) -> Publication | None:
        """How `version`'s publication stands; with `wait`, once settled (bounded by the
        reports' deadline and a margin for rank 0's last call)."""
        publisher = self.leader.engine.publisher
        if publisher is None:
            return None
        if not wait:
            return publisher.book.get(version)
        timeout = publisher.report_deadline_s + 5.0
        return await asyncio.to_thread(publisher.book.wait, version, timeout)

    @_grpc_errors
    async def AbortTrainStep(self, request: pb.AbortTrainStepRequest, context: Any) -> Any:
        aborted = await self.leader.submit(cmd.AbortStep(step_id=request.step_id))
        return pb.AbortTrainStepResponse(step_id=request.step_id, aborted=bool(aborted))

    @_grpc_errors
    async def Forward(self, request: pb.ForwardRequest, context: Any) -> Any:
        batch = convert.sequences(request.sequences)
        routed = convert.routed_experts(request.routed_experts, batch.num_tokens)
        command = cmd.RunForward(
            batch=dataclasses.replace(batch, routed_experts=routed),
            outputs=convert.forward_outputs(request),
            top_k=request.top_k,
        )
        return convert.forward_to_proto(await self.leader.submit(command))

    @_grpc_errors
    async def SaveCheckpoint(self, request: pb.SaveCheckpointRequest, context: Any) -> Any:
        summary = await self.leader.submit(cmd.SaveCheckpoint(path=self._path(request.path)))
        return pb.SaveCheckpointResponse(
            path=str(summary.path),
            weights_version=summary.weights_version,
            optimizer_step=summary.optimizer_step,
        )

    @_grpc_errors
    async def SetReference(self, request: pb.SetReferenceRequest, context: Any) -> Any:
        version = await self.leader.submit(cmd.SetReference())
        return pb.SetReferenceResponse(weights_version=version)

    @_grpc_errors
    async def LoadCheckpoint(self, request: pb.LoadCheckpointRequest, context: Any) -> Any:
        version, step = await self.leader.submit(cmd.LoadCheckpoint(path=self._path(request.path)))
        return pb.LoadCheckpointResponse(weights_version=version, optimizer_step=step)

    @_grpc_errors
    async def ExportHF(self, request: pb.ExportHFRequest, context: Any) -> Any:
        command = cmd.ExportHF(
            path=self._path(request.path),
            dtype=convert.export_dtype(request.dtype),
            max_file_bytes=request.max_file_bytes or DEFAULT_FILE_BYTES,
        )
        summary = await self.leader.submit(command)
        return pb.ExportHFResponse(
            path=str(summary.path),
            weights_version=summary.weights_version,
            num_tensors=summary.num_tensors,
            num_bytes=summary.num_bytes,
        )

    @_grpc_errors
    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> Any:
        self.leader.check_alive()
        engine = self.leader.engine
        layout = engine.topology.layout
        response = pb.GetStatusResponse(
            layout=common_pb2.ParallelLayout(
                tensor_parallel=layout.tensor_parallel,
                pipeline_parallel=layout.pipeline_parallel,
                data_parallel=layout.data_parallel,
                world_size=layout.world_size,
            ),
            model=self.info.model_info(),
            weights_version=engine.weights_version,
            optimizer_step=engine.optimizer_step,
            device=engine.device.type,
            sidecar=self.info.sidecar,
            refit_snapshot_bytes=self.info.refit_snapshot_bytes,
            pass_token_budget=self.info.pass_token_budget,
            sequence_layout=self.info.sequence_layout,
            reference_policy=self.info.reference_policy,
            reference_placement=self.info.reference_placement,
        )
        open_step = self.leader.open_step_info()
        if open_step is not None:
            response.open_step.CopyFrom(convert.open_step_to_proto(open_step))
        if engine.publisher is not None:
            response.publications.extend(
                convert.publication_to_proto(p) for p in engine.publisher.book.recent()
            )
        return response
