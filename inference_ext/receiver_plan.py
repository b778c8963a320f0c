"""A receiver's plan of a version: which boxes of the trainer's Megatron shards it pulls into
staging, and how its HF slices are assembled from them (`plan_receiver`); and the plans it
holds (`ReceiverPlans`): one per trainer layout, replayed (`rebase`) for every later version,
and one per manifest key (a snapshot slot of a trainer met before), replayed without the
manifest. The receiver's `PlanBook` (refit_sidecar/pull/puller.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from inference_ext.expert_slices import expert_sources, parse_target, target_shape
from inference_ext.refit_options import RefitError
from inference_ext.slices import ReceiverLayout, hf_slice
from inference_ext.translate import Source, megatron_sources
from megatron_hf.convert import hf_shape
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import Box, Manifest
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
from refit_sidecar.pull.puller import Order, Planned
from refit_sidecar.service.client import Lease, SidecarClient

log = logging.getLogger(__name__)

_KNOWN_MANIFESTS = 16
"""Plans kept by manifest key: one per snapshot slot of the trainers met lately."""
_HELD_IN_A_ROW = 4
"""Layouts asked about ahead and found held, in a row, after which `prepare_ahead` stops
asking (more than a trainer's usual slots: 2)."""


@dataclass(frozen=True)
class HFSlice:
    """The part `box` of HF tensor `name` (full shape `shape`) this receiver installs,
    assembled from pulled Megatron boxes: (index into the plan's targets, HF sub-box). A fused
    expert target (`expert_slices`) has the worker's local shape, installed whole."""

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
    """(HF name, box this rank keeps, Megatron sources) for each name it keeps anything of; a
    fused expert target (`expert_slices`) is kept whole, in the worker's local shape."""
    out = []
    for name in hf_names:
        target = parse_target(name)
        if target is not None:
            whole = Box.full(target_shape(spec, layout, target))
            out.append((name, whole, expert_sources(spec, layout, target)))
            continue
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
        shape = box.shape if parse_target(name) is not None else hf_shape(name, spec)
        slices.append(HFSlice(name, shape, box, tuple(parts)))
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


class ReceiverPlans:
    """The plans of one receiver (`spec`, `layout`, `hf_names`), by trainer layout and by
    manifest key. `verify`: plans carry the checksums of the version they pull."""

    def __init__(
        self,
        client: SidecarClient,
        spec: ModelSpec,
        layout: ReceiverLayout,
        hf_names: Sequence[str],
        *,
        verify: bool,
    ) -> None:
        self._client = client
        self._spec = spec
        self._layout = layout
        self._hf_names = tuple(hf_names)
        self._verify = verify
        self._by_layout: dict[str, ReceiverPlan] = {}
        self._by_manifest_key: OrderedDict[bytes, tuple[ReceiverPlan, Order]] = OrderedDict()
        """Plans by manifest key, with the manifest's (parameter, shards) order."""
        self._held_in_a_row = 0
        """Layouts `prepare` found held already, since it last planned one."""

    def planned(self, lease: Lease) -> Planned[ReceiverPlan]:
        """The leased version's plan: a version whose manifest key this receiver has met (the
        same slot of the same trainer) replays that plan without GetManifest, with the
        checksums the lease carried when they will be checked."""
        version, key = lease.version, lease.manifest_key
        known = self._by_manifest_key.get(key) if key else None
        if known is not None:
            self._by_manifest_key.move_to_end(key)
            plan, order = known
            if not self._verify:
                pull = replace(plan.pull, version=version)
            elif lease.checksums is not None:
                sums = checksums_by_parameter(order, lease.checksums)
                pull = with_checksums(plan.pull, version, sums)
            else:
                pull = with_checksums(plan.pull, version, self._client.checksums(version))
            return Planned(ReceiverPlan(pull, plan.slices), replanned=False, by_key=True)
        manifest = self._client.manifest(version)
        fresh, replanned = self._plan(manifest)
        if key:
            self._hold(key, fresh, tuple((p.name, len(p.shards)) for p in manifest.parameters))
        return Planned(fresh, replanned=replanned, by_key=False)

    def _hold(self, key: bytes, plan: ReceiverPlan, order: Order) -> None:
        self._by_manifest_key[key] = (plan, order)
        while len(self._by_manifest_key) > _KNOWN_MANIFESTS:
            self._by_manifest_key.popitem(last=False)

    def held(self, key: bytes) -> tuple[ReceiverPlan, Order] | None:
        known = self._by_manifest_key.get(key)
        if known is not None:
            self._by_manifest_key.move_to_end(key)
        return known

    def layout(self, lease: Lease) -> tuple[ReceiverPlan, Order] | None:
        if not lease.manifest_key or not self.prepare(lease.version):
            return None
        return self.held(lease.manifest_key)  # None: the slot's layout changed since the lease

    def prepare_ahead(self, version: int) -> None:
        """`prepare`, when asking for a version ahead, until the layouts asked about were
        held already `_HELD_IN_A_ROW` times in a row (every slot of the trainer met): from
        then on a version costs no manifest, and a layout not met (another trainer) is planned
        by its fetch (`layout`)."""
        if self._held_in_a_row < _HELD_IN_A_ROW:
            self.prepare(version)

    def prepare(self, version: int) -> bool:
        """Before `version` is readable: plans the layout the sidecar gives for it
        (`SidecarClient.pending_manifest`) unless a plan for that layout's key is held; whether
        one is held now. False when the sidecar does not know the layout yet (the version not
        reserved) or cannot be asked, or the layout does not fit (the fetch then finds out)."""
        try:
            manifest, key = self._client.pending_manifest(version)
            if key in self._by_manifest_key:
                self._held_in_a_row += 1
            else:
                self._held_in_a_row = 0
                plan, _ = self._plan(manifest)
                order = tuple((p.name, len(p.shards)) for p in manifest.parameters)
                self._hold(key, plan, order)
        except Exception as e:
            log.debug("no layout of version %d planned ahead: %s", version, e)
            return False
        return True

    def replayed(self, plan: ReceiverPlan, pull: PullPlan) -> ReceiverPlan:
        return ReceiverPlan(pull, plan.slices)

    def _plan(self, manifest: Manifest) -> tuple[ReceiverPlan, bool]:
        key = layout_key(manifest)
        cached = self._by_layout.get(key)
        if cached is not None:
            plan = ReceiverPlan(rebase(cached.pull, manifest, layout=key), cached.slices)
            self._by_layout[key] = plan
            return plan, False
        try:
            plan = plan_receiver(manifest, self._spec, self._layout, self._hf_names)
        except UnsupportedRequest as e:
            raise RefitError(f"the trainer's manifest does not fit this model: {e}") from e
        self._by_layout[key] = plan
        return plan, True
