"""What a receiver is told (`RefitOptions`), what it reports (`RefitStats`), and how a refit
fails (`RefitError`).

`RefitOptions` travels as JSON (`collective_rpc`, vLLM's `--additional-config`, the Helm
chart's `refit` section) in one flat object of the keys below (`from_dict`, `to_dict`); in
Python it is typed, in sections: how the receiver authenticates (`ReceiverAuth`), how it reads
the trainer's ranks directly (`DirectOptions`) and through the source tree (`FanOutOptions`).
Every value is checked where it is read, field by field: values arrive as JSON, where "30",
null or NaN are typos.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from refit_sidecar.pull.chunking import DEFAULT_REQUESTS_IN_FLIGHT
from refit_sidecar.pull.leasing import HeldBy
from refit_sidecar.pull.pipelined import DEFAULT_CHUNK_BYTES
from refit_sidecar.pull.running_check import DEFAULT_PART_BYTES
from refit_sidecar.pull.shared_word import DEFAULT_DIR as DEFAULT_PROGRESS_DIR
from refit_sidecar.pull.trace import Event
from trainer_refit.auth import ClientAuth


class RefitError(RuntimeError):
    """A refit did not happen; the receiver still serves the version it served before."""


def _seconds(name: str, value: Any) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def _taper(name: str, value: Any) -> None:
    if not _integer(value) or not 0 <= value <= 8:
        raise ValueError(f"{name} must be an integer from 0 to 8, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ReceiverAuth:
    """How the receiver authenticates at the sidecar (docs/security.md). Either field set is
    checked here; the combination (a token file, or `insecure`) by `client_auth`, which
    `RefitOptions` calls once its other fields are checked."""

    token_file: str | None = None
    """File holding the receiver role's bearer token for the sidecar; required unless
    `insecure`."""
    tls_ca: str | None = None
    """PEM CA bundle of the sidecar's certificate: connect with TLS."""
    tls_cert: str | None = None
    """PEM client certificate (with `tls_key`), for a sidecar that requires mutual TLS."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""
    insecure: bool = False
    """Send no token: the sidecar runs with --insecure."""

    def __post_init__(self) -> None:
        _flag("insecure", self.insecure)
        for name in ("token_file", "tls_ca", "tls_cert", "tls_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a file path or null, got {value!r}")

    def client_auth(self) -> ClientAuth:
        """How this receiver authenticates at the sidecar (ValueError for a combination that
        is not one)."""

        def path(value: str | None) -> Path | None:
            return None if value is None else Path(value)

        return ClientAuth(
            token_file=path(self.token_file),
            tls_ca=path(self.tls_ca),
            tls_cert=path(self.tls_cert),
            tls_key=path(self.tls_key),
            insecure=self.insecure,
        )


@dataclass(frozen=True, kw_only=True)
class DirectOptions:
    """How the receiver reads the trainer's ranks itself (without the source tree)."""

    read_before_readable: bool = True
    """`expect` asks for the next version's lease as soon as its slot is reserved, and the
    fetch reads once the trainer ranks' version words name it, before the sidecar declares it
    readable; its checksums are compared when they come (refit_sidecar/pull/early_reads.py).
    False: the lease comes once the version is readable."""
    read_behind_copy: bool = True
    """With `read_before_readable`, from trainer ranks that copy their snapshots in pieces:
    each READ request is posted once the pieces it reads landed, not once the whole copy did
    (refit_sidecar/pull/piece_gate.py). False: the pull waits for every rank's version word."""
    requests_in_flight: int = DEFAULT_REQUESTS_IN_FLIGHT
    """READ requests (of `NixlConfig.request_bytes`, 256 MiB) of a pull in flight at once, the
    next posted as one completes, in destination order (`NixlConfig.requests_in_flight`); 0:
    all at once."""
    request_taper: int = 0
    """Halvings of the 256 MiB requests, and of the running check's parts, towards the pull's
    end (`NixlConfig.request_taper`): the last bytes land in small requests, leaving small
    sums after the last one (0 to 8)."""

    def __post_init__(self) -> None:
        window = self.requests_in_flight
        if not _integer(window) or window < 0:
            raise ValueError(f"requests_in_flight must be an integer >= 0, got {window!r}")
        _taper("request_taper", self.request_taper)
        _flag("read_before_readable", self.read_before_readable)
        _flag("read_behind_copy", self.read_behind_copy)


@dataclass(frozen=True, kw_only=True)
class FanOutOptions:
    """Whether and how the receiver reads through the sidecar's source tree (docs/fanout.md):
    from the trainer's ranks or from receivers that hold the version, serving its own copy to
    later ones."""

    enabled: bool = False
    """Read through the tree (the JSON key `fanout`)."""
    domain: str = ""
    """Topology domain (node, rack) for the tree: sources of the same domain come first."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes per chunk; a child reads a parent's chunk once the parent has it."""
    chunks_in_flight: int = 4
    """Chunks read at once."""
    chunk_taper: int = 0
    """Halvings of the chunk size towards each end of a source's reads (smaller first and last
    chunks: a child starts and ends closer behind its parent)."""
    stall_timeout_s: float = 5.0
    """A peer whose copy stops advancing for this long is replaced."""
    check_part_bytes: int = DEFAULT_PART_BYTES
    """Bytes per part of the running check; a part's sums start once all of it landed, the
    last after the pull (each part costs kernel launches)."""
    progress_dir: str = DEFAULT_PROGRESS_DIR
    """A directory of shared memory where this receiver mirrors its progress word for
    receivers on its host (refit_sidecar/pull/shared_word.py); "" for none."""

    def __post_init__(self) -> None:
        _seconds("stall_timeout_s", self.stall_timeout_s)
        part = self.check_part_bytes
        if not _integer(part) or part < 1:
            raise ValueError(f"check_part_bytes must be a positive integer, got {part!r}")
        for name in ("chunk_bytes", "chunks_in_flight"):
            value = getattr(self, name)
            if not _integer(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, got {self.chunk_bytes}")
        _taper("chunk_taper", self.chunk_taper)
        if self.chunk_bytes >> self.chunk_taper < 4096:
            raise ValueError(
                f"chunk_bytes {self.chunk_bytes} halved {self.chunk_taper} times is under "
                "4096 bytes"
            )
        if not isinstance(self.domain, str):
            raise ValueError(f"domain must be a string, got {self.domain!r}")
        if not isinstance(self.progress_dir, str) or (
            self.progress_dir and not os.path.isabs(self.progress_dir)
        ):
            raise ValueError(
                f"progress_dir must be an absolute path or empty, got {self.progress_dir!r}"
            )
        _flag("fanout", self.enabled)


_SECTIONS = {"auth": ReceiverAuth, "direct": DirectOptions, "fanout": FanOutOptions}
_RENAMED = {("fanout", "enabled"): "fanout"}
"""Fields whose JSON key is not their name."""


@dataclass(frozen=True, kw_only=True)
class RefitOptions:
    """How a receiver talks to the sidecar and its sources. JSON-friendly (`from_dict`,
    `to_dict`), so it can travel through `collective_rpc` and vLLM's `--additional-config`."""

    receiver_id: str = "receiver"
    """Names this receiver in leases and its NIXL agent (with the TP rank appended)."""
    lease_ttl_s: float = 30.0
    """Lease held on the version while pulling, renewed every third of it for as long as the
    pull takes (`pull.leasing`): how long a receiver that dies mid-pull can keep the trainer
    from reusing the version's snapshot slot."""
    pull_timeout_s: float = 300.0
    connect_timeout_s: float = 30.0
    rpc_timeout_s: float = 30.0
    visible_timeout_s: float = 30.0
    """How long a refit to a version the trainer has returned waits for it to be readable:
    trainer ranks report a version to the sidecar just after the step that made it."""
    verify_checksums: bool = True
    """Check the checksum of every source shard read whole, where staging is: the CRC-32 of a
    host slot's shard, the WSUM-64 of a device slot's (on the receiver's GPU for device
    staging). A mismatch fails the refit; the engine keeps its version."""
    trace_pull: bool = False
    """Record each pull's timeline into its stats (`RefitStats.trace`; diagnosis), through
    the tree and on the direct path."""
    auth: ReceiverAuth = field(default_factory=ReceiverAuth)
    """How to authenticate: a token file or `insecure` must be given."""
    direct: DirectOptions = field(default_factory=DirectOptions)
    fanout: FanOutOptions = field(default_factory=FanOutOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.receiver_id, str) or not self.receiver_id:
            raise ValueError(f"receiver_id must be a non-empty string, got {self.receiver_id!r}")
        for name in (
            "lease_ttl_s",
            "pull_timeout_s",
            "connect_timeout_s",
            "rpc_timeout_s",
            "visible_timeout_s",
        ):
            _seconds(name, getattr(self, name))
        _flag("verify_checksums", self.verify_checksums)
        _flag("trace_pull", self.trace_pull)
        for name, kind in _SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be {kind.__name__}, got {getattr(self, name)!r}")
        self.auth.client_auth()  # the combination is valid

    def client_auth(self) -> ClientAuth:
        """How this receiver authenticates at the sidecar."""
        return self.auth.client_auth()

    @classmethod
    def json_keys(cls) -> tuple[str, ...]:
        """The JSON form's keys, sorted."""
        return tuple(sorted(_KEYS))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> RefitOptions:
        """From the JSON form: one flat object of the keys `json_keys()` names, any of them left
        out."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(_KEYS))
        if unknown:
            raise ValueError(f"unknown refit options {unknown}; known: {list(cls.json_keys())}")
        parts: dict[str | None, dict[str, Any]] = {}
        for key, value in values.items():
            section, name = _KEYS[key]
            parts.setdefault(section, {})[name] = value
        sections = {name: kind(**parts.get(name, {})) for name, kind in _SECTIONS.items()}
        return cls(**parts.get(None, {}), **sections)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`from_dict` reads it back)."""
        out: dict[str, Any] = {}
        for key, (section, name) in _KEYS.items():
            out[key] = getattr(self if section is None else getattr(self, section), name)
        return out


def _keys() -> dict[str, tuple[str | None, str]]:
    """JSON key -> (section, field); None for a field of `RefitOptions` itself."""
    keys: dict[str, tuple[str | None, str]] = {
        f.name: (None, f.name) for f in fields(RefitOptions) if f.name not in _SECTIONS
    }
    for section, kind in _SECTIONS.items():
        for f in fields(kind):
            keys[_RENAMED.get((section, f.name), f.name)] = (section, f.name)
    return keys


_KEYS = _keys()


@dataclass(frozen=True)
class RefitStats:
    """What one receiver did for one `refit_to`; seconds per phase."""

    version: int
    bytes_pulled: int
    plan_s: float
    pull_s: float
    translate_s: float
    install_s: float
    reads: int
    verified_shards: int
    """Shards this receiver read whole and checked against their published checksums."""
    replanned: bool
    """False when the plan of an earlier version was replayed."""
    replayed_by_key: bool = False
    """The plan of an earlier version in the same slot was replayed on its manifest key, so
    no manifest was parsed or rebased."""
    tp_rank: int = 0
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    """Bytes read from each source (a trainer rank's NIXL agent, or a peer receiver's)."""
    leased_at: float = 0.0
    """Wall-clock time (time.time()) the lease (through the tree, with the sources) was in
    hand: before it the receiver waited on the sidecar."""
    sidecar_readable_at: float = 0.0
    """When the version became readable, by the sidecar's clock (0 when unknown)."""
    sidecar_answered_at: float = 0.0
    """When the sidecar built the answer that brought the lease, by its clock: on one host,
    `sidecar_answered_at - sidecar_readable_at` is the sidecar's time to answer and
    `leased_at - sidecar_answered_at` the answer's way to the receiver's thread."""
    pull_started: float = 0.0
    """Wall-clock time (time.time()) of the pull's first read."""
    pull_finished: float = 0.0
    fallbacks: int = 0
    """Sources that failed mid-pull and were replaced (fan-out)."""
    ask_s: float = 0.0
    """Fan-out: seconds of `pull_s` spent asking the sidecar where to read."""
    reading_s: float = 0.0
    """Fan-out: seconds of `pull_s` with reads in flight (of the run that completed it)."""
    gated_s: float = 0.0
    """Fan-out: seconds of `pull_s` waiting for a parent's copy to advance with nothing else
    to read. A slow pull with a large `gated_s` waited on its parent; one with a large
    `reading_s` read slowly. Direct path reading behind the trainer's snapshot copy
    (`DirectOptions.read_behind_copy`): seconds of `pull_s` before its first request was
    posted, waiting for the first pieces."""
    prepared: int = 0
    """Fan-out: chunk requests prepared anew for this pull (a source or chunk not read from
    before), not reused from the transport's cache."""
    asked_ahead: bool = False
    """Fan-out: the lease and the sources came in one call (every fetch after the first), so
    `plan_s` holds the wait for both and `ask_s` is about nothing."""
    routes_left_out: bool = False
    """Fan-out: the sidecar's answer named only its routing key, that of the plan this
    receiver held: it replayed that plan and parsed nothing."""
    expected: bool = False
    """The lease (and, through the tree, the sources) had been asked for before the fetch,
    by `Receiver.expect`."""
    before_readable: bool = False
    """The lease came before the version was readable and the pull started on the sources'
    version words (`DirectOptions.read_before_readable`); `sidecar_readable_at` is then 0."""
    lag_s: float = 0.0
    """Direct path, device staging: seconds from the last byte landed (the end of `pull_s`)
    until the pull's listener lane had started every part of the running check."""
    checksums_wait_s: float = 0.0
    """Then seconds waiting for checksums published after the pull started."""
    check_s: float = 0.0
    """Then seconds to the checksums compared."""
    gate_first_s: float = 0.0
    """Direct path reading behind the copy: seconds of `pull_s` until its first look at the
    sources' pieces landed (`PullStats.gate_first_s`)."""
    gate_first_pieces: int = 0
    """The pieces that held the version at that first look."""
    gate_rounds: int = 0
    """Looks at the sources' pieces during the pull."""
    in_place_bytes: int = 0
    """Bytes the pull landed straight in the engine's tensors (`fetch(..., in_place=...)`,
    inference_ext/staged_tensors.py): nothing was copied for them after it."""
    trace: tuple[Event, ...] = ()
    """With `trace_pull`: the pull's timeline (refit_sidecar/pull/trace.py)."""
    lease_held_by: HeldBy | None = None
    """How the refit knew its lease held the version's slot for the whole pull."""
    lease_s: float = 0.0
    """Of `plan_s`: seconds until the lease was in hand (the sidecar's answer, or taking the
    one asked for ahead); the rest is the manifest (or its key's replay) and the plan."""
    group_verified_shards: int = 0
    """Shards this receiver read part of whose WSUM-64 the engine's workers checked together,
    adding up what each read (docs/refit.md, "Checksums")."""
    unverified_bytes: int = 0
    """When verifying: bytes installed that no checksum covered (parts of shards the
    engine's workers do not read whole between them, a vocabulary's padding; shards
    published without a checksum). 0 with `verify_checksums` off, which checks nothing."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
