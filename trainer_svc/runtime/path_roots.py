"""The directories SaveCheckpoint, LoadCheckpoint and ExportHF may use.

A request's path is confined once, on rank 0, before any rank acts (the servicer makes it
absolute, the engine's precheck confines it again): it must have no `..` component, and its
real path (every symlink followed, including one planted inside a root that points outside)
must be a root or lie below one. A relative path lies under the first root. Roots are compared
component by component, so `/data/ckpt-evil` is not inside `/data/ckpt`. The ranks then act on
the real path, which held no symlink when it was checked; a process that can write inside a
root can still swap a directory for a symlink after the check, so only the service should
write there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer_refit.errors import quoted
from trainer_svc.domain import InvalidArgument, PathNotAllowed

_SHOWN_CHARS = 160
"""Characters of a path (requested, resolved or a root) a refusal echoes."""


@dataclass(frozen=True)
class PathRoots:
    roots: tuple[Path, ...]
    """Absolute directories, kept as their real paths (`resolved`)."""

    def __post_init__(self) -> None:
        if not self.roots:
            raise ValueError("at least one path root is needed")
        for root in self.roots:
            if not root.is_absolute() or "\0" in str(root):
                raise ValueError(f"path roots must be absolute directories, got {str(root)!r}")

    @classmethod
    def resolved(cls, directories: Sequence[Path]) -> PathRoots:
        """Roots at the real paths of `directories` (which need not exist yet)."""
        for directory in directories:
            if not directory.is_absolute():
                raise ValueError(f"path roots must be absolute directories, got {directory}")
        return cls(tuple(Path(os.path.realpath(d)) for d in directories))

    def describe(self) -> str:
        return ", ".join(quoted(str(root), _SHOWN_CHARS) for root in self.roots)

    def contains(self, real: Path) -> bool:
        return any(real == root or root in real.parents for root in self.roots)

    def confine(self, path: Path) -> Path:
        """The real path of `path` (relative: under the first root). InvalidArgument for a
        NUL byte; PathNotAllowed for a `..` component or a real path outside every root."""
        shown = quoted(str(path), _SHOWN_CHARS)
        if "\0" in str(path):
            raise InvalidArgument(f"paths must not contain NUL bytes, got {shown}", field="path")
        if ".." in path.parts:
            raise PathNotAllowed(
                f"{shown} has a '..' component, which checkpoint and export paths may not "
                f"have; name a directory under the allowed roots ({self.describe()})"
            )
        absolute = path if path.is_absolute() else self.roots[0] / path
        real = Path(os.path.realpath(absolute))
        if not self.contains(real):
            via = "" if real == absolute else f" (it resolves to {quoted(str(real), _SHOWN_CHARS)})"
            raise PathNotAllowed(
                f"{shown} is outside the allowed roots{via}: checkpoint and export paths must "
                f"lie under {self.describe()} (trainer-svc --path-root)"
            )
        return real
