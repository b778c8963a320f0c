"""The sidecar's source tree: whom each receiver reads a version from (injected clock)."""

from __future__ import annotations

import hashlib
import math
import time

import numpy as np
import pytest

from refit_sidecar.core.manifest import Box, DType, Manifest
from refit_sidecar.core.plan import Want
from refit_sidecar.publish.shard_specs import ShardSpec, split_pieces
from refit_sidecar.service.tree import (
    Assignment,
    CopyState,
    NodeKind,
    NoLiveSource,
    NoSourceFree,
    Orphan,
    PullOutcome,
    Receiver,
    Tree,
    TreeConfig,
    UnknownSource,
    UnknownVersion,
)
from tests.refit.shards import in_memory_manifest
from trainer_refit.errors import InvalidRequest

# name: (global shape, TP split dim or None, blocks along it)
PARAMS = {
    "qkv": ((8, 4), 0, 1),
    "proj": ((4, 8), 1, 1),
    "fc1": ((8, 4), 0, 2),  # [gate_r; up_r] per rank
    "norm": ((4,), None, 1),
}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def layout(tp: int, rank: int) -> list[Want]:
    """The boxes a TP rank `rank` of `tp` holds (trainer) or wants (receiver)."""
    wants = []
    for name, (shape, dim, parts) in PARAMS.items():
        _, pieces = split_pieces(shape, dim, parts, rank, tp)
        wants += [Want(name, piece.box) for piece in pieces]
    return wants


def trainer(version: int = 1, *, tp: int = 1, replicas: int = 1) -> Manifest:
    """Agents t{d}.{r}: TP rank r of DP replica d."""
    placed = []
    for d in range(replicas):
        for r in range(tp):
            for name, (shape, dim, parts) in PARAMS.items():
                local, pieces = split_pieces(shape, dim, parts, r, tp)
                spec = ShardSpec(name, shape, DType.UINT8, local, pieces)
                placed.append((f"t{d}.{r}", spec, np.zeros(spec.nbytes, np.uint8)))
    return in_memory_manifest(version, placed)


def make(clock: Clock | None = None, manifest: Manifest | None = None, **config) -> Tree:
    tree = Tree(TreeConfig(**config), clock or Clock())
    tree.open_version(1, manifest or trainer())
    return tree


WHOLE = layout(1, 0)


def pull(tree: Tree, name: str, domain: str = "", wants=WHOLE, **kw) -> Assignment:
    return tree.assign(1, Receiver(name, domain), wants, **kw)


def parent(assignment: Assignment) -> str:
    (only,) = assignment.parents
    return only


def children(tree: Tree, version: int = 1) -> dict[str, int]:
    return {n.node_id: n.children for n in tree.tree(version).nodes}


def assert_acyclic(tree: Tree, version: int = 1) -> None:
    ups: dict[str, set[str]] = {}
    for edge in tree.tree(version).edges:
        if edge.active:
            ups.setdefault(edge.child, set()).add(edge.parent)
    for start, parents in ups.items():
        seen, frontier = {start}, list(parents)
        while frontier:
            node = frontier.pop()
            assert node != start, f"{start} reads from itself through {seen}"
            if node not in seen:
                seen.add(node)
                frontier += ups.get(node, ())


def test_the_trainer_feeds_the_first_level_then_peers_breadth_first():
    tree = make()
    parents = {f"r{i}": parent(pull(tree, f"r{i}")) for i in range(1, 8)}
    # r1 and r2 fill the trainer's two slots; the rest read from peers still filling
    # (pipelined), the shallowest with the fewest children first, then the earliest.
    assert parents == {
        "r1": "t0.0",
        "r2": "t0.0",
        "r3": "r1",
        "r4": "r2",
        "r5": "r1",
        "r6": "r2",
        "r7": "r3",
    }
    listing = tree.tree(1)
    depth = {n.node_id: n.depth for n in listing.nodes}
    assert depth == {"t0.0": 0, "r1": 1, "r2": 1, "r3": 2, "r4": 2, "r5": 2, "r6": 2, "r7": 3}
    assert listing.depth == 3
    state = {n.node_id: (n.kind, n.state) for n in listing.nodes}
    assert state["t0.0"] == (NodeKind.TRAINER, CopyState.COMPLETE)
    assert state["r7"] == (NodeKind.PEER, CopyState.FILLING)
    assert {(e.parent, e.child) for e in listing.edges} == {(p, c) for c, p in parents.items()}
    assert "r7 [peer, filling" in listing.describe()


@pytest.mark.parametrize(("max_children", "max_root_children"), [(1, 1), (2, 2), (3, 1), (2, 4)])
def test_no_source_feeds_more_than_its_maximum_and_the_trainer_only_the_first_receivers(
    max_children, max_root_children
):
    tree = make(max_children=max_children, max_root_children=max_root_children)
    parents = [parent(pull(tree, f"r{i:02}")) for i in range(40)]
    assert parents[:max_root_children] == ["t0.0"] * max_root_children
    assert "t0.0" not in parents[max_root_children:]
    for node, count in children(tree).items():
        assert count <= (max_root_children if node == "t0.0" else max_children)
    assert_acyclic(tree)


def test_peers_of_the_receivers_domain_come_first():
    tree = Tree(TreeConfig(), Clock())
    tree.open_version(1, trainer(), domains={"t0.0": "rack-t"})
    assert parent(pull(tree, "a1", "rack-a")) == "t0.0"
    # The trainer rank still has room, but a1 is in a2's rack.
    assert parent(pull(tree, "a2", "rack-a")) == "a1"
    # No peer in rack-b: the trainer's rank, the lowest stage, has room.
    assert parent(pull(tree, "b1", "rack-b")) == "t0.0"
    assert parent(pull(tree, "b2", "rack-b")) == "b1"
    assert parent(pull(tree, "a3", "rack-a")) == "a1"
    assert parent(pull(tree, "a4", "rack-a")) == "a2"


def test_a_receiver_in_the_trainers_domain_reads_from_the_trainer_while_it_has_room():
    tree = Tree(TreeConfig(), Clock())
    tree.open_version(1, trainer(), domains={"t0.0": "rack-a"})
    assert [parent(pull(tree, f"a{i}", "rack-a")) for i in range(3)] == ["t0.0", "t0.0", "a0"]


def test_complete_peers_come_before_the_trainer_fewest_children_then_earliest():
    tree = make()
    for name in ("p1", "p2"):
        tree.register_peer(1, Receiver(name), WHOLE, state=CopyState.COMPLETE)
    assert [parent(pull(tree, f"r{i}", serve=False)) for i in range(5)] == [
        "p1",
        "p2",
        "p1",
        "p2",
        "t0.0",
    ]


def test_release_frees_the_slot_and_completes_the_copy():
    clock = Clock()
    tree = make(clock)
    a1, a2 = pull(tree, "r1", serve=False), pull(tree, "r2", serve=False)
    assert a1.parents == a2.parents == ("t0.0",)
    with pytest.raises(NoSourceFree, match="maximum of children"):
        pull(tree, "r3", serve=False)
    assert tree.release(1, "r1", PullOutcome.COMPLETE) == ()
    assert children(tree)["t0.0"] == 1
    assert parent(pull(tree, "r3", serve=False)) == "t0.0"
    # A serving receiver's completed copy is stage 0 and preferred to the trainer's rank.
    tree.release(1, "r2", PullOutcome.COMPLETE)
    pull(tree, "s1")
    assert tree.release(1, "s1", PullOutcome.COMPLETE) == ()
    info = {n.node_id: n for n in tree.tree(1).nodes}
    assert info["s1"].state is CopyState.COMPLETE
    assert info["s1"].expires_at == clock.now + TreeConfig().peer_ttl_s
    assert info["r1"].kind is NodeKind.RECEIVER
    assert parent(pull(tree, "r4")) == "s1"
    assert not next(e for e in tree.tree(1).edges if e.child == "r1").active


def test_a_failed_pull_stops_serving_and_orphans_its_children():
    tree = make()
    pull(tree, "r1")
    pull(tree, "r2")
    pull(tree, "r3")  # reads from r1
    assert tree.release(1, "r1", PullOutcome.FAILED) == (Orphan(1, "r1", "r3"),)
    assert "r1" not in children(tree)
    assert parent(pull(tree, "r3")) == "t0.0"


def test_expired_and_dead_sources_are_dropped_and_children_get_fallbacks():
    clock = Clock()
    tree = make(clock, manifest=trainer(replicas=2), max_root_children=1)
    for name in ("r1", "r2", "r3", "r4"):
        pull(tree, name)
    r5 = pull(tree, "r5")
    assert parent(r5) == "r1"
    # Its grandparent, then peers outside r1's subtree (r3 would stall with r1), then the
    # trainer's ranks.
    assert {r.fallbacks for r in r5.routes} == {("t0.0", "r2", "r4", "t1.0")}

    clock.now += 20
    for name in ("r2", "r3", "r4", "r5"):
        tree.renew(1, name)
    clock.now += 15  # r1's registration ran out
    assert tree.expire() == (Orphan(1, "r1", "r3"), Orphan(1, "r1", "r5"))
    assert "r1" not in children(tree)
    with pytest.raises(UnknownSource, match="'r1' is not a source of version 1"):
        tree.renew(1, "r1")
    again = pull(tree, "r5")
    assert parent(again) == "t0.0"  # free again: r1's own pull ended with it

    assert tree.drop("r2") == (Orphan(1, "r2", "r4"),)
    again = pull(tree, "r4")
    assert parent(again) == "t1.0"
    assert "r2" not in {s for r in again.routes for s in r.fallbacks}
    with pytest.raises(InvalidRequest, match="trainer rank: it does not expire"):
        tree.renew(1, "t0.0")


def test_a_receiver_never_reads_from_its_descendants():
    tree = make(manifest=trainer(replicas=2), max_root_children=1)
    for i in range(1, 9):
        pull(tree, f"r{i}")
    # r1 <- t0.0, r2 <- t1.0; r3, r5 <- r1; r4, r6 <- r2; r7 <- r3; r8 <- r4
    assert tree.drop("t0.0") == (Orphan(1, "t0.0", "r1"),)
    again = pull(tree, "r1")
    # t1.0 and r2 are full; r5, with no children, is r1's own child.
    assert parent(again) == "r6"
    assert again.routes[0].fallbacks == ("r2", "r4", "r8", "t1.0")
    assert_acyclic(tree)


def test_when_only_descendants_have_room_no_source_is_free():
    tree = make(manifest=trainer(replicas=2), max_root_children=1)
    for name in ("r1", "r2", "r3"):
        pull(tree, name)
    for name in ("q1", "q2", "q3"):  # fill r1's and r2's slots
        pull(tree, name, serve=False)
    tree.drop("t0.0")
    with pytest.raises(NoSourceFree, match="maximum of children"):
        pull(tree, "r1")  # r3, its child, is the only source with room
    tree.release(1, "q1", PullOutcome.COMPLETE)
    assert parent(pull(tree, "r1")) == "r2"


def test_a_receiver_whose_only_holders_are_its_descendants_is_refused():
    tree = make(max_root_children=1)
    pull(tree, "r1")
    pull(tree, "r2")  # reads from r1
    tree.drop("t0.0")
    with pytest.raises(NoLiveSource, match="outside the receiver's own subtree"):
        pull(tree, "r1")


def test_bytes_nobody_live_holds_are_refused():
    tree = make()
    tree.drop("t0.0")
    with pytest.raises(NoLiveSource, match="no live source"):
        pull(tree, "r1")


@pytest.mark.parametrize("seed", range(4))
def test_mixed_tp_layouts_cover_their_boxes_exactly(seed):
    rng = np.random.default_rng(seed)
    manifest = trainer(tp=2)
    tree = make(manifest=manifest)
    held: dict[str, list[Want]] = {f"t0.{r}": layout(2, r) for r in range(2)}
    active: list[str] = []
    for i in range(24):
        tp = int(rng.choice([1, 2, 4]))
        rank = int(rng.integers(tp))
        wants = layout(tp, rank)
        name = f"r{i}-tp{tp}.{rank}"
        while True:
            try:
                assignment = pull(tree, name, wants=wants)
                break
            except NoSourceFree:  # every holder is busy: the oldest pull ends
                tree.release(1, active.pop(0), PullOutcome.COMPLETE)
        active.append(name)
        held[name] = wants
        counts = {w: np.zeros(PARAMS[w.name][0], np.int64) for w in wants}
        for route in assignment.routes:
            want = next(w for w in wants if w.name == route.name and w.box.contains(route.box))
            counts[want][tuple(slice(a, b) for a, b in route.box.ranges)] += 1
            assert any(
                w.name == route.name and w.box.contains(route.box) for w in held[route.primary]
            ), (route, held[route.primary])
            for source in route.fallbacks:
                assert any(
                    w.name == route.name and w.box.intersect(route.box) for w in held[source]
                )
        for want, count in counts.items():
            region = count[tuple(slice(a, b) for a, b in want.box.ranges)]
            assert (region == 1).all(), (name, want)
            assert count.sum() == want.box.numel
    for node, count in children(tree).items():
        assert count <= 2, node
    assert_acyclic(tree)


@pytest.mark.parametrize("trainer_tp", [1, 2])
def test_cuts_cached_by_a_wants_key_route_exactly_as_cutting_each_time(trainer_tp):
    """GetSources passes a digest of the wants: cuts are then reused across pulls and
    versions, and a primary whose every fallback candidate holds all the wants gets one
    fallback list for all its pieces. The routes must be those of the uncached path."""
    rng = np.random.default_rng(trainer_tp)
    trees = [make(manifest=trainer(tp=trainer_tp)) for _ in range(2)]
    uniform = trees[1]._uniform_fallbacks
    shared: list[object] = []

    def spy(*args, **kw):
        shared.append(found := uniform(*args, **kw))
        return found

    trees[1]._uniform_fallbacks = spy  # type: ignore[method-assign]
    active: list[str] = []
    for i in range(30):
        tp = int(rng.choice([1, 1, 2]))
        rank = int(rng.integers(tp))
        wants = layout(tp, rank)
        key = hashlib.blake2b(repr(wants).encode(), digest_size=16).digest()
        name = f"r{i}-tp{tp}.{rank}"
        while True:
            try:
                plain = pull(trees[0], name, wants=wants)
                keyed = pull(trees[1], name, wants=wants, wants_key=key)
                break
            except NoSourceFree:
                for tree in trees:
                    tree.release(1, active[0], PullOutcome.COMPLETE)
                active.pop(0)
        assert keyed == plain
        active.append(name)
        if rng.random() < 0.2:  # a peer dies: its children's fallbacks change
            victim = active.pop(int(rng.integers(len(active))))
            for tree in trees:
                tree.drop(victim)
    assert trees[0].tree(1) == trees[1].tree(1)
    # With one trainer rank every source holds all of a layout's wants: one fallback list per
    # primary. Two ranks both hold the replicated tensors: piece by piece.
    if trainer_tp == 1:
        assert any(f is not None for f in shared)
    else:
        assert None in shared


def test_a_tp1_receiver_reads_halves_from_two_tp2_sources():
    tree = make(manifest=trainer(tp=2))
    assignment = pull(tree, "r1", wants=[Want("qkv", Box.full((8, 4)))])
    assert [(r.primary, r.box) for r in assignment.routes] == [
        ("t0.0", Box(((0, 4), (0, 4)))),
        ("t0.1", Box(((4, 8), (0, 4)))),
    ]
    assert children(tree) == {"t0.0": 1, "t0.1": 1, "r1": 0}


def test_a_thousand_receivers_make_a_tree_of_logarithmic_depth():
    tree = make()
    n = 1000
    start = time.perf_counter()
    for i in range(n):
        pull(tree, f"r{i:04}")
    elapsed = time.perf_counter() - start
    listing = tree.tree(1)
    assert math.floor(math.log2(n)) - 1 <= listing.depth <= math.ceil(math.log2(n))
    assert max(n.children for n in listing.nodes) == 2
    assert sum(e.parent == "t0.0" for e in listing.edges) == 2
    assert elapsed < 2.0, f"{n} assignments took {elapsed:.2f} s"


def test_versions_are_separate_and_retired_whole():
    tree = make()
    tree.open_version(2, trainer(2))
    pull(tree, "r1")
    tree.assign(2, Receiver("r1"), WHOLE)
    assert tree.versions == [1, 2]
    assert tree.drop("r1") == ()
    assert tree.retire(1) and not tree.retire(1)
    with pytest.raises(UnknownVersion, match="open versions: \\[2\\]"):
        pull(tree, "r2")
    with pytest.raises(InvalidRequest, match="open already"):
        tree.open_version(2, trainer(2))


@pytest.mark.parametrize(
    ("wants", "match"),
    [
        ([], "no wants"),
        ([Want("nope", Box.full((4,)))], "'nope' is not a parameter"),
        ([Want("norm", Box.full((5,)))], "outside shape"),
        ([Want("norm", Box.full((4, 1)))], "outside shape"),
    ],
)
def test_bad_wants_are_refused(wants, match):
    with pytest.raises(InvalidRequest, match=match):
        pull(make(), "r1", wants=wants)


def test_a_peer_keeps_its_boxes_and_never_goes_back_to_filling():
    tree = make()
    tree.register_peer(1, Receiver("p"), WHOLE, state=CopyState.COMPLETE)
    with pytest.raises(InvalidRequest, match="holds other boxes"):
        pull(tree, "p", wants=layout(2, 0))
    with pytest.raises(InvalidRequest, match="complete copy"):
        tree.register_peer(1, Receiver("p"), WHOLE, state=CopyState.FILLING)
    for misuse in (
        lambda: pull(tree, "t0.0"),
        lambda: tree.release(1, "t0.0", PullOutcome.FAILED),
        lambda: tree.unregister(1, "t0.0"),
    ):
        with pytest.raises(InvalidRequest, match=r"'t0\.0' is a trainer rank of version 1"):
            misuse()
    assert children(tree)["t0.0"] == 0
    assert tree.unregister(1, "p") == ()
    with pytest.raises(UnknownSource):
        tree.unregister(1, "p")


@pytest.mark.parametrize(
    "config",
    [
        {"max_children": 0},
        {"max_root_children": 0},
        {"peer_ttl_s": 0},
        {"max_peer_fallbacks": -1},
        {"hold_parents_s": -1},
    ],
)
def test_bad_config_is_refused(config):
    with pytest.raises(ValueError, match=next(iter(config))):
        TreeConfig(**config)


def test_readers_are_the_active_pulls_reading_from_a_source():
    tree = make()
    pull(tree, "p1")
    pull(tree, "p2")
    assert tree.readers(1, "t0.0") == ("p1", "p2")
    assert parent(pull(tree, "c1")) == "p1"
    assert tree.readers(1, "p1") == ("c1",)
    assert tree.readers(1, "p2") == ()
    assert parent(pull(tree, "c2")) == "p2"
    tree.unregister(1, "p2")  # gone, but c2 still reads what it got from it until it asks again
    assert tree.readers(1, "p2") == ("c2",)
    tree.release(1, "c1", PullOutcome.COMPLETE)
    assert tree.readers(1, "p1") == ()  # a finished pull reads no more
    assert tree.readers(1, "nobody") == ()
    with pytest.raises(UnknownVersion):
        tree.readers(2, "t0.0")


def _chain(tree: Tree, version: int, order: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Each receiver of `order` asks for `version`, those told to wait asking again after the
    others, as receivers retry NoSourceFree; then every pull completes."""
    parents: dict[str, tuple[str, ...]] = {}
    waiting = list(order)
    for _ in range(len(order) + 1):
        later = []
        for name in waiting:
            try:
                parents[name] = tree.assign(version, Receiver(name), WHOLE).parents
            except NoSourceFree:
                later.append(name)
        waiting = later
    assert not waiting, waiting
    for name in order:
        tree.release(version, name, PullOutcome.COMPLETE)
    return parents


def _chain_tree(clock: Clock, **config) -> tuple[Tree, dict[str, tuple[str, ...]]]:
    tree = make(clock, max_root_children=1, max_children=1, **config)
    first = _chain(tree, 1, ("p1", "p2", "p3"))
    assert first == {"p1": ("t0.0",), "p2": ("p1",), "p3": ("p2",)}
    return tree, first


def test_a_tree_keeps_its_shape_whatever_order_the_receivers_ask_in():
    clock = Clock()
    tree, first = _chain_tree(clock)
    for version, order in ((2, ("p3", "p2", "p1")), (3, ("p2", "p3", "p1"))):
        tree.open_version(version, trainer(version))
        # p3 and p2 wait for their previous parents; the trainer's slot waits for p1.
        with pytest.raises(NoSourceFree, match="'p3' waits for its previous parent 'p2'"):
            tree.assign(version, Receiver("p3"), WHOLE)
        assert _chain(tree, version, order) == first


def test_a_newcomer_takes_no_held_slot_and_holding_ends_with_its_time():
    clock = Clock()
    tree, _ = _chain_tree(clock, hold_parents_s=0.1)
    tree.open_version(2, trainer(2))
    # The trainer's one slot is p1's while version 2 is young: a newcomer is told to wait.
    with pytest.raises(NoSourceFree):
        tree.assign(2, Receiver("new"), WHOLE)
    clock.now += 0.2
    # Held no longer: the newcomer takes the slot, and p2, whose parent p1 has not asked,
    # reads from it rather than wait.
    assert tree.assign(2, Receiver("new"), WHOLE).parents == ("t0.0",)
    assert tree.assign(2, Receiver("p2"), WHOLE).parents == ("new",)


def test_two_receivers_remembering_one_parent_slot_wait_for_neither():
    clock = Clock()
    tree = make(clock, max_root_children=1, max_children=1)
    # p1 reads the trainer's one slot and p2 reads p1; p1 finishes first, and p3 takes the
    # trainer's freed slot. p1 and p3 now both remember the trainer as their parent.
    assert tree.assign(1, Receiver("p1"), WHOLE).parents == ("t0.0",)
    assert tree.assign(1, Receiver("p2"), WHOLE).parents == ("p1",)
    tree.release(1, "p1", PullOutcome.COMPLETE)
    assert tree.assign(1, Receiver("p3"), WHOLE).parents == ("t0.0",)
    for name in ("p2", "p3"):
        tree.release(1, name, PullOutcome.COMPLETE)
    tree.open_version(2, trainer(2))
    # p1 asks first: the slot is its own, not held for p3 (which would keep p1 waiting
    # until the hold ends). p1's one slot stays p2's: p3 waits for p2, then reads it.
    assert tree.assign(2, Receiver("p1"), WHOLE).parents == ("t0.0",)
    with pytest.raises(NoSourceFree, match="held for receivers yet to ask"):
        tree.assign(2, Receiver("p3"), WHOLE)
    assert tree.assign(2, Receiver("p2"), WHOLE).parents == ("p1",)
    assert tree.assign(2, Receiver("p3"), WHOLE).parents == ("p2",)


def test_a_receiver_does_not_wait_for_a_previous_parent_that_failed_or_died():
    clock = Clock()
    tree, _ = _chain_tree(clock)
    tree.open_version(2, trainer(2))
    assert tree.assign(2, Receiver("p1"), WHOLE).parents == ("t0.0",)
    tree.release(2, "p1", PullOutcome.FAILED)  # p1's copy of version 2 failed
    assert tree.assign(2, Receiver("p2"), WHOLE).parents == ("t0.0",)
    tree.drop("p2")  # p2 died: gone from every version
    assert tree.assign(2, Receiver("p3"), WHOLE).parents == ("t0.0",)


def test_receivers_that_skip_versions_keep_the_shape_of_the_tree():
    clock = Clock()
    tree, first = _chain_tree(clock)
    # Versions 2 and 3 come and go while the chain pulls none of them (it refits less often
    # than the trainer publishes, or another mode of a benchmark runs).
    for version in (2, 3):
        tree.open_version(version, trainer(version))
    assert tree.retire(1) and tree.retire(2)
    clock.now += 1.0
    tree.open_version(4, trainer(4))
    with pytest.raises(NoSourceFree, match="'p3' waits for its previous parent 'p2'"):
        tree.assign(4, Receiver("p3"), WHOLE)
    assert _chain(tree, 4, ("p3", "p2", "p1")) == first


def test_a_receiver_that_stopped_pulling_holds_nothing():
    clock = Clock()
    tree, _ = _chain_tree(clock)
    # p1, p2 and p3 asked for nothing for longer than a peer registration lives.
    clock.now += TreeConfig().peer_ttl_s
    tree.open_version(2, trainer(2))
    assert tree.retire(1)
    # Nothing is held for them: the first to ask takes the trainer's slot.
    assert tree.assign(2, Receiver("p3"), WHOLE).parents == ("t0.0",)
    # Nor for a receiver whose version is still open, once it stopped that long.
    clock = Clock()
    tree, _ = _chain_tree(clock)
    clock.now += TreeConfig().peer_ttl_s
    tree.open_version(2, trainer(2))
    assert tree.assign(2, Receiver("p3"), WHOLE).parents == ("t0.0",)


def test_holding_can_be_turned_off():
    clock = Clock()
    tree, _ = _chain_tree(clock, hold_parents_s=0.0)
    tree.open_version(2, trainer(2))
    # First come, first served: the trainer's slot goes to whoever asks first.
    assert tree.assign(2, Receiver("p3"), WHOLE).parents == ("t0.0",)


def test_the_sidecar_flag_sets_the_holding_time():
    from refit_sidecar.service.cli import parse_config

    config, _ = parse_config(["--insecure", "--hold-parents-seconds", "0.25"])
    assert config.tree.hold_parents_s == 0.25
    assert parse_config(["--insecure"])[0].tree.hold_parents_s == TreeConfig().hold_parents_s
    with pytest.raises(SystemExit):
        parse_config(["--insecure", "--hold-parents-seconds", "-1"])


def test_a_repeated_single_source_assignment_returns_the_same_routes() -> None:
    """A receiver asking with the same wants key is given the same routes object while its
    source, cut and fallbacks repeat (the sidecar finds its cached reply by that identity),
    and new routes when the source changes."""
    tree = make(max_root_children=4)
    key = hashlib.blake2b(repr(WHOLE).encode(), digest_size=16).digest()
    first = pull(tree, "r1", wants_key=key)
    tree.release(1, "r1", PullOutcome.COMPLETE)
    tree.open_version(2, trainer(2))
    again = tree.assign(2, Receiver("r1", ""), WHOLE, wants_key=key)
    assert again.routes is first.routes and parent(again) == "t0.0"
    tree.release(2, "r1", PullOutcome.COMPLETE)
    other = tree.assign(2, Receiver("r2", ""), WHOLE, wants_key=key)
    assert parent(other) == "r1" and other.routes is not first.routes
    assert [(r.name, r.box) for r in other.routes] == [(r.name, r.box) for r in first.routes]
