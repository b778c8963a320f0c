"""Error statuses on the wire: what `serving.status_codes` aborts a call with, and what the
clients read back. A refusal of one request field carries a `google.rpc.BadRequest` detail
(grpcio-status's ``grpc-status-details-bin`` trailer) naming it as a dotted path of the request
message (``sequences.tokens``, ``loss.kind``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from trainer_refit.errors import MAX_FIELD_CHARS, bounded

_DETAILS_KEY = "grpc-status-details-bin"


def error_status(code: grpc.StatusCode, message: str, field: str | None = None) -> grpc.Status:
    """The status to abort a call with: `code`, the bounded message and, with a `field`, a
    BadRequest detail naming it (for `ServicerContext.abort_with_status`)."""
    text = bounded(message)
    status = status_pb2.Status(code=code.value[0], message=text)
    if field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=bounded(field, MAX_FIELD_CHARS), description=text
        )
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        status.details.append(detail)
    return rpc_status.to_status(status)


def _rich_status(trailing_metadata: Iterable[Any] | None) -> status_pb2.Status | None:
    for key, value in trailing_metadata or ():
        if key == _DETAILS_KEY:
            status = status_pb2.Status()
            try:
                status.ParseFromString(value)
            except Exception:  # a foreign server's detail we cannot read: no field then
                return None
            return status
    return None


def violated_field(error: grpc.RpcError) -> str | None:
    """The request field a failed call's BadRequest detail names (the first one), or None.
    Works for the errors of blocking and of asyncio calls."""
    trailing = getattr(error, "trailing_metadata", None)
    status = _rich_status(trailing() if callable(trailing) else None)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            for violation in bad_request.field_violations:
                return violation.field
    return None
