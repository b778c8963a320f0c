"""The sidecar's domain errors: what its registry raises, its edge maps to status codes,
and its typed client raises again from those codes (so callers in other processes catch
the same classes)."""

from __future__ import annotations


class UnknownVersion(LookupError):
    """The version does not exist or is no longer readable (maps to NOT_FOUND)."""


class UnknownLease(LookupError):
    """The lease does not exist, was released, has expired, or is held by another receiver
    (maps to NOT_FOUND)."""


class NotRegistered(RuntimeError):
    """No trainer has registered in this sidecar's life (it started, or restarted, since):
    the trainer registers again and retries (maps to ABORTED)."""


class Superseded(NotRegistered):
    """The caller's generation is not the current registration: another trainer registered
    since (maps to ABORTED, as NotRegistered; the caller's ranks stop publishing here)."""


class RegistrationHeld(RuntimeError):
    """Another owner's registration is alive: a trainer registering would take its place
    (maps to ALREADY_EXISTS)."""


class SlotsExhausted(RuntimeError):
    """Every slot holds a leased version (maps to RESOURCE_EXHAUSTED)."""


class PublicationPending(RuntimeError):
    """An earlier version is still being published: reservations follow publications in
    order, so the caller waits for it to become visible (maps to FAILED_PRECONDITION when the
    wait runs out)."""
