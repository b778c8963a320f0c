"""One receiver's refit, engine-agnostic: lease a version, pull the slices of it this receiver
needs into a staging buffer, verify them, and only then hand HF-named tensors to an installer.

Nothing reaches the installer until every byte of the version is local and checked, so a
source lost mid-pull, a checksum mismatch or a timeout leaves the engine on its old version.
An engine whose tensors live in staging (`fetch(..., in_place=...)`) has them filled by the
pull itself, and restored from a backup on any failure (inference_ext/staged_tensors.py).
The pull plan is made once per (trainer layout, receiver layout) and replayed (`rebase`) for
every later version; the staging buffer is allocated and registered with NIXL once.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from inference_ext.refit_options import RefitOptions, RefitStats
from inference_ext.slices import ReceiverLayout, hf_slice
from inference_ext.staged_tensors import InPlace, candidates
from inference_ext.translate import Source, megatron_sources
from megatron_hf.convert import hf_shape
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import Box, DType, Manifest, MemType
from refit_sidecar.core.plan import (
    PullPlan,
    UnsupportedRequest,
    Want,
    checksums_by_parameter,
    in_copy_order,
    layout_key,
    plan_pull,
    rebase,
    with_checksums,
)
from refit_sidecar.memory.region import Region
from refit_sidecar.memory.tensor_arena import TorchWords
from refit_sidecar.pull.early_reads import BeforeReadable, EarlyPull
from refit_sidecar.pull.leasing import HeldBy, LeaseLost, LeaseTerms, Leasing
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from refit_sidecar.pull.pipelined import ChunkConfig
from refit_sidecar.pull.trace import Event, PullTrace
from refit_sidecar.pull.transport import PullStats
from refit_sidecar.pull.tree_pull import TreePull, TreePullConfig
from refit_sidecar.service.client import Lease, SidecarClient, UnknownVersion, VersionChecksums
from refit_sidecar.service.pending import Pending

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
}

Installer = Callable[[Iterator[tuple[str, torch.Tensor]]], None]
_KNOWN_MANIFESTS = 16
"""Plans kept by manifest key: one per snapshot slot of the trainers met lately."""


class RefitError(RuntimeError):
    """A refit did not happen; the receiver still serves the version it served before."""


@dataclass(frozen=True)
class HFSlice:
    """The part `box` of HF tensor `name` (full shape `shape`) this receiver installs,
    assembled from pulled Megatron boxes: (index into the plan's targets, HF sub-box)."""

    name: str
    shape: tuple[int, ...]
    box: Box
    parts: tuple[tuple[int, Box], ...]
    contiguous: bool = False
    """The parts lie back to back in staging in the tensor's own row order and cover it
    whole, so the tensor is a view of staging (q, k and v of a TP=1 receiver, for one)."""


@dataclass(frozen=True)
class ReceiverPlan:
    pull: PullPlan
    slices: tuple[HFSlice, ...]


def wanted_slices(
    spec: ModelSpec, layout: ReceiverLayout, hf_names: Sequence[str]
) -> list[tuple[str, Box, list[Source]]]:
    """(HF name, box this rank keeps, Megatron sources) for each name it keeps anything of."""
    out = []
    for name in hf_names:
        box = hf_slice(name, spec, layout)
        if box is not None:
            out.append((name, box, megatron_sources(name, box, spec)))
    return out


def plan_receiver(
    manifest: Manifest, spec: ModelSpec, layout: ReceiverLayout, hf_names: Sequence[str]
) -> ReceiverPlan:
    """Pull plan for this rank's slices, each Megatron box read once even when several HF
    slices use it (a KV head replicated to several query heads' ranks stays one read)."""
    wants: dict[tuple[str, Box], int] = {}
    slices = []
    for name, box, sources in wanted_slices(spec, layout, hf_names):
        parts = []
        for source in sources:
            key = (source.megatron_name, source.megatron_box)
            index = wants.setdefault(key, len(wants))
            parts.append((index, source.hf_box))
        slices.append(HFSlice(name, hf_shape(name, spec), box, tuple(parts)))
    # Staged in the order of the sources' slots: read behind a trainer's snapshot copy, the
    # first requests wait for its first pieces only.
    listed = [Want(name, box) for name, box in wants]
    order = in_copy_order(manifest, listed)
    at = {index: i for i, index in enumerate(order)}
    slices = [replace(s, parts=tuple((at[i], box) for i, box in s.parts)) for s in slices]
    plan = plan_pull(manifest, [listed[i] for i in order])
    return ReceiverPlan(plan, tuple(_mark_contiguous(plan, s) for s in slices))


def _mark_contiguous(plan: PullPlan, hf: HFSlice) -> HFSlice:
    if hf.box != Box.full(hf.shape):
        return hf
    row, end = 0, plan.targets[hf.parts[0][0]].offset
    for index, sub_box in hf.parts:
        target = plan.targets[index]
        rows, rest = sub_box.ranges[0], sub_box.ranges[1:]
        if target.offset != end or rows[0] != row or rest != hf.box.ranges[1:]:
            return hf
        row, end = rows[1], target.offset + target.nbytes
    return replace(hf, contiguous=True)


@dataclass(frozen=True)
class _Pulled:
    stats: PullStats
    bytes_by_source: dict[str, int]
    started: float
    finished: float
    fallbacks: int
    ask_s: float
    reading_s: float = 0.0
    gated_s: float = 0.0
    prepared: int = 0
    asked_ahead: bool = False
    routes_left_out: bool = False
    trace: tuple[Event, ...] = ()


@dataclass(frozen=True)
class _Fetched:
    plan: ReceiverPlan
    pulled: _Pulled
    plan_s: float
    replanned: bool
    by_key: bool
    expected: bool
    leased_at: float
    sidecar_readable_at: float
    sidecar_answered_at: float
    before_readable: bool
    in_place: Mapping[str, torch.Tensor] | None = None
    in_place_key: tuple[Any, ...] = ()
    armed: bool = False
    """The pull landed in adopted engine tensors."""
    held_by: HeldBy = HeldBy.SIDECAR


_VIEWS_KEPT = 4096
"""Typed views of staging kept (`Staging.view`): a few layouts' worth of tensors."""


class Staging:
    """The receiver's destination buffer: one byte tensor on `device`, registered with the
    transport once and regrown only when a plan needs more."""

    def __init__(self, transport: NixlTransport, device: torch.device) -> None:
        self._transport = transport
        self._device = device
        self.buffer = torch.empty(0, dtype=torch.uint8, device=device)
        self.region: Region | None = None
        self._views: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        """Typed views of `buffer` by (offset, dtype, shape): every version of a layout lands
        at the same offsets, so a refit hands over the same views (about 10 us of Python
        each, 2 ms per refit of a 165-tensor model, made once)."""

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes at `offset` as a tensor of `dtype` and `shape` (a view of the buffer)."""
        key = (offset, dtype, shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _VIEWS_KEPT:
                self._views.clear()
            size = math.prod(shape) * dtype.itemsize
            view = self.buffer[offset : offset + size].view(dtype).view(shape)
            self._views[key] = view
        return view

    def ensure(self, nbytes: int) -> Region:
        if self.region is not None and self.region.nbytes >= nbytes:
            return self.region
        self.release()
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self._device)
        cuda = self._device.type == "cuda"
        self.region = Region(
            self.buffer.data_ptr(),
            self.buffer.numel(),
            MemType.VRAM if cuda else MemType.DRAM,
            (self.buffer.device.index or 0) if cuda else 0,
            owner=self.buffer,
        )
        self._transport.register(self.region)
        return self.region

    def release(self) -> None:
        self._views.clear()  # they would keep the old buffer alive
        if self.region is not None:
            self._transport.deregister(self.region)
            self.region = None

    def target(self, plan: PullPlan, index: int) -> torch.Tensor:
        """Pulled target `index` as a tensor (a view of the buffer)."""
        target = plan.targets[index]
        return self.view(target.offset, TORCH_DTYPES[target.dtype], target.box.shape)


class Receiver:
    """Refits one receiver (one vLLM worker, or one HF model) from a sidecar.

    `refit(version, install)` is two-phase so a group of receivers can be atomic: `fetch`
    pulls and verifies (nothing changes for the engine), `install` hands the tensors over.
    """

    def __init__(
        self,
        sidecar: str,
        spec: ModelSpec,
        layout: ReceiverLayout,
        hf_names: Sequence[str],
        *,
        options: RefitOptions,
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.layout = layout
        self.hf_names = tuple(hf_names)
        self.options = options
        self.client = SidecarClient(
            sidecar, timeout=options.rpc_timeout_s, auth=options.client_auth()
        )
        agent = f"{options.receiver_id}-tp{layout.tp_rank}"
        self.agent = agent
        """This receiver's NIXL agent: also its id in the sidecar's source tree."""
        self.transport = NixlTransport.create(
            NixlConfig(
                name=agent,
                connect_timeout_s=options.connect_timeout_s,
                pull_timeout_s=options.pull_timeout_s,
                # Chunked reads: one request per chunk, kept for the next version.
                cache_size=4096 if options.fanout.enabled else NixlConfig.cache_size,
                # Serving a copy: progress the worker for readers between pulls.
                progress_poll_s=0.001 if options.fanout.enabled else None,
                requests_in_flight=options.direct.requests_in_flight,
                request_taper=options.direct.request_taper,
            )
        )
        self.staging = Staging(self.transport, device)
        self.installed_version: int | None = None
        self._plans: dict[str, ReceiverPlan] = {}
        self._by_manifest_key: OrderedDict[
            bytes, tuple[ReceiverPlan, tuple[tuple[str, int], ...]]
        ] = OrderedDict()
        """Plans by manifest key, with the manifest's (parameter, shards) order."""
        self._verifies = options.verify_checksums
        """Checked where staging is: host memory on the CPU, device memory on a GPU."""
        self._tree: TreePull | None = None
        self._leasing = Leasing(
            self.client,
            LeaseTerms(
                receiver_id=options.receiver_id,
                ttl_s=options.lease_ttl_s,
                checksums=self._verifies,
            ),
        )
        """The lease asked ahead, the one the pull holds, and their ends."""
        self._before = BeforeReadable(
            self.client, self.transport, functools.partial(TorchWords, device=device)
        )
        """Direct path: pulls of versions leased before they were readable."""
        if options.fanout.enabled:
            chunks = ChunkConfig(
                chunk_bytes=options.fanout.chunk_bytes,
                window=options.fanout.chunks_in_flight,
                taper=options.fanout.chunk_taper,
                check_part_bytes=options.fanout.check_part_bytes,
                trace=options.trace_pull,
                stall_timeout_s=options.fanout.stall_timeout_s,
            )
            self._tree = TreePull(
                self.client,
                self.transport,
                agent,
                TreePullConfig(
                    chunks=chunks,
                    domain=options.fanout.domain,
                    verify=self._verifies,
                    progress_dir=options.fanout.progress_dir,
                ),
                # Progress words next to the copy: children read them the way they read it.
                words=functools.partial(TorchWords, device=device),
            )
        self._fetched: _Fetched | None = None
        self._staged: ReceiverPlan | None = None
        """The plan of the installed version while staging still holds its bytes."""
        self._in_place = InPlace()
        """The engine tensors living in staging (`fetch(..., in_place=...)`)."""
        self._by_source: tuple[Any, dict[str, int]] = ((), {})
        """The bytes each source gives the last direct plan's reads met (a replayed plan's
        reads are the same objects: counted once, not after every pull)."""

    def latest_version(self) -> int | None:
        return self.client.latest_version()

    def expect(self, version: int, *, wait_s: float | None = None) -> None:
        """Ask the sidecar now for `version`'s lease (through the tree, with its sources), to
        be answered the moment the trainer's ranks have published it, so that the next
        `fetch(version)` reads at once instead of asking then. For a receiver that fetches
        each version as soon as it is readable (a follower): the lease granted holds the
        trainer's slot until that fetch takes it, or for its TTL if none does. The call waits
        on the sidecar for up to `wait_s` (default `visible_timeout_s`); a `fetch` of another
        version, a later `expect` or `close` drops it. Through the tree it needs a first
        pull (until then this does nothing)."""
        wait = self.options.visible_timeout_s if wait_s is None else wait_s
        if not 0 <= wait < math.inf:
            raise ValueError(f"wait_s must be a non-negative number of seconds, got {wait_s!r}")
        options = self.options
        if self._tree is not None:
            self._tree.ask_ahead(
                version, wait_s=wait, lease_ttl_s=options.lease_ttl_s, checksums=self._verifies
            )
        else:
            self._leasing.ask_ahead(
                version, wait_s=wait, before_readable=options.direct.read_before_readable
            )

    def fetch(
        self,
        version: int,
        *,
        visible_timeout_s: float | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        in_place: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Lease `version`, pull and verify this receiver's slices into staging; RefitError
        (with the cause) when any of it fails. A version not readable yet is waited for
        `visible_timeout_s` (default: the options'). `on_progress(filled, total)`: staging
        bytes filled in order so far (with fan-out, as chunks land; else once at the end).

        `in_place`: the engine's tensors by HF name (the same mapping every time), to live in
        staging from this layout's first install on, so that later pulls land in them
        (inference_ext/staged_tensors.py). Between such a fetch and its `install` they hold the new
        version, unchecked until `fetch` returns: the caller must not compute with them; a
        failed fetch or `abandon` restores the installed version. Direct path only."""
        if in_place is not None and self._tree is not None:
            raise ValueError("a fan-out receiver pulls into staging of its own only")
        self.abandon()
        if in_place is None and self._in_place.adopted:
            self._in_place.release()  # this pull would land in them with no backup to restore
        self._staged = None
        begin = time.perf_counter()
        wait = self.options.visible_timeout_s if visible_timeout_s is None else visible_timeout_s
        try:
            if self._tree is not None:
                # One call for the lease and the tree's answer (after a first pull, whose
                # wants and offer it repeats): they come back together. `expect` may have
                # sent it already.
                asked = self._tree.asked(version)
                if not asked:
                    self._tree.ask_ahead(
                        version,
                        wait_s=max(wait, 0.0),
                        lease_ttl_s=self.options.lease_ttl_s,
                        checksums=self._verifies,
                    )
                ahead, refused = self._tree.ahead_lease()
                if isinstance(refused, UnknownVersion) and not asked:
                    wait = 0.0  # waited for already: lease it now if it came meanwhile
                leased = self._leasing.hold(version, ahead, wait_s=wait, expected=asked)
            else:
                ahead = self._leasing.ahead.take(version)
                sums = self._leasing.ahead.take_checksums()
                leased = self._leasing.hold(version, ahead, wait_s=wait, checksums=sums)
        except Exception as e:
            if self._tree is not None:
                self._tree.abandon()
            raise RefitError(f"cannot lease version {version}: {e}") from e
        lease = leased.lease
        early: EarlyPull | None = None
        key: tuple[Any, ...] = ()
        armed = False
        try:
            if lease.pending:
                plan, replanned, by_key, early = self._plan_early(lease, wait, leased.checksums)
            else:
                plan, replanned, by_key = self._plan_for(lease)
            plan_s = time.perf_counter() - begin
            log.debug(
                "version %d: lease %.3f ms, manifest and plan %.3f ms",
                version,
                1e3 * (leased.mark - begin),
                1e3 * (begin + plan_s - leased.mark),
            )
            region = self.staging.ensure(plan.pull.nbytes)
            if in_place is not None:
                key = (id(plan.slices), self.staging.buffer.data_ptr(), id(in_place))
                armed = self._in_place.prepare(key)
            pulled = self._pull(plan.pull, region, on_progress, early)
        except BaseException as e:
            self._in_place.restore()  # the pull may have landed in the engine's tensors
            if self._tree is not None:
                self._tree.abandon()  # when the pull did not take the answer asked ahead
            if early is not None and early.asked is not None:
                early.asked.cancel()
            if early is not None and early.gate is not None:
                early.gate.settle()  # its look may be in flight if the pull never started
            self._leasing.drop(lease)
            if isinstance(e, RefitError) or not isinstance(e, Exception):
                raise
            raise RefitError(f"pulling version {version} failed: {type(e).__name__}: {e}") from e
        unchanged = self._before.unchanged if self._tree is None else None
        try:
            held_by = self._leasing.end(plan.pull, pulled.stats.verified_shards, unchanged)
        except LeaseLost as e:
            self._in_place.restore()
            raise RefitError(str(e)) from None
        self._fetched = _Fetched(
            plan,
            pulled,
            plan_s,
            replanned,
            by_key,
            leased.expected,
            leased.at,
            leased.sidecar_readable_at,
            leased.sidecar_answered_at,
            early is not None,
            in_place,
            key,
            armed,
            held_by,
        )

    def _pull(
        self,
        plan: PullPlan,
        region: Region,
        on_progress: Callable[[int, int], None] | None,
        early: EarlyPull | None = None,
    ) -> _Pulled:
        if self._tree is not None:
            deadline = time.monotonic() + self.options.pull_timeout_s
            tree = self._tree.pull(plan, region, deadline=deadline, on_progress=on_progress)
            stats = PullStats(
                tree.nbytes, tree.seconds, tree.reads, tree.chunks, 0, tree.verified_shards
            )
            return _Pulled(
                stats,
                tree.bytes_by_source,
                tree.started,
                tree.finished,
                tree.fallbacks,
                tree.ask_s,
                tree.reading_s,
                tree.gated_s,
                tree.prepared,
                tree.asked_ahead,
                tree.routes_left_out,
                tree.trace,
            )
        started = time.time()
        stats = self.transport.pull(
            plan,
            region,
            verify=self._verifies,
            checksums_later=None if early is None else early.checksums,
            gate=None if early is None else early.gate,
            trace=PullTrace() if self.options.trace_pull else None,
        )
        counted, by_source = self._by_source
        if counted is not plan.reads:
            by_source = {}
            for reads in plan.reads:
                agent = reads.location.agent
                by_source[agent] = by_source.get(agent, 0) + reads.nbytes
            self._by_source = (plan.reads, by_source)
        if on_progress is not None:
            on_progress(plan.nbytes, plan.nbytes)
        return _Pulled(
            stats,
            dict(by_source),
            started,
            time.time(),
            0,
            0.0,
            gated_s=stats.gated_s,
            trace=stats.trace,
        )

    def _plan_for(self, lease: Lease) -> tuple[ReceiverPlan, bool, bool]:
        """The leased version's plan, whether it was planned anew, and whether it was replayed
        by manifest key: a version whose manifest key this receiver has met (the same slot of
        the same trainer) replays that plan without GetManifest, with the checksums the lease
        carried when they will be checked."""
        version, key = lease.version, lease.manifest_key
        known = self._by_manifest_key.get(key) if key else None
        if known is not None:
            self._by_manifest_key.move_to_end(key)
            plan, order = known
            if not self._verifies:
                pull = replace(plan.pull, version=version)
            elif lease.checksums is not None:
                sums = checksums_by_parameter(order, lease.checksums)
                pull = with_checksums(plan.pull, version, sums)
            else:
                pull = with_checksums(plan.pull, version, self.client.checksums(version))
            return ReceiverPlan(pull, plan.slices), False, True
        manifest = self.client.manifest(version)
        fresh, replanned = self._plan(manifest)
        if key:
            order = tuple((p.name, len(p.shards)) for p in manifest.parameters)
            self._by_manifest_key[key] = (fresh, order)
            while len(self._by_manifest_key) > _KNOWN_MANIFESTS:
                self._by_manifest_key.popitem(last=False)
        return fresh, replanned, False

    def _plan_early(
        self, lease: Lease, wait: float, asked: Pending[VersionChecksums] | None
    ) -> tuple[ReceiverPlan, bool, bool, EarlyPull | None]:
        """The plan of a version leased before it was readable, as `_plan_for`, and what its
        pull needs: the plan held for the lease's manifest key, once the sources' version
        words name the version. A key this receiver has not met (its first version from that
        slot) is planned from the manifest once the version is readable."""
        deadline = time.monotonic() + max(wait, 0.0)
        known = self._by_manifest_key.get(lease.manifest_key)
        if known is None:
            if asked is None:
                asked = self.client.checksums_later(lease.version, wait_s=max(wait, 0.0))
            asked.result()  # answered once the version is readable
            plan, replanned, by_key = self._plan_for(replace(lease, pending=False))
            return plan, replanned, by_key, None
        self._by_manifest_key.move_to_end(lease.manifest_key)
        plan, order = known
        early = self._before.start(
            lease,
            plan.pull,
            order,
            verify=self._verifies,
            deadline=deadline,
            asked=asked,
            behind_copy=self.options.direct.read_behind_copy,
        )
        return ReceiverPlan(early.plan, plan.slices), False, True, early

    def install(self, installer: Installer) -> RefitStats:
        """Hand the fetched version to `installer` as (HF name, full-shape tensor) pairs in HF
        order; only this receiver's box of each tensor is filled (its loader reads no more)."""
        if self._fetched is None:
            raise RefitError("nothing fetched to install")
        fetched = self._fetched
        plan, pulled = fetched.plan, fetched.pulled
        stats = pulled.stats
        # Pulled into the engine's tensors, or cast into them below: nothing to hand over.
        in_place = self._in_place
        landed = in_place.names if fetched.armed else frozenset()
        translate_s = 0.0

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal translate_s
            for hf in plan.slices:
                if hf.name in landed:
                    continue
                start = time.perf_counter()
                tensor = self._assemble(plan.pull, hf)
                translate_s += time.perf_counter() - start
                yield hf.name, tensor

        start = time.perf_counter()
        try:
            installer(tensors())
            if fetched.armed:
                in_place.cast_in()
            if fetched.in_place is not None:
                self._settle(fetched)
        except BaseException:
            self.abandon()  # tensors in staging go back; the installer's own are its own
            raise
        self._fetched = None
        install_s = time.perf_counter() - start - translate_s
        self.installed_version = plan.pull.version
        self._staged = plan
        return RefitStats(
            version=plan.pull.version,
            bytes_pulled=stats.nbytes,
            plan_s=fetched.plan_s,
            pull_s=stats.seconds,
            translate_s=translate_s,
            install_s=install_s,
            reads=stats.reads,
            verified_shards=stats.verified_shards,
            replanned=fetched.replanned,
            replayed_by_key=fetched.by_key,
            tp_rank=self.layout.tp_rank,
            bytes_by_source=dict(pulled.bytes_by_source),
            leased_at=fetched.leased_at,
            sidecar_readable_at=fetched.sidecar_readable_at,
            sidecar_answered_at=fetched.sidecar_answered_at,
            pull_started=pulled.started,
            pull_finished=pulled.finished,
            fallbacks=pulled.fallbacks,
            ask_s=pulled.ask_s,
            reading_s=pulled.reading_s,
            gated_s=pulled.gated_s,
            prepared=pulled.prepared,
            asked_ahead=pulled.asked_ahead,
            routes_left_out=pulled.routes_left_out,
            expected=fetched.expected,
            before_readable=fetched.before_readable,
            trace=pulled.trace,
            lag_s=stats.lag_s,
            checksums_wait_s=stats.checksums_wait_s,
            check_s=stats.check_s,
            gate_first_s=stats.gate_first_s,
            gate_first_pieces=stats.gate_first_pieces,
            gate_rounds=stats.gate_rounds,
            in_place_bytes=self._in_place.nbytes if fetched.armed else 0,
            lease_held_by=fetched.held_by,
        )

    def _settle(self, fetched: _Fetched) -> None:
        """After an install with `in_place`: back staging up (the tensors live there), or
        adopt them after this layout's first install."""
        assert fetched.in_place is not None
        if fetched.armed:
            self._in_place.back_up()
            return
        plan = fetched.plan
        views = {}
        for hf in plan.slices:
            whole = zip(hf.box.ranges, hf.shape, strict=True)
            if hf.contiguous and all(lo == 0 and hi == dim for (lo, hi), dim in whole):
                views[hf.name] = self._assemble(plan.pull, hf)
        staging = self.staging.buffer[: plan.pull.nbytes]
        held = (plan.slices, fetched.in_place)  # what the key names by id
        live, cast = candidates(views, fetched.in_place)
        self._in_place.adopt(fetched.in_place_key, live, staging, held, cast)

    def abandon(self) -> None:
        """Drop the version fetched and not installed: engine tensors the pull landed in
        get back what they held (the engine is on its old version)."""
        fetched, self._fetched = self._fetched, None
        if fetched is not None and fetched.armed:
            self._in_place.restore()

    def slices(self, names: Sequence[str] | None = None) -> dict[str, tuple[Box, torch.Tensor]]:
        """The HF slices (box, tensor copy) of the installed version, read back from staging:
        what the installer was given. Empty once a later fetch reused the staging buffer."""
        plan = self._staged
        if plan is None:
            return {}
        wanted = set(names) if names is not None else None
        out = {}
        for hf in plan.slices:
            if wanted is None or hf.name in wanted:
                full = self._assemble(plan.pull, hf)
                out[hf.name] = (hf.box, full[_index(hf.box)].clone())
        return out

    def _plan(self, manifest: Manifest) -> tuple[ReceiverPlan, bool]:
        key = layout_key(manifest)
        cached = self._plans.get(key)
        if cached is not None:
            plan = ReceiverPlan(rebase(cached.pull, manifest, layout=key), cached.slices)
            self._plans[key] = plan
            return plan, False
        try:
            plan = plan_receiver(manifest, self.spec, self.layout, self.hf_names)
        except UnsupportedRequest as e:
            raise RefitError(f"the trainer's manifest does not fit this model: {e}") from e
        self._plans[key] = plan
        return plan, True

    def _assemble(self, pull: PullPlan, hf: HFSlice) -> torch.Tensor:
        first = pull.targets[hf.parts[0][0]]
        dtype = TORCH_DTYPES[first.dtype]
        if hf.contiguous:
            return self.staging.view(first.offset, dtype, hf.shape)
        full = torch.empty(hf.shape, dtype=dtype, device=self.staging.buffer.device)
        for index, sub_box in hf.parts:
            full[_index(sub_box)].copy_(self.staging.target(pull, index))
        return full

    def close(self) -> None:
        self._in_place.close()
        self._leasing.close()
        if self._tree is not None:
            self._tree.close()
        self.staging.release()
        self._before.release()
        self.transport.close()
        self.client.close()


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box.ranges)
