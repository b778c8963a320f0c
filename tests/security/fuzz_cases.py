"""Seeded malformed requests for the fuzz test, and the status codes each may get.

Every case is raw bytes for one method: random bytes, a plausible request with its encoding
corrupted, a field with the wrong wire type, a request whose fields hold extreme values (NaN,
infinities, the integer limits, empty and 64 KiB strings, long repeated fields, unknown enum
values), or a hand-made request that is invalid by construction (a poisoned microbatch of the
open step, a reused request id with other data). The codes a case may get come from the
.proto comments: INVALID_ARGUMENT for a body that does not parse, and for one that parses the
codes its method documents in the current mode (with or without an open step).

A generated request that the service would rightly accept *and* that would change its state
(begin a step, write a checkpoint, register a trainer, reserve a slot...) is not malformed: it
is skipped (`MethodSpec.applies`), so every case sent leaves the state unchanged when the
service is right.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from trainer_refit.v1 import refit_pb2 as rpb
from trainer_refit.v1 import trainer_pb2 as tpb

C = grpc.StatusCode
Request = Any  # a generated protobuf message
Curated = Callable[[random.Random], tuple[Request, frozenset[grpc.StatusCode]]]


@dataclass(frozen=True)
class Case:
    method: str
    """The full method path, "/package.Service/Method"."""
    body: bytes
    allowed: frozenset[grpc.StatusCode]
    kind: str
    request: Request | None
    """The body parsed here; None when it does not parse."""
    streaming: bool = False


@dataclass(frozen=True)
class MethodSpec:
    name: str
    request: type[Message]
    allowed: frozenset[grpc.StatusCode]
    """Codes for a body that parses (beyond that: INVALID_ARGUMENT when it does not)."""
    template: Request
    """A plausible request, to corrupt."""
    applies: Callable[[Request], bool] = lambda request: False
    """True for a request the service would accept and that would change its state: such a
    request is not malformed, so it is never sent."""
    curated: Curated | None = None
    """Requests invalid by construction, with their own expected codes."""
    streaming: bool = False
    """A server-streaming method: the case reads the first reply, then cancels."""
    weight: float = 1.0
    """How often the method is drawn, relative to the others."""


# -- building blocks ----------------------------------------------------------------------------

_INTS = {
    FieldDescriptor.CPPTYPE_INT32: (0, 1, -1, 2**31 - 1, -(2**31)),
    FieldDescriptor.CPPTYPE_INT64: (0, 1, -1, 2**63 - 1, -(2**63)),
    FieldDescriptor.CPPTYPE_UINT32: (0, 1, 2, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 1, 2, 3, 2**63, 2**64 - 1),
}
_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 1e308, -1e308, 5e-324, 3.4e38)
_ENUMS = (0, 1, 2, 3, 99, -1, 2**31 - 1)
_STRINGS = ("", "a", "\x00", "../../..", "/", "/dev/null", "é☃\u202e", "%s%n", "lease-1")


def _string(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.03:
        return "x" * 65536
    if roll < 0.1:
        return "".join(chr(rng.randrange(1, 0xD7FF)) for _ in range(rng.randrange(1, 300)))
    return rng.choice(_STRINGS)


def _scalar(rng: random.Random, descriptor: FieldDescriptor) -> Any:
    cpp = descriptor.cpp_type
    if cpp in _INTS:
        return rng.choice(_INTS[cpp])
    if cpp in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        return rng.choice(_FLOATS)
    if cpp == FieldDescriptor.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if cpp == FieldDescriptor.CPPTYPE_ENUM:
        return rng.choice(_ENUMS)
    if descriptor.type == FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 16, 4096)))
    return _string(rng)


def extreme(rng: random.Random, message: Message, depth: int = 0) -> Message:
    """Sets a random subset of `message`'s fields to extreme values (in place)."""
    for descriptor in message.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        target = getattr(message, descriptor.name)
        repeated = descriptor.is_repeated
        if descriptor.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if depth >= 3:
                continue
            for _ in range(rng.choice((1, 2, 3)) if repeated else 1):
                child = target.add() if repeated else target
                extreme(rng, child, depth + 1)
                if not repeated:
                    child.SetInParent()
        elif repeated and rng.random() < 0.03:  # a long one: one short value, repeated
            value = "s" if descriptor.cpp_type == FieldDescriptor.CPPTYPE_STRING else None
            target.extend([_scalar(rng, descriptor) if value is None else value] * 20000)
        elif repeated:
            target.extend(_scalar(rng, descriptor) for _ in range(rng.choice((0, 1, 2, 3, 7))))
        else:
            setattr(message, descriptor.name, _scalar(rng, descriptor))
    return message


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _natural_wire_type(descriptor: FieldDescriptor) -> int:
    if descriptor.is_repeated or descriptor.cpp_type in (
        FieldDescriptor.CPPTYPE_MESSAGE,
        FieldDescriptor.CPPTYPE_STRING,
    ):
        return 2
    if descriptor.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64):
        return 1
    if descriptor.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32):
        return 5
    return 0


def wrong_wire_type(rng: random.Random, template: Message) -> bytes:
    """The template's encoding with one field (or an invalid field number) encoded with
    another wire type than its own, or an invalid one (6, 7, an unmatched group)."""
    fields = list(template.DESCRIPTOR.fields)
    if fields and rng.random() < 0.8:
        descriptor = rng.choice(fields)
        number, natural = descriptor.number, _natural_wire_type(descriptor)
    else:
        number, natural = rng.choice((0, 19000, 2**29 - 1)), -1
    wire_type = rng.choice([w for w in range(8) if w != natural])
    payload = {
        0: _varint(rng.choice((0, 1, 2**63, 2**64 - 1))),
        1: rng.randbytes(8),
        2: _varint(rng.choice((0, 3, 1000, 2**31))) + rng.randbytes(rng.choice((0, 3))),
        5: rng.randbytes(4),
    }.get(wire_type, rng.randbytes(rng.choice((0, 2))))
    if rng.random() < 0.2:
        payload = b"\xff" * 11  # a varint longer than 10 bytes
    extra = _varint((number << 3) | wire_type) + payload
    body = template.SerializeToString()
    return extra + body if rng.random() < 0.5 else body + extra


def corrupted(rng: random.Random, template: Message) -> bytes:
    """The template's encoding, truncated, with bytes flipped, inserted or repeated."""
    body = bytearray(template.SerializeToString())
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(body) + 1)
        operation = rng.randrange(5)
        if operation == 0:
            del body[at:]
        elif operation == 1 and body:
            body[min(at, len(body) - 1)] ^= 1 << rng.randrange(8)
        elif operation == 2:
            body[at:at] = rng.randbytes(rng.randint(1, 8))
        elif operation == 3:
            body[at:at] = body[max(0, at - 8) : at] * rng.randint(2, 4)
        else:
            body[at : at + rng.randint(1, 4)] = b"\xff" * rng.randint(1, 4)
    return bytes(body)


def random_body(rng: random.Random) -> bytes:
    size = 65536 if rng.random() < 0.01 else rng.choice((0, 1, 2, 3, 5, 8, 16, 32, 64, 200))
    return rng.randbytes(size)


def parse(request_class: type[Message], body: bytes) -> Request | None:
    try:
        return request_class.FromString(body)
    except DecodeError:
        return None


# -- cases ------------------------------------------------------------------------------------


@dataclass
class CaseStream:
    """Draws `count` cases for a service's methods, skipping requests that would apply."""

    service: str
    specs: list[MethodSpec]
    seed: int
    counts: dict[str, int] = field(default_factory=dict)

    def cases(self, count: int) -> Iterator[Case]:
        rng = random.Random(self.seed)
        sent = 0
        weights = [spec.weight for spec in self.specs]
        while sent < count:
            (spec,) = rng.choices(self.specs, weights)
            case = self._draw(rng, spec)
            if case is None:
                continue
            self.counts[case.kind] = self.counts.get(case.kind, 0) + 1
            sent += 1
            yield case

    def _draw(self, rng: random.Random, spec: MethodSpec) -> Case | None:
        method = f"/{self.service}/{spec.name}"
        if spec.curated is not None and rng.random() < 0.4:
            request, allowed = spec.curated(rng)
            body = request.SerializeToString()
            return Case(method, body, allowed, "curated", request, spec.streaming)
        roll = rng.random()
        if roll < 0.3:
            kind, body = "random bytes", random_body(rng)
        elif roll < 0.55:
            kind, body = "corrupted", corrupted(rng, spec.template)
        elif roll < 0.7:
            kind, body = "wrong wire type", wrong_wire_type(rng, spec.template)
        else:
            kind = "extreme values"
            body = extreme(rng, spec.request()).SerializeToString()
        request = parse(spec.request, body)
        if request is None:
            return Case(method, body, frozenset({C.INVALID_ARGUMENT}), kind, None, spec.streaming)
        if spec.applies(request):
            return None
        return Case(method, body, spec.allowed, kind, request, spec.streaming)


# -- the trainer ------------------------------------------------------------------------------

MAX_ID_CHARS = 256


def begin_would_apply(request: tpb.BeginTrainStepRequest) -> bool:
    """Whether BeginTrainStep accepts this request, by trainer.proto's comments."""
    loss, optimizer = request.loss, request.optimizer
    ranges: list[tuple[bool, float, Callable[[float], bool]]] = [
        (loss.HasField("clip_low"), loss.clip_low, lambda v: 0 <= v < 1),
        (loss.HasField("clip_high"), loss.clip_high, lambda v: math.isfinite(v) and v >= 0),
        (loss.HasField("kl_coef"), loss.kl_coef, lambda v: math.isfinite(v) and v >= 0),
    ]
    for name in ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps"):
        ranges.append((optimizer.HasField(name), getattr(optimizer, name), _optimizer_range(name)))
    ranges.append(
        (
            optimizer.HasField("max_grad_norm"),
            optimizer.max_grad_norm,
            lambda v: math.isfinite(v) and v >= 0,
        )
    )
    return (
        1 <= len(request.step_id) <= MAX_ID_CHARS
        and loss.kind in (tpb.LOSS_KIND_CROSS_ENTROPY, tpb.LOSS_KIND_PPO)
        and loss.normalization in (tpb.NORMALIZATION_TOKEN, tpb.NORMALIZATION_SEQUENCE)
        and all(check(value) for present, value, check in ranges if present)
    )


def _optimizer_range(name: str) -> Callable[[float], bool]:
    def check(value: float) -> bool:
        if not (math.isfinite(value) and value >= 0):
            return False
        if name in ("adam_beta1", "adam_beta2"):
            return value < 1
        return value > 0 if name == "adam_eps" else True

    return check


def inside_root(path: str, root: str) -> bool:
    """Whether SaveCheckpoint, ExportHF or LoadCheckpoint could act at `path` (by
    trainer.proto): a non-empty path without NUL bytes or `..` names, relative (it then lies
    under the first path root) or under `root`. Over-long names could not be written, but
    such paths count too: the check errs on the side of not sending."""
    if not path or "\0" in path or ".." in path.split("/"):
        return False
    return not path.startswith("/") or path.rstrip("/") == root or path.startswith(root + "/")


@dataclass(frozen=True)
class TrainerContext:
    open_step: str | None
    """The step open during the cases; None: no step is open."""
    applied: tpb.TrainMicrobatchRequest
    """The microbatch the open step applied (its request_id is known to the step)."""
    vocab_size: int
    max_tokens: int
    path_root: str
    """The trainer's (real) path root: checkpoints and exports may act under it only."""


def _too_many_tokens(request: tpb.TrainMicrobatchRequest, context: TrainerContext) -> None:
    extra = context.max_tokens
    request.sequences.tokens.extend([1] * extra)
    request.sequences.offsets.append(len(request.sequences.tokens))
    for values in (request.advantages, request.behaviour_logprobs, request.reference_logprobs):
        values.extend([-1.0] * extra)
    request.loss_mask.extend([False] * extra)


def _poison(field_path: str, index: int, value: Any) -> Poison:
    def poison(request: tpb.TrainMicrobatchRequest, context: TrainerContext) -> None:
        *parents, name = field_path.split(".")
        owner = request
        for parent in parents:
            owner = getattr(owner, parent)
        values = getattr(owner, name)
        values[index] = value(context) if callable(value) else value

    return poison


def _drop_last(field_path: str) -> Poison:
    def poison(request: tpb.TrainMicrobatchRequest, context: TrainerContext) -> None:
        del getattr(request, field_path)[-1]

    return poison


def _set_request_id(value: str) -> Poison:
    def poison(request: tpb.TrainMicrobatchRequest, context: TrainerContext) -> None:
        request.request_id = value

    return poison


def _clear(field_path: str) -> Poison:
    def poison(request: tpb.TrainMicrobatchRequest, context: TrainerContext) -> None:
        *parents, name = field_path.split(".")
        owner = request
        for parent in parents:
            owner = getattr(owner, parent)
        owner.ClearField(name)

    return poison


Poison = Callable[[tpb.TrainMicrobatchRequest, TrainerContext], None]
_POISONS: list[Poison] = [
    _poison("sequences.tokens", 1, lambda context: context.vocab_size),
    _poison("sequences.tokens", 0, -(2**31)),
    _poison("sequences.offsets", -1, 2**62),
    _poison("sequences.offsets", 1, 0),
    _clear("sequences.offsets"),
    _drop_last("loss_mask"),
    _poison("loss_mask", 0, True),
    _poison("advantages", 2, math.nan),
    _poison("advantages", 2, -math.inf),
    _drop_last("advantages"),
    _poison("behaviour_logprobs", -1, 1e30),
    _poison("reference_logprobs", -1, math.nan),
    _clear("reference_logprobs"),
    _set_request_id(""),
    _set_request_id("r" * 65536),
    _too_many_tokens,
]


def _microbatch_cases(context: TrainerContext) -> Curated:
    def curated(rng: random.Random) -> tuple[Request, frozenset[grpc.StatusCode]]:
        request = tpb.TrainMicrobatchRequest()
        request.CopyFrom(context.applied)
        roll = rng.random()
        if roll < 0.2:  # the applied microbatch again: acknowledged as a duplicate
            return request, frozenset({C.OK})
        if roll < 0.5:  # its request id with other data
            request.advantages[rng.randrange(len(request.advantages))] += 1.0
            extreme(rng, request.sequences)
            return request, frozenset({C.ALREADY_EXISTS})
        request.request_id = f"fuzz-{rng.randrange(10**9)}"
        rng.choice(_POISONS)(request, context)
        return request, frozenset({C.INVALID_ARGUMENT})

    return curated


def _path_cases(request_class: type[Message], root: str) -> Curated:
    """Paths the service must refuse before acting: the root itself and a file in it (no empty
    directory, no checkpoint), a name longer than the filesystem takes, a NUL byte, `..`."""
    precondition = frozenset({C.FAILED_PRECONDITION})
    cases = [
        (root, precondition),
        (f"{root}/port", precondition),
        ("port", precondition),
        (f"{root}/{'n' * 300}", precondition),
        (f"{root}/a\0b", frozenset({C.INVALID_ARGUMENT})),
        (f"{root}/sub/../base", frozenset({C.PERMISSION_DENIED})),
        ("../escape", frozenset({C.PERMISSION_DENIED})),
    ]

    def curated(rng: random.Random) -> tuple[Request, frozenset[grpc.StatusCode]]:
        path, allowed = rng.choice(cases)
        return request_class(path=path), allowed

    return curated


def _begin_cases(rng: random.Random) -> tuple[Request, frozenset[grpc.StatusCode]]:
    while True:
        request = tpb.BeginTrainStepRequest(
            step_id=rng.choice(("s", "x" * MAX_ID_CHARS, "x" * (MAX_ID_CHARS + 1), "")),
            loss=tpb.LossConfig(kind=tpb.LOSS_KIND_PPO, normalization=tpb.NORMALIZATION_TOKEN),
        )
        extreme(rng, request.loss)
        extreme(rng, request.optimizer)
        if not begin_would_apply(request):
            return request, frozenset({C.INVALID_ARGUMENT})


def trainer_specs(context: TrainerContext) -> list[MethodSpec]:
    is_open = context.open_step is not None
    on_open_step: Callable[[Request], bool] = lambda r: r.step_id == context.open_step  # noqa: E731
    refused = frozenset({C.INVALID_ARGUMENT, C.FAILED_PRECONDITION})
    path_refused = refused | {C.PERMISSION_DENIED}
    acts: Callable[[Request], bool] = lambda r: inside_root(r.path, context.path_root)  # noqa: E731
    applied = context.applied
    other_step = tpb.TrainMicrobatchRequest()
    other_step.CopyFrom(applied)
    other_step.step_id, other_step.request_id = "another-step", "fuzz"
    return [
        MethodSpec("GetStatus", tpb.GetStatusRequest, frozenset({C.OK}), tpb.GetStatusRequest()),
        MethodSpec(
            "BeginTrainStep",
            tpb.BeginTrainStepRequest,
            refused if is_open else frozenset({C.INVALID_ARGUMENT}),
            tpb.BeginTrainStepRequest(step_id="fuzz", loss=tpb.LossConfig(kind=2)),
            applies=(lambda r: False) if is_open else begin_would_apply,
            curated=None if is_open else _begin_cases,
            weight=2.0,
        ),
        MethodSpec(
            "TrainMicrobatch",
            tpb.TrainMicrobatchRequest,
            refused | {C.OK, C.ALREADY_EXISTS} if is_open else refused,
            other_step,
            applies=lambda r: on_open_step(r) and r.request_id != applied.request_id,
            curated=_microbatch_cases(context) if is_open else None,
            weight=3.0,
        ),
        MethodSpec(
            "FinishTrainStep",
            tpb.FinishTrainStepRequest,
            refused,
            tpb.FinishTrainStepRequest(step_id="another-step"),
            applies=on_open_step,
        ),
        MethodSpec(
            "AbortTrainStep",
            tpb.AbortTrainStepRequest,
            refused if is_open else frozenset({C.OK}),
            tpb.AbortTrainStepRequest(step_id="another-step"),
            applies=on_open_step,
        ),
        MethodSpec(
            "Forward",
            tpb.ForwardRequest,
            frozenset({C.OK, C.INVALID_ARGUMENT}),
            tpb.ForwardRequest(sequences=applied.sequences, outputs=[1, 2, 3], top_k=3),
            weight=2.0,
        ),
        *(
            MethodSpec(
                name,
                request,
                path_refused,
                request(path="/outside/root"),
                applies=acts,
                curated=_path_cases(request, context.path_root),
            )
            for name, request in (
                ("SaveCheckpoint", tpb.SaveCheckpointRequest),
                ("ExportHF", tpb.ExportHFRequest),
                ("LoadCheckpoint", tpb.LoadCheckpointRequest),
            )
        ),
    ]


# -- the sidecar ------------------------------------------------------------------------------

TRAINER_SIDE = frozenset({"RegisterTrainer", "RenewRegistration", "ReserveSlot", "PublishShards"})
"""Methods called with the trainer role's token; the others with the receiver's."""


def sidecar_specs(latest: int, max_lease_seconds: float) -> list[MethodSpec]:
    """`latest`: the latest readable version while the cases run."""
    refused = frozenset({C.NOT_FOUND, C.INVALID_ARGUMENT})

    def leases_latest(r: rpb.AcquireLeaseRequest) -> bool:
        return (
            1 <= r.version <= latest
            and 0 < r.ttl_seconds <= max_lease_seconds
            and bool(r.receiver_id)
        )

    shard = rpb.ShardRecord(location=rpb.ShardLocation(agent="a", nbytes=64, shape=[4, 4]))
    parameter = rpb.ParameterRecord(name="w", shape=[4, 4], dtype=1, shards=[shard])
    return [
        MethodSpec(
            "GetLatestVersion",
            rpb.GetLatestVersionRequest,
            frozenset({C.OK}),
            rpb.GetLatestVersionRequest(),
        ),
        MethodSpec(
            "WatchVersions",
            rpb.WatchVersionsRequest,
            frozenset({C.OK}),
            rpb.WatchVersionsRequest(after_version=latest - 1),
            applies=lambda r: r.after_version >= latest,  # would wait for the next version
            streaming=True,
        ),
        MethodSpec(
            "GetManifest",
            rpb.GetManifestRequest,
            frozenset({C.OK, C.NOT_FOUND}),
            rpb.GetManifestRequest(version=latest),
        ),
        MethodSpec(
            "GetChecksums",
            rpb.GetChecksumsRequest,
            frozenset({C.OK, C.NOT_FOUND, C.INVALID_ARGUMENT}),
            rpb.GetChecksumsRequest(version=latest),
            applies=lambda r: r.version > latest and r.wait_seconds > 0.2,  # would wait
        ),
        MethodSpec(
            "AcquireLease",
            rpb.AcquireLeaseRequest,
            refused,
            rpb.AcquireLeaseRequest(version=latest, receiver_id="fuzz", ttl_seconds=-1.0),
            applies=leases_latest,
        ),
        MethodSpec(
            "RenewLease",
            rpb.RenewLeaseRequest,
            refused,
            rpb.RenewLeaseRequest(lease_id="lease-1", ttl_seconds=5.0, receiver_id="fuzz"),
        ),
        MethodSpec(
            "ReleaseLease",
            rpb.ReleaseLeaseRequest,
            refused,
            rpb.ReleaseLeaseRequest(lease_id="lease-1", receiver_id="fuzz"),
        ),
        # The trainer holds the registration (it renews it every second): another owner's
        # is refused unless it takes over, and a generation the fuzz makes up is not current.
        MethodSpec(
            "RegisterTrainer",
            rpb.RegisterTrainerRequest,
            frozenset({C.INVALID_ARGUMENT, C.ALREADY_EXISTS}),
            rpb.RegisterTrainerRequest(num_slots=0, owner="fuzz"),
            applies=lambda r: r.layout.world_size >= 1 and r.num_slots >= 1 and r.take_over,
        ),
        MethodSpec(
            "RenewRegistration",
            rpb.RenewRegistrationRequest,
            frozenset({C.ABORTED, C.INVALID_ARGUMENT}),
            rpb.RenewRegistrationRequest(generation=1, wait_version=latest, wait_seconds=1.0),
        ),
        MethodSpec(
            "ReserveSlot",
            rpb.ReserveSlotRequest,
            frozenset({C.INVALID_ARGUMENT, C.ABORTED}),
            rpb.ReserveSlotRequest(version=latest, generation=1),
        ),
        MethodSpec(
            "PublishShards",
            rpb.PublishShardsRequest,
            refused | {C.ABORTED},
            rpb.PublishShardsRequest(version=latest, rank=0, parameters=[parameter], generation=1),
        ),
    ]
