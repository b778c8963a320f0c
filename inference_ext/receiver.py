"""One receiver's refit, engine-agnostic: lease a version, plan and pull the slices of it this
receiver needs into a staging buffer, verify them, and only then hand HF-named tensors to an
installer.

`fetch` is lease → plan → pull → end through the receiver's puller (refit_sidecar/pull/
puller.py: straight from the trainer's ranks, or through the source tree, as the options
say), with this receiver's plans (receiver_plan.py); `install` assembles the HF tensors from
staging. Nothing reaches the installer until every byte of the version is local and checked,
so a source lost mid-pull, a checksum mismatch or a timeout leaves the engine on its old
version. An engine whose tensors live in staging (`fetch(..., in_place=...)`) has them filled
by the pull itself, and restored from a backup on any failure (staged_tensors.py). The
staging buffer is allocated and registered with NIXL once.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inference_ext.receiver_plan import HFSlice, ReceiverPlan, ReceiverPlans
from inference_ext.refit_options import RefitError, RefitOptions, RefitStats
from inference_ext.slices import ReceiverLayout
from inference_ext.staged_tensors import InPlace, candidates
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import Box, DType, MemType
from refit_sidecar.core.plan import PullPlan
from refit_sidecar.integrity.device_sums import warm_up
from refit_sidecar.integrity.partial_sums import PartialSums
from refit_sidecar.integrity.verify import unverified_bytes
from refit_sidecar.memory.region import Region
from refit_sidecar.memory.tensor_arena import TorchWords
from refit_sidecar.pull.direct_puller import DirectConfig, DirectPuller
from refit_sidecar.pull.leasing import HeldBy, Leased, LeaseLost, LeaseTerms, Leasing
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from refit_sidecar.pull.pipelined import ChunkConfig
from refit_sidecar.pull.puller import Planned, Pulled, Puller
from refit_sidecar.pull.tree_pull import TreePull, TreePullConfig
from refit_sidecar.pull.tree_puller import TreePuller
from refit_sidecar.service.client import SidecarClient

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
}

Installer = Callable[[Iterator[tuple[str, torch.Tensor]]], None]


@dataclass(frozen=True)
class _Fetched:
    """A version fetched and not installed yet."""

    planned: Planned[ReceiverPlan]
    leased: Leased
    pulled: Pulled
    lease_s: float
    plan_s: float
    held_by: HeldBy
    in_place: Mapping[str, torch.Tensor] | None = None
    in_place_key: tuple[Any, ...] = ()
    armed: bool = False
    """The pull landed in adopted engine tensors."""

    @property
    def plan(self) -> ReceiverPlan:
        return self.planned.plan


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
        at the same offsets, so a refit hands over the same views, made once (each costs
        Python time, times every tensor of the model)."""

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
        if options.verify_checksums:
            warm_up(device)  # compiled now, not in the first refit's check
        self.staging = Staging(self.transport, device)
        self.installed_version: int | None = None
        self._plans = ReceiverPlans(
            self.client, spec, layout, self.hf_names, verify=options.verify_checksums
        )
        self._puller = _puller(self.client, self.transport, agent, options, device)
        """Leases, pulls and ends the lease: directly from the trainer's ranks, or through
        the source tree."""
        self._fetched: _Fetched | None = None
        self._staged: ReceiverPlan | None = None
        """The plan of the installed version while staging still holds its bytes."""
        self._in_place = InPlace()
        """The engine tensors living in staging (`fetch(..., in_place=...)`)."""

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
        pull (until then this does nothing). A direct receiver also plans the layout the
        version will have when it has no plan for it yet (the first version into one of the
        trainer's slots), so that its pull too reads behind the trainer's copy."""
        wait = self.options.visible_timeout_s if wait_s is None else wait_s
        if not 0 <= wait < math.inf:
            raise ValueError(f"wait_s must be a non-negative number of seconds, got {wait_s!r}")
        self._puller.expect(version, wait_s=wait)
        if not self.options.fanout.enabled:
            self._plans.prepare_ahead(version)

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
        if in_place is not None and self.options.fanout.enabled:
            raise ValueError("a fan-out receiver pulls into staging of its own only")
        self.abandon()
        if in_place is None and self._in_place.adopted:
            self._in_place.release()  # this pull would land in them with no backup to restore
        self._staged = None
        begin = time.perf_counter()
        wait = self.options.visible_timeout_s if visible_timeout_s is None else visible_timeout_s
        try:
            leased = self._puller.lease(version, wait_s=wait)
        except Exception as e:
            raise RefitError(f"cannot lease version {version}: {e}") from e
        planned: Planned[ReceiverPlan] | None = None
        key: tuple[Any, ...] = ()
        armed = False
        try:
            planned = self._puller.plan(leased, self._plans, wait_s=wait)
            plan_s = time.perf_counter() - begin
            lease_s = leased.mark - begin
            log.debug(
                "version %d: lease %.3f ms, manifest and plan %.3f ms",
                version,
                1e3 * lease_s,
                1e3 * (plan_s - lease_s),
            )
            plan = planned.plan
            region = self.staging.ensure(plan.pull.nbytes)
            if in_place is not None:
                key = (id(plan.slices), self.staging.buffer.data_ptr(), id(in_place))
                armed = self._in_place.prepare(key)
            pulled = self._puller.pull(planned, region, on_progress)
        except BaseException as e:
            self._in_place.restore()  # the pull may have landed in the engine's tensors
            self._puller.fail(leased, planned)
            if isinstance(e, RefitError) or not isinstance(e, Exception):
                raise
            raise RefitError(f"pulling version {version} failed: {type(e).__name__}: {e}") from e
        try:
            held_by = self._puller.end(planned, pulled)
        except LeaseLost as e:
            self._in_place.restore()
            raise RefitError(str(e)) from None
        self._fetched = _Fetched(
            planned, leased, pulled, lease_s, plan_s, held_by, in_place, key, armed
        )

    def partial_sums(self) -> PartialSums | None:
        """The WSUM-64s of the fetched version's reads of parts of shards, which this receiver
        cannot check alone (`partial_sums`): the engine's workers add them up before any of
        them installs (`group_check.py`). None when nothing is fetched or nothing verified."""
        fetched = self._fetched
        return None if fetched is None else fetched.pulled.stats.partial_sums

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
            replanned=fetched.planned.replanned,
            replayed_by_key=fetched.planned.by_key,
            tp_rank=self.layout.tp_rank,
            bytes_by_source=dict(pulled.bytes_by_source),
            leased_at=fetched.leased.at,
            sidecar_readable_at=fetched.leased.sidecar_readable_at,
            sidecar_answered_at=fetched.leased.sidecar_answered_at,
            pull_started=pulled.started,
            pull_finished=pulled.finished,
            fallbacks=pulled.fallbacks,
            ask_s=pulled.ask_s,
            reading_s=pulled.reading_s,
            gated_s=pulled.gated_s,
            prepared=pulled.prepared,
            asked_ahead=pulled.asked_ahead,
            routes_left_out=pulled.routes_left_out,
            expected=fetched.leased.expected,
            before_readable=fetched.planned.early is not None,
            trace=pulled.trace,
            lag_s=stats.lag_s,
            checksums_wait_s=stats.checksums_wait_s,
            check_s=stats.check_s,
            gate_first_s=stats.gate_first_s,
            gate_first_pieces=stats.gate_first_pieces,
            gate_rounds=stats.gate_rounds,
            in_place_bytes=self._in_place.nbytes if fetched.armed else 0,
            lease_held_by=fetched.held_by,
            lease_s=fetched.lease_s,
            unverified_bytes=self._unverified_bytes(plan.pull),
        )

    def _unverified_bytes(self, pull: PullPlan) -> int:
        """Bytes of `pull` this receiver's own check did not cover, when it checks."""
        region = self.staging.region
        if not self.options.verify_checksums or region is None:
            return 0
        return unverified_bytes(pull, region)

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
        self._puller.close()
        self.staging.release()
        self.transport.close()
        self.client.close()


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box.ranges)


def _puller(
    client: SidecarClient,
    transport: NixlTransport,
    agent: str,
    options: RefitOptions,
    device: torch.device,
) -> Puller:
    """The receiver's puller as `options` say: through the source tree with fan-out, else
    straight from the trainer's ranks. Progress and version words live where staging is (a
    GPU's in device memory): children read them the way they read the copy."""
    verify = options.verify_checksums  # where staging is: host memory, or the GPU's
    terms = LeaseTerms(receiver_id=options.receiver_id, ttl_s=options.lease_ttl_s, checksums=verify)
    leasing = Leasing(client, terms)
    words = functools.partial(TorchWords, device=device)
    fanout = options.fanout
    if not fanout.enabled:
        direct = DirectConfig(
            before_readable=options.direct.read_before_readable,
            behind_copy=options.direct.read_behind_copy,
            verify=verify,
            trace=options.trace_pull,
        )
        return DirectPuller(client, transport, leasing, direct, words=words)
    chunks = ChunkConfig(
        chunk_bytes=fanout.chunk_bytes,
        window=fanout.chunks_in_flight,
        taper=fanout.chunk_taper,
        check_part_bytes=fanout.check_part_bytes,
        trace=options.trace_pull,
        stall_timeout_s=fanout.stall_timeout_s,
    )
    config = TreePullConfig(
        chunks=chunks, domain=fanout.domain, verify=verify, progress_dir=fanout.progress_dir
    )
    tree = TreePull(client, transport, agent, config, words=words)
    return TreePuller(leasing, tree, pull_timeout_s=options.pull_timeout_s)
