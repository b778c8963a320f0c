"""Bearer tokens on disk: the roles, token files (one per role, re-read when replaced), and
the server's view of a token directory. Used through `trainer_refit.auth`."""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


class Role(enum.Enum):
    """What a token lets its holder do; the value names the role's token file."""

    ORCHESTRATOR = "orchestrator"
    """Drives the trainer: every TrainerService RPC."""
    TRAINER = "trainer"
    """The trainer's ranks at the sidecar: RegisterTrainer, ReserveSlot, PublishShards."""
    RECEIVER = "receiver"
    """Inference engines at the sidecar: versions, manifests and their own leases."""


def _parse_tokens(raw: bytes, path: Path) -> tuple[str, ...]:
    """The tokens of a token file: one per non-blank line, surrounding whitespace ignored."""
    tokens = []
    for number, line in enumerate(raw.splitlines(), start=1):
        token = line.strip()
        if not token:
            continue
        if not all(0x21 <= byte <= 0x7E for byte in token):
            raise ValueError(
                f"line {number} of token file {path} holds whitespace or characters other "
                "than printable ASCII"
            )
        tokens.append(token.decode("ascii"))
    if not tokens:
        raise ValueError(f"token file {path} is empty")
    return tuple(tokens)


class TokenFile:
    """Tokens read from a file (one per line) and read again whenever the file changes
    (another inode, size or modification time), so replacing the file rotates them without a
    restart. A server accepts every token of the file, a client sends the first: to rotate
    without refusing anyone, add the new token as the first line, then (once every client has
    it) remove the old one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._cached: tuple[tuple[int, int, int, int], tuple[str, ...]] | None = None

    def read(self) -> tuple[str, ...]:
        """The current tokens; OSError or ValueError when the file is missing or invalid."""
        stat = os.stat(self.path)
        signature = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        cached = self._cached
        if cached is not None and cached[0] == signature:
            return cached[1]
        tokens = _parse_tokens(self.path.read_bytes(), self.path)
        self._cached = (signature, tokens)  # one assignment: safe to share between threads
        return tokens


def write_token_dir(directory: Path, roles: Iterable[Role] = tuple(Role)) -> Path:
    """Writes a fresh random token for each role into `directory` (created mode 0700, each
    file mode 0600, replaced atomically); returns `directory`."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    for role in roles:
        tmp = directory / f".{role.value}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
        tmp.replace(directory / role.value)
    return directory


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


class RoleTokens:
    """The server's view of a token directory: which role a presented token belongs to.

    The `required` roles (those the service serves) must have valid token files. Other roles'
    files are read when present, so that a caller using a role's token where that role is not
    allowed is told so (PERMISSION_DENIED) rather than that its token is unknown."""

    def __init__(self, directory: Path, required: Iterable[Role]) -> None:
        self.directory = directory
        self.required = frozenset(required)
        self._files = {role: TokenFile(directory / role.value) for role in Role}
        self._problems: dict[Role, str] = {}
        self._digests: dict[Role, tuple[tuple[str, ...], tuple[bytes, ...]]] = {}
        """Per role, its tokens as last read and their digests: computed again only when the
        file's tokens change (a rotation), not on every call."""

    def _read(self, role: Role) -> tuple[str, ...] | None:
        """The role's tokens; None for an absent file of a role that is not required."""
        try:
            return self._files[role].read()
        except FileNotFoundError:
            if role in self.required:
                raise
            return None

    def check(self) -> None:
        """ValueError naming every required role whose token file is missing, every role
        whose file is unreadable or invalid, and roles that share one token."""
        problems = []
        seen: dict[str, Role] = {}
        for role in Role:
            try:
                tokens = self._read(role)
            except (OSError, ValueError) as e:
                problems.append(f"{role.value}: {describe_error(e)}")
                continue
            for token in tokens or ():
                if seen.get(token, role) is not role:
                    problems.append(f"roles {seen[token].value} and {role.value} share a token")
                seen[token] = role
        if problems:
            raise ValueError(
                f"token directory {self.directory} (one file per role, named by the role): "
                + "; ".join(problems)
            )

    def role_of(self, token: str) -> Role | None:
        """The role one of whose current tokens equals `token`; None when no role's does, or
        when more than one role's does (a misconfiguration authorises nobody). Every token of
        every role is compared, each in constant time (on SHA-256 digests)."""
        presented = _digest(token)
        matches = []
        for role in Role:
            known = [hmac.compare_digest(d, presented) for d in self._digests_of(role)]
            if any(known):
                matches.append(role)
        return matches[0] if len(matches) == 1 else None

    def _digests_of(self, role: Role) -> tuple[bytes, ...]:
        tokens = self._current(role)
        cached = self._digests.get(role)
        if cached is None or cached[0] is not tokens:  # a file read again gives a new tuple
            cached = (tokens, tuple(_digest(t) for t in tokens))
            self._digests[role] = cached
        return cached[1]

    def _current(self, role: Role) -> tuple[str, ...]:
        try:
            tokens = self._read(role)
        except (OSError, ValueError) as e:
            problem = describe_error(e)
            if self._problems.get(role) != problem:
                log.error(
                    "the %s token cannot be read; it authorises nothing: %s", role.value, problem
                )
                self._problems[role] = problem
            return ()
        if self._problems.pop(role, None) is not None:
            log.info("the %s token is readable again", role.value)
        return tokens or ()


def describe_error(error: Exception) -> str:
    """An OS or parsing error in one line, naming the file."""
    if isinstance(error, OSError):
        return f"{error.strerror or type(error).__name__}: {error.filename}"
    return str(error)
