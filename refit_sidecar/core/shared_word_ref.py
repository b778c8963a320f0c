"""Where a receiver's progress word is mirrored in shared memory, as the wire carries it:
a host and a path a reader on that host may open (`pull/shared_word.py` writes and reads
the file)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

FILE_PREFIX = "trainer-refit-progress."
"""How every mirror file's name begins."""
NAME = re.compile(r"trainer-refit-progress\.(\d{1,20})\.(\d{1,10})\.[0-9a-f]{16}")
"""The only file names a reader opens."""
MAX_PATH = 1024


@dataclass(frozen=True)
class ProgressFileRef:
    """Where a peer's mirrored word lies: on which host, at which path."""

    host: str
    path: str

    def check(self) -> str | None:
        """What is wrong with it as a peer offers it, or None."""
        if not self.host or len(self.host) > 128:
            return "host must be 1-128 characters"
        if len(self.path) > MAX_PATH or not os.path.isabs(self.path):
            return f"path must be absolute and at most {MAX_PATH} characters"
        if not NAME.fullmatch(os.path.basename(self.path)):
            return f"file name must be {FILE_PREFIX}<pid namespace>.<pid>.<16 hex digits>"
        return None
