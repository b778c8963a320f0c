"""A serving receiver's progress word mirrored in a file of shared memory (docs/fanout.md,
step 4).

A child follows its parent's copy by reading the parent's progress word (`progress.py`) again
and again. Read one-sidedly from device memory, each look is a copy between two GPU buffers and
one back to the host, and on a GPU several receivers share it waits behind the other processes'
work while the receivers' checks run, and each level of a chain saw its parent's last chunk
that much later. A child on
the parent's host reads this file instead: the same 24 bytes, stored in the same order with
plain 8-byte stores, read back with plain 8-byte loads (each atomic where aligned), no GPU and
no NIXL per look. The word in registered memory stays: readers on other hosts use it, and every
reader keeps reading it now and then, because a read from a dead process fails at once while
its file just stops changing.

Files live in a directory of shared memory (`/dev/shm`), named
`trainer-refit-progress.<pid namespace>.<pid>.<token>`. A file goes at `close`, or when the
process that made it exits without closing it; creating one removes those of processes of its
PID namespace that are gone (a receiver killed before it closed), so they do not pile up; a
file of another namespace is never taken for a dead process's. A reader opens only a file
of that name (no symbolic link, a regular file of `FILE_BYTES`) on its own host: the host's
identity is its kernel's boot id, which containers on one host share. A file it cannot open
(another mount namespace) means reading the word one-sidedly, as before.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import multiprocessing.util
import os
import secrets
import stat
from pathlib import Path

import numpy as np

from refit_sidecar.core.shared_word_ref import FILE_PREFIX, NAME, ProgressFileRef

log = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm"
FILE_BYTES = 64
"""The file's size: the 24-byte word at offset 0, the rest zero."""


@functools.cache
def host_id() -> str:
    """This host's identity (its kernel's boot id); "" where it cannot be read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@functools.cache
def _pid_namespace() -> int:
    """This process's PID namespace (its inode); 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class ProgressFile:
    """The writer's file: `store(index, value)` stores one of the three words."""

    def __init__(self, path: str, mapped: mmap.mmap) -> None:
        self.ref = ProgressFileRef(host_id(), path)
        self._mapped = mapped
        self._words: np.ndarray | None = np.frombuffer(mapped, dtype="<u8", count=3)
        # Removed by `close`, or when this process exits without closing it: an engine's
        # worker shut down by its engine (SIGTERM, then the process's normal exit) never
        # closes its receiver. Only the creating process removes it (a forked child does
        # not), and a process killed outright leaves it to the next sweep.
        self._remove = multiprocessing.util.Finalize(self, _unlink, args=(path,), exitpriority=0)

    @classmethod
    def create(cls, directory: str = DEFAULT_DIR) -> ProgressFile | None:
        """A new file in `directory`; None (logged) where it cannot be made, or the host has
        no identity: the word is then read one-sidedly only."""
        if not host_id():
            return None
        _sweep(directory)
        name = f"{FILE_PREFIX}{_pid_namespace()}.{os.getpid()}.{secrets.token_hex(8)}"
        path = os.path.join(directory, name)
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            log.info(
                "no progress file in %s (%s): children read the word one-sidedly", directory, e
            )
            return None
        try:
            os.ftruncate(fd, FILE_BYTES)
            mapped = mmap.mmap(fd, FILE_BYTES)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the file
        return cls(path, mapped)

    def store(self, index: int, value: int) -> None:
        assert self._words is not None, "the progress file was closed"
        self._words[index] = value  # one aligned 8-byte store

    def close(self) -> None:
        """Remove the file (readers holding it open see it stop changing)."""
        if self._words is None:
            return
        self._words = None
        self._mapped.close()
        self._remove()


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class ProgressFileReader:
    """A peer's mirrored word, opened read-only."""

    def __init__(self, mapped: mmap.mmap) -> None:
        self._mapped = mapped
        self._words: np.ndarray | None = np.frombuffer(mapped, dtype="<u8", count=3)

    @classmethod
    def open(cls, ref: ProgressFileRef) -> ProgressFileReader | None:
        """The file, where it is on this host and can be opened as the writer made it; None
        otherwise (the word is then read one-sidedly)."""
        if ref.host != host_id() or ref.check() is not None:
            return None
        try:
            fd = os.open(ref.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != FILE_BYTES:
                return None
            mapped = mmap.mmap(fd, FILE_BYTES, prot=mmap.PROT_READ)
        except OSError:
            return None
        finally:
            os.close(fd)
        return cls(mapped)

    def read(self) -> np.ndarray:
        """The 24 bytes of the word, each 8-byte word loaded once (whole)."""
        assert self._words is not None, "the progress file reader was closed"
        words = self._words
        return np.array([words[0], words[1], words[2]], dtype="<u8").view(np.uint8)

    def close(self) -> None:
        if self._words is not None:
            self._words = None
            self._mapped.close()


def _sweep(directory: str) -> None:
    """Remove the progress files of processes of this PID namespace no longer running."""
    namespace = _pid_namespace()
    if not namespace:
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = NAME.fullmatch(name)
        if match is None or int(match.group(1)) != namespace:
            continue
        pid = int(match.group(2))
        if pid == os.getpid() or _alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
