"""Predicted refit time against the number of receivers, for star, tree and pipelined tree.

A model, not a measurement: a torch-free chunk-level simulation of issue 14's fan-out. The
trees are the ones `refit_sidecar.service.tree.Tree` assigns when every receiver asks at once; the
timing model (docs/fanout.md says why these assumptions):

- the model is `model_bytes` read in chunks of `chunk_bytes` (the last one shorter);
- a source sends `bandwidth` bytes/s in all, split evenly among the children reading from it
  (its outbound link is the bottleneck; a receiver's inbound link never is);
- a chunk a parent has is readable by its child `latency_s` later (one hop: the parent's
  progress becomes visible, the read request reaches it); the trainer has every chunk at 0;
- every chunk read also costs `chunk_overhead_s`, not overlapped with the transfer;
- the sidecar answers receivers one after another, `answer_s` each, in assignment order:
  receiver i sends no read before i x `answer_s` (a parent's children start together when
  the last of them is answered, a bound from above);
- star: every receiver reads from the trainer; tree (store and forward): a child starts once
  its parent holds every chunk; pipelined tree: a child reads chunk k once its parent has it.

Children of one parent see the same chunks at the same times and share its bandwidth evenly,
so they move in lockstep: a child's chunk times follow from its parent's by one recurrence,
t[k] = max(ready[k], t[k-1]) + overhead + chunk[k] / (bandwidth / children), evaluated per
parent for all its children at once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardPiece,
    ShardRecord,
)
from refit_sidecar.core.plan import Want
from refit_sidecar.service.tree import Receiver, Tree, TreeConfig

TRAINER = "trainer"
"""The one root source of the simulated trees: node 0."""


class Topology(enum.Enum):
    STAR = "star"
    """Every receiver reads from the trainer."""
    TREE = "tree"
    """Store and forward: a child starts once its parent holds every chunk."""
    PIPELINED = "pipelined"
    """A child reads chunk k once its parent has chunk k."""


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    model_bytes: int
    """Bytes every receiver pulls (the whole model)."""
    chunk_bytes: int
    """Unit of pipelined forwarding and of each read."""
    bandwidth: float
    """Bytes/s one source sends in all, split evenly among its children."""
    latency_s: float = 10e-6
    """Per hop: how much later a chunk the parent has is readable by its child."""
    chunk_overhead_s: float = 0.0
    """Fixed cost of each chunk read, not overlapped with the transfer."""
    answer_s: float = 0.0
    """The sidecar's time per answer: receiver i (from 1, in assignment order) is answered
    i x answer_s after the version is published (one event loop answers them in turn)."""

    def __post_init__(self) -> None:
        if self.model_bytes <= 0 or self.chunk_bytes <= 0:
            raise ValueError(
                f"model_bytes ({self.model_bytes}) and chunk_bytes ({self.chunk_bytes}) must be > 0"
            )
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if min(self.latency_s, self.chunk_overhead_s, self.answer_s) < 0:
            raise ValueError(
                f"latency_s ({self.latency_s}), chunk_overhead_s ({self.chunk_overhead_s}) and "
                f"answer_s ({self.answer_s}) must be >= 0"
            )

    @property
    def chunks(self) -> int:
        return -(-self.model_bytes // self.chunk_bytes)

    def chunk_sizes(self) -> np.ndarray:
        sizes = np.full(self.chunks, float(self.chunk_bytes))
        sizes[-1] = self.model_bytes - (self.chunks - 1) * self.chunk_bytes
        return sizes


@dataclass(frozen=True)
class FanoutTree:
    """Who reads from whom: node 0 is the trainer, node i >= 1 receiver i."""

    parents: tuple[int, ...]
    """parents[i - 1] is the node receiver i reads from, always an earlier node."""

    def __post_init__(self) -> None:
        for i, p in enumerate(self.parents, start=1):
            if not 0 <= p < i:
                raise ValueError(f"receiver {i} reads from node {p}: parents must come first")

    @property
    def receivers(self) -> int:
        return len(self.parents)

    @cached_property
    def children(self) -> np.ndarray:
        """Children per node (0..receivers)."""
        return np.bincount(np.asarray(self.parents, np.int64), minlength=self.receivers + 1)

    @cached_property
    def depths(self) -> np.ndarray:
        out = np.zeros(self.receivers + 1, np.int64)
        for i, p in enumerate(self.parents, start=1):
            out[i] = out[p] + 1
        return out

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def prefix(self, receivers: int) -> FanoutTree:
        """The tree of the first `receivers`: the same as assigning only them, since each
        assignment depends on earlier ones only."""
        return FanoutTree(self.parents[:receivers])


@dataclass(frozen=True)
class SimResult:
    topology: Topology
    receivers: int
    depth: int
    refit_s: float
    """Until the last receiver holds every chunk."""
    first_s: float
    """Until the first receiver holds every chunk."""


def star(receivers: int) -> FanoutTree:
    return build_tree(receivers, max_children=1, star=True)


def build_tree(receivers: int, *, max_children: int, star: bool = False) -> FanoutTree:
    """The tree `Tree.assign` builds when `receivers` whole-model receivers ask at once, in
    order, each serving as soon as it is assigned; a trainer rank feeds `max_children` too.
    `star`: receivers that do not serve, and a trainer that takes them all."""
    if receivers < 1:
        raise ValueError(f"receivers must be >= 1, got {receivers}")
    config = TreeConfig(
        max_children=max_children,
        max_root_children=receivers if star else max_children,
    )
    tree = Tree(config, clock=lambda: 0.0)
    tree.open_version(1, _one_tensor_manifest())
    wants = [Want("model", Box.full((1,)))]
    index = {TRAINER: 0}
    parents = []
    for i in range(1, receivers + 1):
        name = f"r{i}"
        (parent,) = tree.assign(1, Receiver(name), wants, serve=not star).parents
        parents.append(index[parent])
        index[name] = i
    return FanoutTree(tuple(parents))


def _one_tensor_manifest() -> Manifest:
    location = ShardLocation.contiguous(agent=TRAINER, address=0, shape=(1,), itemsize=1)
    shard = ShardRecord(location, (ShardPiece(Box.full((1,)), (0,)),))
    record = ParameterRecord("model", (1,), DType.UINT8, (shard,))
    return Manifest(1, (record,), {TRAINER: AgentRecord(TRAINER, metadata=b"simulated")})


def simulate(tree: FanoutTree, link: LinkModel, topology: Topology) -> SimResult:
    sizes = link.chunk_sizes()
    # Chunk completion times of the nodes whose children are still to come; the trainer has
    # every chunk at 0.
    have: dict[int, np.ndarray] = {0: np.zeros(link.chunks)}
    finish = np.zeros(tree.receivers + 1)
    for parent, kids in _by_parent(tree):
        # The group reads once its last child is answered, and reads reach the parent L later.
        times = np.maximum(have.pop(parent), max(kids) * link.answer_s)
        if topology is Topology.PIPELINED:
            ready = times + link.latency_s
        else:
            ready = np.full(link.chunks, times[-1] + link.latency_s)
        duration = link.chunk_overhead_s + sizes * (len(kids) / link.bandwidth)
        end = np.cumsum(duration)
        # t[k] = max(ready[k], t[k-1]) + duration[k], for all k at once
        times = np.maximum.accumulate(ready - (end - duration)) + end
        for kid in kids:
            finish[kid] = times[-1]
            if tree.children[kid]:
                have[kid] = times
    return SimResult(
        topology, tree.receivers, tree.depth, float(finish[1:].max()), float(finish[1:].min())
    )


def _by_parent(tree: FanoutTree) -> list[tuple[int, list[int]]]:
    """(parent, its children) with every parent after the node it reads from."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents, start=1):
        kids.setdefault(p, []).append(i)
    return sorted(kids.items())


def one_receiver_s(link: LinkModel) -> float:
    """Closed form of one receiver alone: its answer, then latency + chunks x overhead +
    bytes / bandwidth."""
    transfer = link.chunks * link.chunk_overhead_s + link.model_bytes / link.bandwidth
    return link.answer_s + link.latency_s + transfer


@dataclass(frozen=True)
class Row:
    label: str
    topology: Topology
    max_children: int | None
    chunk_bytes: int
    results: tuple[SimResult, ...]
    baseline_s: float
    """One receiver alone, same link model."""


def sweep(
    *,
    receivers: Sequence[int],
    link: LinkModel,
    chunk_sizes: Sequence[int],
    max_children: Sequence[int],
) -> list[Row]:
    """Star and, per `max_children`, the tree with `link`'s reads; then per chunk size and
    `max_children` the pipelined tree. The trees are `max(receivers)` receivers' and their
    prefixes (`FanoutTree.prefix`)."""
    largest = max(receivers)
    trees = {None: star(largest)} | {k: build_tree(largest, max_children=k) for k in max_children}
    reads = f"{link.chunk_bytes / 2**20:g} MiB"
    cases: list[tuple[str, Topology, int | None, LinkModel]] = [
        (f"star, {reads} reads", Topology.STAR, None, link)
    ]
    cases += [(f"tree k={k}, {reads} reads", Topology.TREE, k, link) for k in max_children]
    for chunk in chunk_sizes:
        chunked = replace(link, chunk_bytes=chunk)
        cases += [
            (f"pipelined k={k}, {chunk / 2**20:g} MiB", Topology.PIPELINED, k, chunked)
            for k in max_children
        ]
    return [
        Row(
            label,
            topology,
            k,
            model.chunk_bytes,
            tuple(simulate(trees[k].prefix(n), model, topology) for n in receivers),
            one_receiver_s(model),
        )
        for label, topology, k, model in cases
    ]


def format_table(rows: Sequence[Row]) -> str:
    """A markdown table: refit time in ms and, in parentheses, its ratio to one receiver."""
    counts = [r.receivers for r in rows[0].results]
    lines = [
        "| topology | " + " | ".join(f"N={n}" for n in counts) + " |",
        "| --- |" + " ---: |" * len(counts),
    ]
    for row in rows:
        cells = [f"{r.refit_s * 1e3:.1f} ({r.refit_s / row.baseline_s:.2f}x)" for r in row.results]
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    for row in rows:
        if row.topology is Topology.TREE:
            depths = " | ".join(str(r.depth) for r in row.results)
            lines.append(f"| depth, k={row.max_children} | {depths} |")
    return "\n".join(lines)
