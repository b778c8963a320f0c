"""Agreed phases in a real two-rank gloo world: a failure on either rank fails the phase on
both, with the same domain error, and the ranks stay in step for the next collective. A
fault's own text never reaches the answer, only an error id whose traceback the failing rank
logged; an expected refusal is one log line per rank, without a traceback."""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.gloo_ranks import rank_reports
from trainer_svc.config import ParallelLayout
from trainer_svc.domain import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PathNotAllowed,
)
from trainer_svc.runtime.agreement import CommandFailed, phase
from trainer_svc.runtime.topology import Topology

WORLD = 2


def _fail_on(rank: int, error: Exception) -> Callable[[Topology], Any]:
    def work(topology: Topology) -> Any:
        if topology.rank == rank:
            raise error
        return f"done on {topology.rank}"

    return work


def _nested(topology: Topology) -> Any:
    # A failure agreed in an inner phase passes the outer one without another round.
    return phase(topology, lambda: _fail_on(1, FailedPrecondition("inner"))(topology))


def _both_fail_differently(topology: Topology) -> Any:
    raise InvalidArgument(f"bad on {topology.rank}")


def _both_refuse_for_a_cause(topology: Topology) -> Any:
    try:
        raise OSError(28, "No space left on device")
    except OSError as cause:
        raise FailedPrecondition(f"cannot write on {topology.rank}: disk full") from cause


SCENARIOS: dict[str, Callable[[Topology], Any]] = {
    "no failure": lambda topology: f"done on {topology.rank}",
    "rank 1 refuses": _fail_on(1, FailedPrecondition("disk full")),
    "rank 0 breaks": _fail_on(0, OSError(5, "Input/output error")),
    "rank 1 breaks": _fail_on(1, ValueError("replicated parameter 'w' differs on TP ranks")),
    "both refuse": _both_fail_differently,
    "both refuse for a cause": _both_refuse_for_a_cause,
    "nested": _nested,
    "rank 1 finds it exists": _fail_on(1, AlreadyExists("export dir exists")),
    "rank 1 is outside the roots": _fail_on(1, PathNotAllowed("outside the roots")),
}
LOGGED = ("rank 1 breaks", "both refuse for a cause")
"""Scenarios whose log lines each rank reports."""
INTERNAL = re.compile(r"internal error ([0-9a-f]{12}); see the server log")


class _Lines(logging.Handler):
    """Keeps what this rank logs, as the service's handler would write it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(self.format(record))


def _outcome(topology: Topology, work: Callable[[Topology], Any]) -> tuple:
    try:
        return ("ok", phase(topology, lambda: work(topology)))
    except CommandFailed as failed:
        return (type(failed.error).__name__, str(failed.error))


def _rank_main(rank: int, store: str, report: Any) -> None:
    lines = _Lines()
    logging.getLogger().addHandler(lines)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
        topology = Topology(
            layout=ParallelLayout(data_parallel=WORLD),
            rank=rank,
            tp_rank=0,
            pp_rank=0,
            dp_rank=rank,
            tp_group=None,
            pp_group=None,
            dp_group=None,
            control_group=dist.group.WORLD,
        )
        outcomes: dict[str, Any] = {}
        for name, work in SCENARIOS.items():
            lines.text.clear()
            outcomes[name] = _outcome(topology, work)
            if name in LOGGED:
                outcomes[f"{name}: log"] = "\n".join(lines.text)
        # Still in step: one more collective lines up.
        total = torch.tensor([rank + 1])
        dist.all_reduce(total)
        outcomes["in step"] = ("ok", int(total.item()))
        dist.destroy_process_group()
        report.send(outcomes)
    except BaseException:
        report.send(traceback.format_exc())


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, tuple]]:
    store = str(Path(tmp_path_factory.mktemp("agreement")) / "rendezvous")
    return rank_reports(_rank_main, WORLD, store)


def test_without_failures_each_rank_gets_its_own_result(outcomes) -> None:
    assert [o["no failure"] for o in outcomes] == [("ok", "done on 0"), ("ok", "done on 1")]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("rank 1 refuses", (FailedPrecondition.__name__, "on rank 1: disk full")),
        ("both refuse", (InvalidArgument.__name__, "bad on 0")),
        ("nested", (FailedPrecondition.__name__, "on rank 1: inner")),
        # Each keeps its own class, so its own status code, from whichever rank it came.
        ("rank 1 finds it exists", (AlreadyExists.__name__, "on rank 1: export dir exists")),
        ("rank 1 is outside the roots", (PathNotAllowed.__name__, "on rank 1: outside the roots")),
    ],
)
def test_a_failure_on_any_rank_fails_every_rank_alike(outcomes, name, expected) -> None:
    assert [o[name] for o in outcomes] == [expected, expected]


@pytest.mark.parametrize("name", ["rank 0 breaks", "rank 1 breaks"])
def test_a_fault_is_answered_by_its_error_id_alone(outcomes, name) -> None:
    """Neither "OSError: [Errno 5] ..." nor "on rank 1: ValueError: ...": only the id."""
    kinds, messages = zip(*(o[name] for o in outcomes), strict=True)
    assert kinds == (Internal.__name__, Internal.__name__)
    assert messages[0] == messages[1], messages
    assert INTERNAL.fullmatch(messages[0]), messages[0]


def test_the_failing_rank_logs_the_traceback_under_the_error_id(outcomes) -> None:
    name = "rank 1 breaks"
    message = outcomes[0][name][1]
    error_id = INTERNAL.fullmatch(message).group(1)  # type: ignore[union-attr]
    failing, leader = outcomes[1][f"{name}: log"], outcomes[0][f"{name}: log"]
    assert f"rank 1 failed (error {error_id})" in failing, failing
    assert "Traceback" in failing and "differs on TP ranks" in failing, failing
    # Rank 0, which answers, names the rank whose log holds the traceback.
    assert leader == f"ERROR rank 1 failed: {message} (in that rank's log)", leader


def test_an_expected_refusal_is_one_line_per_rank(outcomes) -> None:
    name = "both refuse for a cause"
    assert [o[name] for o in outcomes] == [
        (FailedPrecondition.__name__, "cannot write on 0: disk full")
    ] * 2
    for rank, outcome in enumerate(outcomes):
        log = outcome[f"{name}: log"]
        assert log == f"WARNING rank {rank}: cannot write on {rank}: disk full", log


def test_ranks_stay_in_step_after_failures(outcomes) -> None:
    assert [o["in step"] for o in outcomes] == [("ok", 3), ("ok", 3)]
