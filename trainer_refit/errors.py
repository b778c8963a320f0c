"""Refusals both services share, free of gRPC and protobuf: `InvalidRequest` (naming the
field at fault), and the bounds on what a refusal's message echoes. Client strings are cut by
`quoted`, the whole message by `bounded`, so an error about a huge request is never itself
too large for the caller's metadata limit. `status_details` puts them on the wire.
"""

from __future__ import annotations

import uuid

MAX_QUOTED_CHARS = 64
"""Characters of a client-provided string (an id, a path) echoed in a message."""
MAX_MESSAGE_BYTES = 1024
"""UTF-8 bytes of a status message. gRPC percent-encodes non-ASCII bytes in the grpc-message
trailer (up to 3 bytes each) and the rich details repeat the message once, base64-encoded:
together they stay well under the 8 KiB metadata limit clients apply by default."""
MAX_FIELD_CHARS = 128
"""Characters of a field path in a BadRequest detail."""

_CUT = " [...]"


class InvalidRequest(ValueError):
    """A request is wrong in itself, whatever the service's state; nothing was changed. Maps
    to INVALID_ARGUMENT. `field` is the dotted path of the offending field in the request
    message (``"sequences.offsets"``), None when no one field is at fault."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def new_error_id() -> str:
    """A fresh id for one fault: logged with its traceback, and all the client sees of it."""
    return uuid.uuid4().hex[:12]


def internal_message(error_id: str) -> str:
    """The message of an INTERNAL answer: the fault's id, never its exception's text, which is
    written for a programmer (and may show paths, values or advice meant for the server)."""
    return f"internal error {error_id}; see the server log"


def quoted(value: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """`repr(value)`, or for a string longer than `limit` characters the repr of its first
    `limit` characters and its length: how a message echoes what a client sent."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message` cut to at most `limit` UTF-8 bytes (never inside a character)."""
    data = message.encode("utf-8", "replace")
    if len(data) <= limit:
        return message
    return data[: limit - len(_CUT)].decode("utf-8", "ignore") + _CUT
