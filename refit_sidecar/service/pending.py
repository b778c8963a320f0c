"""A unary call to the sidecar left in flight: a lease or sources asked for before the version
is readable, which the sidecar answers the moment the trainer's ranks have published it.

`Pending` wraps gRPC's future of the call. Its `result` is what the blocking call would have
returned, or raises what it would have raised (the client's domain errors); `cancel` ends the
call on both sides if its answer has not arrived yet, so a receiver that closes or wants
another version never waits for a parked call. A cancelled call's `result` raises
`CallCancelled`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc

T = TypeVar("T")


class CallCancelled(RuntimeError):
    """The call was cancelled before its answer arrived."""


class Pending(Generic[T]):
    """`convert(reply)`: the call's value; `map_error(error)`: the domain error for a failed
    call, None to raise the `grpc.RpcError` itself."""

    def __init__(
        self,
        future: Any,
        convert: Callable[[Any], T],
        map_error: Callable[[grpc.RpcError], Exception | None],
    ) -> None:
        self._future = future
        self._convert = convert
        self._map_error = map_error
        self._lock = threading.Lock()
        self._outcome: tuple[T | None, BaseException | None] | None = None

    def done(self) -> bool:
        return bool(self._future.done())

    def cancel(self) -> bool:
        """True when the call was still in flight and is now cancelled; False when its answer
        (or failure) had arrived, which `result` then gives."""
        return bool(self._future.cancel())

    def answered(self) -> bool:
        """Whether the call has come back without an error; never waits, converts nothing."""
        future = self._future
        return bool(future.done()) and not future.cancelled() and future.exception() is None

    def result(self, timeout: float | None = None) -> T:
        value, error = self._settle(timeout)
        if error is not None:
            raise error
        return value  # type: ignore[return-value]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error `result` raises (waiting for the answer); None when it returns."""
        return self._settle(timeout)[1]

    def _settle(self, timeout: float | None) -> tuple[T | None, BaseException | None]:
        """Waits for the answer (TimeoutError after `timeout` seconds); converts it once."""
        with self._lock:
            if self._outcome is not None:
                return self._outcome
            try:
                reply = self._future.result(timeout)  # positional: gRPC names it otherwise
                # on a call that failed before it was sent
            except grpc.FutureCancelledError:
                outcome: tuple[T | None, BaseException | None] = (None, CallCancelled())
            except grpc.FutureTimeoutError:
                raise TimeoutError(f"no answer within {timeout} s") from None
            except grpc.RpcError as error:
                mapped = self._map_error(error)
                if mapped is not None:
                    mapped.__cause__ = error
                outcome = (None, error if mapped is None else mapped)
            else:
                outcome = (self._convert(reply), None)
            self._outcome = outcome
            return outcome
