"""The fan-out simulation against closed forms, and the shape of its predictions."""

from __future__ import annotations

import math

import pytest

from benchmarks.fanout_model import (
    FanoutTree,
    LinkModel,
    Topology,
    build_tree,
    format_table,
    one_receiver_s,
    simulate,
    star,
    sweep,
)
from benchmarks.fanout_sim import main

S, C, B, L = 2_000_000_000, 16 * 2**20, 50e9, 10e-6
LINK = LinkModel(model_bytes=S, chunk_bytes=C, bandwidth=B, latency_s=L)
CHUNKS = math.ceil(S / C)


def refit(tree: FanoutTree, topology: Topology, link: LinkModel = LINK) -> float:
    return simulate(tree, link, topology).refit_s


@pytest.mark.parametrize("topology", list(Topology))
@pytest.mark.parametrize("overhead", [0.0, 7e-6])
def test_one_receiver_takes_latency_plus_bytes_over_bandwidth(topology, overhead):
    link = LinkModel(
        model_bytes=S, chunk_bytes=C, bandwidth=B, latency_s=L, chunk_overhead_s=overhead
    )
    expected = L + CHUNKS * overhead + S / B
    assert one_receiver_s(link) == pytest.approx(expected)
    assert refit(build_tree(1, max_children=2), topology, link) == pytest.approx(expected)


@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_a_star_of_n_receivers_takes_n_times_the_bytes(n):
    result = simulate(star(n), LINK, Topology.STAR)
    assert result.depth == 1
    assert result.refit_s == pytest.approx(n * S / B + L)
    assert result.first_s == pytest.approx(result.refit_s)  # all share the trainer's link


A = 0.6e-3
"""The sidecar's time per answer."""


def test_one_receiver_waits_for_its_answer_first():
    link = LinkModel(model_bytes=S, chunk_bytes=C, bandwidth=B, latency_s=L, answer_s=A)
    assert one_receiver_s(link) == pytest.approx(A + L + S / B)
    for topology in Topology:
        assert refit(build_tree(1, max_children=2), topology, link) == pytest.approx(A + L + S / B)


@pytest.mark.parametrize("n", [1, 2, 64])
def test_a_star_starts_when_its_last_receiver_is_answered(n):
    link = LinkModel(model_bytes=S, chunk_bytes=C, bandwidth=B, latency_s=L, answer_s=A)
    assert refit(star(n), Topology.STAR, link) == pytest.approx(n * A + L + n * S / B)


def test_answers_bound_a_large_pipelined_tree():
    """With answers serialized, a thousand receivers wait for the sidecar longer than for
    their bytes: the last one is answered at 1000 x A."""
    tree = build_tree(1000, max_children=2)
    fast = LinkModel(model_bytes=S, chunk_bytes=C, bandwidth=B, latency_s=L)
    slow = LinkModel(model_bytes=S, chunk_bytes=C, bandwidth=B, latency_s=L, answer_s=A)
    assert refit(tree, Topology.PIPELINED, slow) >= 1000 * A + S / B / 2
    assert refit(tree, Topology.PIPELINED, slow) > 2 * refit(tree, Topology.PIPELINED, fast)


def test_store_and_forward_pays_every_level_in_full():
    # Full binary levels: 2 then 4 receivers, each level reading at B/2 after its parent.
    tree = build_tree(6, max_children=2)
    assert tree.depth == 2
    assert refit(tree, Topology.TREE) == pytest.approx(2 * (L + 2 * S / B))
    assert refit(build_tree(5, max_children=1), Topology.TREE) == pytest.approx(5 * (L + S / B))


@pytest.mark.parametrize(("k", "n", "depth"), [(1, 7, 7), (2, 6, 2), (2, 14, 3), (3, 12, 2)])
def test_a_pipelined_tree_adds_a_chunk_and_a_hop_per_level(k, n, depth):
    tree = build_tree(n, max_children=k)
    assert tree.depth == depth
    assert (tree.children[tree.children > 0] == k).all()  # full levels: every rate is B/k
    chunk_s = C * k / B
    last = S - (CHUNKS - 1) * C
    # Each level trails its parent by one chunk and one hop; the short last chunk ends it.
    expected = depth * L + (CHUNKS - 2 + depth) * chunk_s + last * k / B
    assert refit(tree, Topology.PIPELINED) == pytest.approx(expected)


def test_pipelined_tree_time_is_nearly_flat_in_n_and_star_time_linear():
    tree = build_tree(1024, max_children=2)
    pipelined = [refit(tree.prefix(n), Topology.PIPELINED) for n in (2, 16, 128, 1024)]
    assert pipelined == sorted(pipelined)
    assert pipelined[-1] / pipelined[0] < 1.1
    assert pipelined[-1] < 2.2 * one_receiver_s(LINK)
    stars = {n: refit(star(n), Topology.STAR) for n in (8, 64, 512)}
    assert stars[512] / stars[8] == pytest.approx(64, rel=1e-3)
    tree_times = [refit(tree.prefix(n), Topology.TREE) for n in (16, 256)]
    assert tree_times[1] > 1.9 * tree_times[0]  # store and forward: per level, in log N


def test_the_assigned_trees_keep_their_bounds():
    tree = build_tree(1000, max_children=2)
    assert tree.depth == 9  # 2 + 4 + ... + 512 >= 1000
    assert tree.children.max() == 2
    assert tree.prefix(100) == build_tree(100, max_children=2)
    assert build_tree(9, max_children=1).parents == tuple(range(9))  # a chain
    assert star(5).parents == (0,) * 5


def test_the_last_chunk_may_be_short():
    link = LinkModel(model_bytes=10, chunk_bytes=4, bandwidth=1.0, latency_s=0)
    assert list(link.chunk_sizes()) == [4, 4, 2]
    assert refit(build_tree(2, max_children=1), Topology.PIPELINED, link) == pytest.approx(14)


def test_bad_models_and_trees_are_refused():
    with pytest.raises(ValueError, match="chunk_bytes"):
        LinkModel(model_bytes=1, chunk_bytes=0, bandwidth=1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        LinkModel(model_bytes=1, chunk_bytes=1, bandwidth=0.0)
    with pytest.raises(ValueError, match="latency_s"):
        LinkModel(model_bytes=1, chunk_bytes=1, bandwidth=1.0, latency_s=-1)
    with pytest.raises(ValueError, match="parents must come first"):
        FanoutTree((0, 2))
    with pytest.raises(ValueError, match="receivers"):
        build_tree(0, max_children=2)


def test_the_table_lists_every_topology_and_count(capsys):
    rows = sweep(receivers=[1, 4, 32], link=LINK, chunk_sizes=[4 * 2**20], max_children=[1, 2])
    assert [r.label for r in rows] == [
        "star, 16 MiB reads",
        "tree k=1, 16 MiB reads",
        "tree k=2, 16 MiB reads",
        "pipelined k=1, 4 MiB",
        "pipelined k=2, 4 MiB",
    ]
    table = format_table(rows)
    assert table.splitlines()[0] == "| topology | N=1 | N=4 | N=32 |"
    assert "| depth, k=2 | 1 | 2 | 5 |" in table  # 2 + 4 + 8 + 16 < 32
    assert all(r.results[0].refit_s == pytest.approx(r.baseline_s) for r in rows)

    main(["--bandwidth-gb-s", "386", "--receivers", "1", "3", "--max-children", "1", "2"])
    out = capsys.readouterr().out
    assert "B = 386 GB/s per source" in out
    assert "| 3 | pipelined k=1" in out  # a chain wins for few receivers
