"""What the demo shows on its terminal, and where everything else goes.

The terminal carries the demo's own output only: progress bars, one line per weights version
and the summary. Everything else written to this process's stdout and stderr goes to a log
file: vLLM's logging and prints in this process, Python warnings, and all output of the engine
processes vLLM starts, which inherit those file descriptors when they are spawned.

`routed_output(log_path)` points file descriptors 1 and 2 at the log for the duration of the
block and hands the demo a `Console` on the original terminal; at the end (also on an
exception, whose traceback then reaches the terminal) it puts them back. With no log path
nothing is redirected and library output shares the terminal (the demo's ``--verbose``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")


@dataclass(frozen=True)
class Console:
    """The demo's terminal: results on `out`, progress bars and failures on `err`."""

    out: TextIO
    err: TextIO
    log_path: Path | None
    """Where library output goes; None when it shares the terminal."""

    def line(self, text: str) -> None:
        """A result line, written between the progress bars without tearing them."""
        with tqdm.external_write_mode(file=self.err):
            print(text, file=self.out, flush=True)

    def error(self, text: str) -> None:
        with tqdm.external_write_mode(file=self.err):
            print(text, file=self.err, flush=True)

    def progress(self, iterable: Iterable[T], **options: Any) -> tqdm[T]:
        return tqdm(iterable, file=self.err, **options)


@contextmanager
def routed_output(log_path: Path | None) -> Iterator[Console]:
    """A `Console` on the terminal while stdout and stderr (descriptors 1 and 2, for this
    process and every process it starts meanwhile) append to `log_path`; None: no routing."""
    if log_path is None:
        yield Console(sys.stdout, sys.stderr, None)
        return
    with ExitStack() as stack:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        stack.callback(os.close, log)
        out = _terminal_stream(1, stack)
        err = _terminal_stream(2, stack)
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            stack.callback(_point, fd, os.dup(fd), stream)
            stream.flush()
            os.dup2(log, fd)
        yield Console(out, err, log_path)


def _terminal_stream(fd: int, stack: ExitStack) -> TextIO:
    """A text stream on a duplicate of `fd` as it is now (the terminal)."""
    encoding = (sys.stdout if fd == 1 else sys.stderr).encoding or "utf-8"
    stream = open(os.dup(fd), "w", buffering=1, encoding=encoding, errors="replace")  # noqa: SIM115
    stack.callback(stream.close)
    return stream


def _point(fd: int, saved: int, stream: TextIO) -> None:
    """Point `fd` back at `saved` (then closed), once `stream`'s buffered text went out."""
    stream.flush()
    os.dup2(saved, fd)
    os.close(saved)
