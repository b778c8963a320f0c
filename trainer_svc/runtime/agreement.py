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
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from trainer_svc.domain import FailedPrecondition, Internal, InvalidArgument
from trainer_svc.runtime.topology import Topology

log = logging.getLogger(__name__)

T = TypeVar("T")


class FailureKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    FAILED_PRECONDITION = "failed_precondition"
    INTERNAL = "internal"


_ERRORS: dict[FailureKind, type[Exception]] = {
    FailureKind.INVALID_ARGUMENT: InvalidArgument,
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
        for kind, domain_error in _ERRORS.items():
            if isinstance(error, domain_error):
                return cls(rank, kind, str(error))
        return cls(rank, FailureKind.INTERNAL, f"{type(error).__name__}: {error}")


class CommandFailed(Exception):
    """Raised on every rank when a phase failed on any rank. `error` is the domain error to
    answer with: the failure of the lowest failing rank (its rank named unless it is 0)."""

    def __init__(self, failures: list[RankFailure]) -> None:
        self.failures = failures
        first = failures[0]
        message = first.message if first.rank == 0 else f"on rank {first.rank}: {first.message}"
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
        log.warning("rank %d: %s", topology.rank, exc, exc_info=exc.__cause__ is not None)
        error = exc
    except Exception as exc:
        log.exception("rank %d failed", topology.rank)
        error = exc
    agree(topology, error)
    return cast(T, result)
