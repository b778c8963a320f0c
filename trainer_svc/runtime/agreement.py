"""Command outcomes agreed across ranks: a command fails on every rank or on none.

A rank that fails on its own (its filesystem, its parse of a file, a bug) must not leave the
others waiting in a collective it will never enter, nor die while they go on. So fallible work
runs as a *phase*: each rank catches its own error, then every rank takes part in one small
all-reduce of a failure count over the gloo control group. When any rank failed, the ranks
gather the failures and every rank raises the same `CommandFailed`; rank 0 answers the request
with its domain error and the followers go on to the next command.

A phase must not fail *between* collectives of the work inside it (a rank that raises there
still strands the others): the code that calls a phase puts each local step that can fail
(creating a directory, parsing a file, writing one on rank 0) in a phase of its own, before or
after the collectives, never in the middle.

What a client sees of a failure is a domain error's own message, or for any other exception
only "internal error <id>; see the server log" (`fault`): the traceback is logged under that id
on the rank where it happened, and rank 0 logs which rank that was. An expected refusal
(InvalidArgument, FailedPrecondition) is one log line per rank; its cause goes to DEBUG.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from trainer_refit.errors import internal_message, new_error_id
from trainer_svc.domain import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PathNotAllowed,
)
from trainer_svc.runtime.topology import Topology

log = logging.getLogger(__name__)

T = TypeVar("T")


class FailureKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    ALREADY_EXISTS = "already_exists"
    PATH_NOT_ALLOWED = "path_not_allowed"
    FAILED_PRECONDITION = "failed_precondition"
    INTERNAL = "internal"


_ERRORS: dict[FailureKind, type[Exception]] = {
    FailureKind.INVALID_ARGUMENT: InvalidArgument,
    # Subclasses of FailedPrecondition before it: the first match names the kind, and each
    # keeps its own status code on the wire (ALREADY_EXISTS, PERMISSION_DENIED).
    FailureKind.ALREADY_EXISTS: AlreadyExists,
    FailureKind.PATH_NOT_ALLOWED: PathNotAllowed,
    FailureKind.FAILED_PRECONDITION: FailedPrecondition,
    FailureKind.INTERNAL: Internal,
}


@dataclass(frozen=True)
class RankFailure:
    """What one rank reports of its failure (plain data: it is pickled to every rank)."""

    rank: int
    kind: FailureKind
    message: str

    @classmethod
    def of(cls, rank: int, error: Exception) -> RankFailure:
        """A domain error's kind and message; any other exception is logged here as a fault
        and reported by its error id alone."""
        for kind, domain_error in _ERRORS.items():
            if isinstance(error, domain_error):
                return cls(rank, kind, str(error))
        return cls(rank, FailureKind.INTERNAL, str(fault(error, f"rank {rank}")))


def fault(error: BaseException, where: str) -> Internal:
    """Logs `error` with its traceback under a fresh error id and returns the `Internal` that
    answers for it, whose message is the id and nothing of the error's own text: that text is
    written for a programmer, and a client has no use for it (nor should it see it)."""
    error_id = new_error_id()
    log.error("%s failed (error %s)", where, error_id, exc_info=error)
    return Internal(internal_message(error_id))


class CommandFailed(Exception):
    """Raised on every rank when a phase failed on any rank. `error` is the domain error to
    answer with: the failure of the lowest failing rank, its rank named unless it is 0 or the
    failure is internal (whose message is exactly its error id's, `fault`)."""

    def __init__(self, failures: list[RankFailure]) -> None:
        self.failures = failures
        first = failures[0]
        named = first.rank != 0 and first.kind is not FailureKind.INTERNAL
        message = f"on rank {first.rank}: {first.message}" if named else first.message
        self.error: Exception = _ERRORS[first.kind](message)
        super().__init__(message)


def agree(topology: Topology, error: Exception | None) -> None:
    """Collective over every rank: returns when no rank had an error, else raises
    `CommandFailed` on every rank."""
    if topology.layout.world_size == 1:  # a world of one rank agrees with itself
        if error is None:
            return
        raise CommandFailed([RankFailure.of(topology.rank, error)]) from error
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    dist.all_reduce(failed, group=topology.control_group)
    if int(failed.item()) == 0:
        return
    mine = None if error is None else RankFailure.of(topology.rank, error)
    gathered: list[RankFailure | None] = [None] * topology.layout.world_size
    dist.all_gather_object(gathered, mine, group=topology.control_group)
    failures = sorted((f for f in gathered if f is not None), key=lambda f: f.rank)
    if topology.is_leader:  # where to look for the traceback behind rank 0's answer
        for failure in failures:
            if failure.kind is FailureKind.INTERNAL and failure.rank != topology.rank:
                log.error("rank %d failed: %s (in that rank's log)", failure.rank, failure.message)
    raise CommandFailed(failures) from error


def phase(topology: Topology, work: Callable[[], T]) -> T:
    """Runs `work` on this rank, then agrees on the outcome with every rank (see `agree`).

    A `CommandFailed` from a phase nested in `work` was agreed already, by every rank, and
    passes through without another round."""
    error: Exception | None = None
    result: T | None = None
    try:
        result = work()
    except CommandFailed:
        raise
    except (InvalidArgument, FailedPrecondition) as exc:
        # An expected refusal: one line on each rank that refused, its cause only at DEBUG.
        log.warning("rank %d: %s", topology.rank, exc)
        if exc.__cause__ is not None:
            log.debug("rank %d: what the refusal stems from", topology.rank, exc_info=exc)
        error = exc
    except Internal as exc:  # made by `fault`, which logged it
        error = exc
    except Exception as exc:
        error = fault(exc, f"rank {topology.rank}")
    agree(topology, error)
    return cast(T, result)
