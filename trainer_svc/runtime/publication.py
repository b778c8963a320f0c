"""This rank's side of refit publication: its own Megatron shards, never gathered, copied after
each new version (a finished step, a loaded checkpoint) into one of ``slots`` NIXL-registered
snapshot arenas (registered once, at start) and reported to the sidecar, which makes the version
readable once every rank reported.

The arenas live where the parameters do: VRAM on a GPU, so a snapshot is a device-local copy on
a side stream and no byte crosses to the host; DRAM on the CPU. A DRAM slot's shards carry their
CRC-32 (computed on the host), a VRAM slot's their WSUM-64 (computed on the GPU, `wsum`; see
docs/refit.md).

Only the copy is on the trainer's path, and on a GPU not even its completion: the copy runs on
a side stream, the trainer's stream waits for it before the parameters change again (`fence`),
and a reporter thread waits for it, adds the checksums (on a GPU the WSUM-64 of each shard, one
kernel over the slot on the side stream) and sends the rank's report, which was built once per
slot. The version becomes readable a moment after the update that made it is applied (on a GPU
FinishTrainStep answers once the update is queued, so possibly after the answer); receivers
wait for it (`SidecarClient.wait_visible`).

A report that fails for want of the sidecar is sent again until `report_deadline_s`; rank 0
then waits for every rank's report and writes the outcome in its `PublicationBook`, so a
version no rank could publish is answered FAILED, never silently lost. Every reservation and
report presents the registration's generation: a trainer whose registration another took
over is refused by the sidecar and publishes nothing more there.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch

from megatron_hf.spec import ModelSpec
from refit_sidecar.publish.shard_source import SourceAgent
from refit_sidecar.publish.slot_layout import DEFAULT_FIRST_PIECE_BYTES
from refit_sidecar.service.client import (
    InvalidRequest,
    NotRegistered,
    PublicationPending,
    RegistrationHeld,
    SidecarClient,
    SlotsExhausted,
    TrainerLayout,
    UnknownVersion,
)
from trainer_refit.auth import ClientAuth
from trainer_refit.v1 import refit_pb2 as pb
from trainer_svc.runtime.agreement import fault
from trainer_svc.runtime.publication_book import PublicationBook
from trainer_svc.runtime.snapshot_slot import (
    Slot,
    build_slots,
    copy_piece,
    published_parameters,
    published_tensors,
)
from trainer_svc.runtime.topology import Topology

log = logging.getLogger(__name__)

SIDECAR_CHECK_TIMEOUT_S = 3.0
"""How long the sidecar's health check may take before the sidecar counts as unreachable
(`Publisher.check_sidecar`). A second, as before, was missed by a sidecar that was fine on a
loaded two-core host: the trainer logged it as down and back, and the next step reserved its
slot again. A sidecar that is gone refuses at once or after this long; one restarted within
it is still seen, from the reservation it lost (docs/refit.md, "Publication health")."""

REGISTER_WAIT_S = 30.0
"""How long a starting trainer waits for another trainer's live registration to lapse (a
trainer restarted after a crash finds its predecessor's) before it gives up."""

_RETRY_PAUSES_S = (0.05, 0.1, 0.2, 0.5, 1.0)
"""Pauses between a report's attempts (the last repeats)."""

_FOLLOW_WAIT_S = 1.0
"""Rank 0 waits for the other ranks' reports in calls this long (the sidecar answers as soon
as the version is readable), so a trainer shutting down is not held by a longer one."""

_DEFINITIVE = (NotRegistered, UnknownVersion, InvalidRequest)
"""A report refused for these never succeeds when sent again: the registration is gone or
replaced, the version's reservation is gone, or the report is wrong."""


@dataclass
class Publisher:
    client: SidecarClient
    slots: list[Slot]
    parameters: dict[str, torch.nn.Parameter]
    topology: Topology
    device: torch.device
    stream: torch.cuda.Stream | None = None
    """The side stream of the device copies (CUDA only)."""
    agent: SourceAgent | None = None
    """The rank's NIXL agent, shared by its slots."""
    every: int = 1
    """A finished step publishes versions that are multiples of this
    (`RefitConfig.publish_every`)."""
    owner: str = ""
    """This trainer's identity at the sidecar (drawn at start, the same on every rank)."""
    take_over: bool = False
    """Register even while another trainer's registration is alive (`RefitConfig.take_over`)."""
    report_deadline_s: float = 60.0
    """`RefitConfig.report_deadline_s`."""
    book: PublicationBook = field(default_factory=PublicationBook)
    """Rank 0: each version's publication as it stands."""
    _stopping: threading.Event = field(default_factory=threading.Event)
    _reporter: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="refit-report")
    )
    _copied: torch.cuda.Event | None = None
    _ahead: Future[tuple[int, int, int] | None] | None = None
    """Rank 0: the (version, slot, generation) reserved for the next version once the last
    one was reported, or None when no slot could be reserved ahead."""
    _addresses: tuple[int, ...] = ()
    """Where each parameter lived when the slots were laid out."""
    problem: str | None = None
    """Why this rank's last reservation or report failed; None once a report succeeds."""
    unreachable: str | None = None
    """Set while the sidecar does not answer its health check (`check_sidecar`)."""
    _ahead_suspect: bool = False
    """A problem was seen since the reservation ahead was made: the sidecar may have lost it
    (a restart), so the step reserves again instead of trusting it."""
    _described: int = 0
    """The registration (generation) that this rank's slots' layouts were last reported in."""

    def __post_init__(self) -> None:
        self._addresses = tuple(p.data_ptr() for p in self.parameters.values())

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        spec: ModelSpec,
        topology: Topology,
        *,
        sidecar: str,
        auth: ClientAuth,
        slots: int,
        device: torch.device,
        nixl_host: str,
        nixl_net_devices: tuple[str, ...],
        first_piece_bytes: int = DEFAULT_FIRST_PIECE_BYTES,
        every: int = 1,
        take_over: bool = False,
        report_deadline_s: float = 60.0,
    ) -> Publisher:
        """`nixl_host`, `nixl_net_devices`: where the rank's NIXL agent listens for receivers
        (`SourceConfig.host`, `SourceConfig.net_devices`); `first_piece_bytes`: the snapshot
        copy's first piece (`slot_layout.piece_ends`; 0: one piece); `every`: which
        finished steps publish (`RefitConfig.publish_every`); `take_over`,
        `report_deadline_s`: as `RefitConfig`."""
        tensors = published_tensors(model, spec, topology)
        parameters = published_parameters(tensors)
        filled, agent = build_slots(
            tensors,
            topology,
            device,
            slots=slots,
            nixl_host=nixl_host,
            nixl_net_devices=nixl_net_devices,
            first_piece_bytes=first_piece_bytes,
        )
        client = SidecarClient(sidecar, auth=auth)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if stream is not None:
            # Compiles the checksum kernel and lays out every slot's tables now, not in the
            # report of the first version into each slot.
            with torch.cuda.stream(stream):
                for slot in filled:
                    slot.source.device_sums()
        publisher = cls(
            client,
            filled,
            parameters,
            topology,
            device,
            stream,
            agent,
            every,
            owner=f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}",
            take_over=take_over,
            report_deadline_s=report_deadline_s,
        )
        if topology.is_leader:
            client.wait_ready()
            publisher.register(wait_s=REGISTER_WAIT_S)
        arena = filled[0].source.arena
        log.info(
            "refit: %d snapshot slots of %d bytes each in %s (device %d)",
            slots,
            arena.nbytes,
            arena.mem_type.value,
            arena.device_id,
        )
        return publisher

    @property
    def snapshot_bytes(self) -> int:
        """Memory this rank's slots take (host or device, where the parameters are)."""
        return sum(slot.source.arena.nbytes for slot in self.slots)

    def reserve(self, version: int) -> tuple[int, int]:
        """Rank 0, before the weights change: the slot the new version goes to and the
        registration's generation its reports present. Usually reserved already, ahead of
        the step (`_reserve_ahead`); else reserved now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            reserved = ahead.result()
            suspect, self._ahead_suspect = self._ahead_suspect, False
            if (
                reserved is not None
                and reserved[0] == version
                and reserved[2] == self.client.generation
                and not suspect
            ):
                return reserved[1], reserved[2]
        return self._reserve(version, ahead=False), self.client.generation

    @property
    def health_problem(self) -> str | None:
        """Why this rank cannot publish now; None when it can."""
        return self.problem or self.unreachable

    def check_sidecar(self) -> None:
        """Rank 0's heartbeat (blocking; the trainer's health watcher calls it every second):
        renews the registration, so no other trainer can take the sidecar while this one
        lives. Sets `unreachable` when the sidecar does not answer within
        `SIDECAR_CHECK_TIMEOUT_S` or no longer holds this trainer's registration."""
        try:
            if self.client.generation:  # a renewal that answers is the sidecar answering
                self.client.renew_registration(deadline_s=SIDECAR_CHECK_TIMEOUT_S)
            else:
                self.client.wait_ready(timeout=SIDECAR_CHECK_TIMEOUT_S)
        except NotRegistered as e:
            # Restarted (the next reservation registers again) or taken over by another
            # trainer (registering again then says by whom).
            self.unreachable = f"the refit sidecar no longer holds this trainer's registration: {e}"
            self._ahead_suspect = True
        except Exception as e:
            self.unreachable = f"the refit sidecar does not answer: {describe(e)}"
            self._ahead_suspect = True
        else:
            self.unreachable = None

    def _note(self, problem: str) -> None:
        self.problem = problem
        self._ahead_suspect = True

    def register(self, wait_s: float = 0.0) -> None:
        """Rank 0: start a trainer generation at the sidecar (this world's layout and slots).
        While another trainer's registration is alive, waits up to `wait_s` for it to lapse
        (unless taking over), then raises `RegistrationHeld`."""
        layout = self.topology.layout
        deadline = time.monotonic() + wait_s
        while True:
            try:
                generation = self.client.register_trainer(
                    TrainerLayout(
                        tensor_parallel=layout.tensor_parallel,
                        pipeline_parallel=layout.pipeline_parallel,
                        data_parallel=layout.data_parallel,
                    ),
                    len(self.slots),
                    owner=self.owner,
                    take_over=self.take_over,
                )
            except RegistrationHeld as held:
                if time.monotonic() >= deadline:
                    raise
                log.warning("refit: waiting for the sidecar to be free: %s", held)
                time.sleep(1.0)
                continue
            log.info("refit: registered as %r (generation %d)", self.owner, generation)
            return

    def _reserve_registered(self, version: int, *, ahead: bool) -> tuple[int, int | None]:
        abandoned = self.book.take_abandoned()
        try:
            try:
                return self.client.reserve_slot(version, ahead=ahead, abandoned=abandoned)
            except NotRegistered:
                # The sidecar restarted (versions it served are gone, and its receivers'
                # leases: they fail closed on release) or another trainer took over
                # (registering again is refused while it lives).
                log.warning("refit: the sidecar lost this trainer's registration; registering")
                self.register()
                abandoned = ()  # a new registration holds none of them
                return self.client.reserve_slot(version, ahead=ahead)
        except BaseException:
            self.book.give_back(abandoned)
            raise

    def _reserve(self, version: int, *, ahead: bool) -> int:
        try:
            slot, retired = self._reserve_registered(version, ahead=ahead)
        except (SlotsExhausted, PublicationPending):
            raise
        except Exception as e:
            self._note(f"cannot reserve a slot for version {version}: {describe(e)}")
            raise
        if retired is not None:
            log.debug("refit: version %d retired to make room for %d", retired, version)
        return slot

    def _reserve_ahead(self, version: int) -> tuple[int, int, int] | None:
        """On the reporter thread of rank 0, after its report of `version - 1` (when that one
        was published): the slot of `version`, unless the sidecar has none to give without
        retiring the latest version or waiting for a lease (the step then reserves, with the
        sidecar's policy)."""
        try:
            slot = self._reserve(version, ahead=True)
            return version, slot, self.client.generation
        except SlotsExhausted as e:
            log.debug("refit: %s", e)
            return None
        except PublicationPending:
            raise  # a rank never reported: the step fails with this, without waiting again
        except Exception as e:  # the step reserves again and reports what is wrong
            log.warning("refit: reserving a slot ahead for version %d failed: %s", version, e)
            return None

    @torch.no_grad()
    def snapshot(self, slot: int, version: int) -> torch.cuda.Event | None:
        """Sets the slot's words to 0, copies the parameters into it as `version` piece by
        piece, each followed by its word: done on return on the CPU; on a GPU, queued on the
        side stream after the trainer's pending work; returns the event that marks its end
        (None on the CPU)."""
        if tuple(p.data_ptr() for p in self.parameters.values()) != self._addresses:
            raise RuntimeError(
                "a published parameter moved since the snapshot slots were laid out; "
                "parameters must be updated in place"
            )
        target = self.slots[slot]
        stream = self.stream
        if stream is None:
            target.words.zero_()  # before any byte changes: a reader that sees 0 rereads
            for i, (destinations, sources) in enumerate(target.pieces):
                copy_piece(destinations, sources, non_blocking=False)
                target.words[i].fill_(version)  # after the bytes: a reader seeing it reads them
            return None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Queued before the copies: no byte of the slot changes until every word says 0,
            # so a receiver that finds its version's word after its reads read no new byte.
            target.words.zero_()
            for i, (destinations, sources) in enumerate(target.pieces):
                copy_piece(destinations, sources, non_blocking=True)
                # Queued after the piece's copies: written once they landed.
                target.words[i].fill_(version)
            return stream.record_event()

    def publish(self, version: int, slot: int, generation: int) -> None:
        """Snapshots the parameters as `version` into the reserved `slot` and hands the report
        (in registration `generation`) to the reporter thread (reports leave in order)."""
        copied = self.snapshot(slot, version)
        self._copied = copied
        if self.topology.is_leader:
            self.book.pending(version)
        self._reporter.submit(self._send, version, slot, copied, generation)
        self._reserve_next(version)

    def publishes(self, version: int) -> bool:
        """Whether the finished step that makes `version` publishes it."""
        return version % self.every == 0

    def made(self, version: int) -> None:
        """`version` was made by a step that does not publish it."""
        if self.topology.is_leader:
            self.book.not_published(version)
        self._reserve_next(version)

    def _reserve_next(self, version: int) -> None:
        """After `version` was made, published or not: rank 0 reserves the next version's slot
        ahead, behind the reports queued so far, when the next step will publish it."""
        if self.topology.is_leader and self.publishes(version + 1):
            self._ahead = self._reporter.submit(self._reserve_ahead, version + 1)

    def _send(
        self, version: int, slot: int, copied: torch.cuda.Event | None, generation: int
    ) -> None:
        """Reports this rank's shards of `version`, again after a failure until the deadline;
        rank 0 then follows the version until every rank's report is in."""
        start = time.perf_counter()
        deadline = time.monotonic() + self.report_deadline_s
        try:
            if copied is not None:
                copied.synchronize()
            copy_done = time.perf_counter()
            request = self.slots[slot].request(version, generation, self.stream)
            summed = time.perf_counter()
            if generation != self._described:
                request.slot_layouts.extend(self._layouts(slot))
            try:
                visible = self._report(request, deadline)
            finally:
                request.ClearField("slot_layouts")
            self._described = generation
            self.problem = None
            log.debug(
                "refit: version %d reported (copy waited %.3f ms, checksums %.3f ms, "
                "report %.3f ms, readable: %s)",
                version,
                1e3 * (copy_done - start),
                1e3 * (summed - copy_done),
                1e3 * (time.perf_counter() - summed),
                visible,
            )
        except Exception as e:
            problem = f"rank {self.topology.rank} could not report version {version}: {describe(e)}"
            self._note(problem)
            log.warning("refit: %s", problem)
            if self.topology.is_leader:
                self.book.failed(version, problem)
            return
        if self.topology.is_leader:
            self._follow(version, visible, deadline)

    def _layouts(self, reported: int) -> list[pb.SlotLayout]:
        """This rank's other slots as their reports describe them: with the first report of a
        registration, so that the sidecar knows where every slot's versions will lie and
        gives receivers that lease one early a layout to plan (the first version into each
        slot read behind the copy, like the later ones)."""
        return [
            pb.SlotLayout(slot=index, agent=slot.report.agent, parameters=slot.report.parameters)
            for index, slot in enumerate(self.slots)
            if index != reported
        ]

    def _report(self, request: pb.PublishShardsRequest, deadline: float) -> bool:
        """Sends the report until the sidecar takes it, refuses it for good (`_DEFINITIVE`),
        or the deadline passes; True when it made the version readable."""
        for attempt in itertools.count():
            try:
                return self.client.send_publication(request)
            except _DEFINITIVE:
                raise
            except Exception as e:
                pause = _RETRY_PAUSES_S[min(attempt, len(_RETRY_PAUSES_S) - 1)]
                if self._stopping.is_set() or time.monotonic() + pause >= deadline:
                    raise
                reason = f"rank {self.topology.rank}'s report failed ({describe(e)}); retrying"
                if attempt == 0:
                    log.warning("refit: version %d: %s", request.version, reason)
                if self.topology.is_leader:
                    self.book.retrying(request.version, reason)
                self._stopping.wait(pause)
        raise AssertionError("unreachable")  # count() never ends

    def _follow(self, version: int, visible: bool, deadline: float) -> None:
        """Rank 0, after its own report: waits until every rank's report is in and books the
        version READABLE, or FAILED once the deadline passes (the next reservation abandons
        it at the sidecar)."""
        try:
            while not visible:
                left = deadline - time.monotonic()
                status = self.client.renew_registration(
                    wait_version=version,
                    wait_s=min(max(left, 0.0), _FOLLOW_WAIT_S),
                    deadline_s=SIDECAR_CHECK_TIMEOUT_S,
                )
                missing = next(
                    (p.missing_ranks for p in status.pending if p.version == version), None
                )
                if missing is None:
                    if status.latest is not None and status.latest >= version:
                        break
                    raise UnknownVersion(f"the sidecar no longer holds version {version}")
                if self._stopping.is_set() or time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"ranks {list(missing)} did not report version {version} within "
                        f"{self.report_deadline_s:g} s"
                    )
        except Exception as e:
            reason = f"version {version} will not be readable: {describe(e)}"
            log.warning("refit: %s", reason)
            self.book.failed(version, reason)
            return
        self.book.readable(version)

    def fence(self) -> None:
        """Before the parameters change: the trainer's stream waits for the last snapshot
        copy (on the GPU, without blocking the host)."""
        if self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied)
            self._copied = None

    def close(self) -> None:
        self._stopping.set()
        self._reporter.shutdown(wait=True)
        for slot in self.slots:
            slot.source.close()
            if self.agent is not None:
                self.agent.deregister(slot.words_registration)
        if self.agent is not None:
            self.agent.close()
        self.client.close()


_SIDECAR_WORDS = (
    NotRegistered,
    RegistrationHeld,
    UnknownVersion,
    InvalidRequest,
    SlotsExhausted,
    PublicationPending,
    TimeoutError,
)
"""Errors whose message is the sidecar's own refusal or this module's words."""


def describe(error: Exception, where: str = "refit publication") -> str:
    """One line for what went wrong with the sidecar, fit for a client (it reaches
    FinishTrainStep's refusal, GetStatus and health): the sidecar's own refusal, or the status
    code of a call that failed, whose gRPC text goes to the log only; anything else is a
    fault, logged with its traceback under an error id that the line names."""
    if isinstance(error, _SIDECAR_WORDS):
        return str(error)
    if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call):
        log.info("refit: %s: %s %s", where, error.code().name, error.details())
        return f"the refit sidecar answered {error.code().name}"
    return str(fault(error, where))
