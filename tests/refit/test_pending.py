"""`pending.Pending`: a call left in flight is converted as its answer arrives (on the thread
that delivers it), once, and `result` then only hands it over; a failure is mapped to the
client's error as it arrives. A `concurrent.futures.Future` stands in for gRPC's future (same
`add_done_callback`, `result(timeout)`, `cancel`); the real calls are exercised end to end
(GetChecksums ahead of a pull, tests/refit/test_before_readable.py)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import grpc
import pytest

from refit_sidecar.pending import Pending


class _Failed(grpc.RpcError):
    pass


def test_an_answer_is_converted_as_it_arrives_and_once() -> None:
    converted: list[str] = []

    def convert(reply: int) -> int:
        converted.append(threading.current_thread().name)
        return reply * 2

    future: Future[Any] = Future()
    pending = Pending(future, convert, lambda error: None)
    assert not converted and not pending.done()
    deliver = threading.Thread(target=future.set_result, args=(21,), name="delivering")
    deliver.start()
    deliver.join()
    assert converted == ["delivering"]  # on the thread that delivered the answer
    assert pending.result() == 42 and pending.result() == 42
    assert converted == ["delivering"]

    done: Future[Any] = Future()
    done.set_result(1)
    assert Pending(done, convert, lambda error: None).result() == 2  # arrived before


def test_a_failure_is_mapped_as_it_arrives() -> None:
    mapped: list[grpc.RpcError] = []

    def map_error(error: grpc.RpcError) -> Exception:
        mapped.append(error)
        return LookupError("no such version")

    future: Future[Any] = Future()
    pending = Pending(future, lambda reply: reply, map_error)
    failure = _Failed()
    future.set_exception(failure)
    assert mapped == [failure]
    with pytest.raises(LookupError, match="no such version") as raised:
        pending.result()
    assert raised.value.__cause__ is failure
    assert isinstance(pending.exception(), LookupError) and len(mapped) == 1
