"""`in_place.InPlace`: engine tensors adopted into staging, the backup taken after each install,
restored when a pull into them fails, and given storage of their own again for another
layout. On the CPU here; tests/gpu runs the same on a GPU (the backup on a stream of its
own)."""

from __future__ import annotations

import torch

from inference_ext.staged_tensors import Adoptable, InPlace, adoptable, candidates


def _layout(device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Staging of 64 float32s holding two tensors (a 4×8 and a 16), and their views."""
    staging = torch.arange(64, dtype=torch.float32, device=device).view(torch.uint8)
    views = {
        "a": staging[:128].view(torch.float32).view(4, 8),
        "b": staging[128:192].view(torch.float32),
    }
    return staging, views


def test_adopted_tensors_live_in_staging_and_a_failed_pull_is_restored(
    device: str = "cpu",
) -> None:
    staging, views = _layout(device)
    engine = {name: view.clone() for name, view in views.items()}  # installed by copy
    engine["c"] = torch.zeros(3, device=device)  # not in staging: left alone
    kept = engine["c"]
    in_place = InPlace()
    assert not in_place.prepare(("layout", 1))  # nothing adopted yet: a pull by copy
    live, cast = candidates(views, engine)
    assert not cast
    in_place.adopt(("layout", 1), live, staging, held=None)
    assert in_place.adopted.keys() == {"a", "b"} and in_place.nbytes == 192
    assert engine["a"].data_ptr() == views["a"].data_ptr() and engine["c"] is kept
    installed = {name: t.clone() for name, t in engine.items()}

    assert in_place.prepare(("layout", 1))  # the next pull lands in the engine's tensors
    staging.fill_(7)
    assert bool((engine["b"] != installed["b"]).all())
    in_place.restore()
    assert all(torch.equal(engine[n], installed[n]) for n in engine)
    assert not in_place.armed
    in_place.restore()  # not armed: nothing to do
    assert all(torch.equal(engine[n], installed[n]) for n in engine)

    assert in_place.prepare(("layout", 1))
    staging[:128].view(torch.float32).fill_(2.0)  # a version that installs
    in_place.back_up()
    newer = {name: t.clone() for name, t in engine.items()}
    assert bool((newer["a"] == 2.0).all())
    assert in_place.prepare(("layout", 1))
    staging.zero_()
    in_place.restore()
    assert all(torch.equal(engine[n], newer[n]) for n in engine)

    # Another layout: the tensors get storage of their own, holding what they held.
    assert not in_place.prepare(("layout", 2))
    assert not in_place.adopted and engine["a"].data_ptr() != views["a"].data_ptr()
    staging.zero_()
    assert all(torch.equal(engine[n], newer[n]) for n in engine)


def test_close_leaves_the_engine_its_tensors() -> None:
    staging, views = _layout("cpu")
    engine = {name: view.clone() for name, view in views.items()}
    in_place = InPlace()
    in_place.adopt(("layout",), candidates(views, engine)[0], staging, held=None)
    in_place.close()
    staging.zero_()
    assert engine["b"].tolist() == list(range(32, 48))


def test_only_tensors_held_as_staged_are_adopted_and_others_cast_in() -> None:
    staging, views = _layout("cpu")
    a = views["a"]
    assert adoptable(a, torch.zeros(4, 8))
    assert not adoptable(a, None)
    assert not adoptable(a, torch.zeros(4, 8, dtype=torch.bfloat16))  # the engine casts
    assert not adoptable(a, torch.zeros(8, 4))
    assert not adoptable(a, torch.zeros(8, 4).t())  # not contiguous
    engine = {"a": torch.zeros(4, 8), "b": torch.zeros(16, dtype=torch.bfloat16)}
    live, cast = candidates(views, {**engine, "c": torch.zeros(3)})
    assert [c.name for c in live] == ["a"] and [c.name for c in cast] == ["b"]
    assert candidates(views, {"b": torch.zeros(4, 4)}) == ([], [])  # another shape: neither

    in_place = InPlace()
    in_place.adopt(("layout",), live, staging, held=None, cast=cast)
    assert in_place.cast.keys() == {"b"} and in_place.nbytes == a.nbytes
    in_place.cast_in()
    assert engine["b"].tolist() == list(range(32, 48))  # cast to bf16 (exact for these)


def test_many_tensors_are_cast_in_per_pair_of_dtypes_bit_for_bit(device: str = "cpu") -> None:
    torch.manual_seed(0)
    staged = {f"n{i}": torch.randn(5 + i, device=device) for i in range(6)}  # float32 norms
    staged |= {f"h{i}": torch.randn(3, 2, device=device).to(torch.bfloat16) for i in range(3)}
    wide = {name: torch.float64 if name.startswith("h") else torch.bfloat16 for name in staged}
    engine = {
        name: torch.zeros(t.shape, dtype=wide[name], device=device) for name, t in staged.items()
    }
    engine["n5"] = torch.zeros(staged["n5"].shape, dtype=torch.float16, device=device)  # alone
    cast = [Adoptable(name, view, engine[name]) for name, view in staged.items()]
    in_place = InPlace()
    in_place.adopt(("layout",), [], torch.zeros(4, device=device), held=None, cast=cast)
    in_place.cast_in()
    for name, view in staged.items():
        expected = view.to(engine[name].dtype)
        assert engine[name].dtype == expected.dtype
        assert torch.equal(
            engine[name].view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)
        )


def test_cast_tensors_staged_together_live_in_one_arena_cast_in_one_copy(
    device: str = "cpu",
) -> None:
    """Float32 norms staged back to back (at 256-byte boundaries, as a slot lays its fp32
    buffer out) and held by the engine in bfloat16 get storage in one arena laid out as their
    slices, keeping their values; each install casts the span in one copy, bit for bit. A
    lone pair of dtypes and a slice outside staging are cast one by one."""
    torch.manual_seed(1)
    staging = torch.zeros(2048, dtype=torch.uint8, device=device)
    placed = {"n0": (0, 60), "n1": (256, 50), "n2": (512, 33), "h": (1024, 5)}
    views = {n: staging[at : at + 4 * k].view(torch.float32) for n, (at, k) in placed.items()}
    views["out"] = torch.zeros(6, device=device)  # not in staging
    engine = {n: torch.randn(v.shape, device=device).to(torch.bfloat16) for n, v in views.items()}
    engine["h"] = engine["h"].to(torch.float16)  # its pair of dtypes alone
    before = {n: t.clone() for n, t in engine.items()}
    in_place = InPlace()
    live, cast = candidates(views, engine)
    assert not live and len(cast) == 5
    in_place.adopt(("layout",), live, staging, held=None, cast=cast)

    assert len(in_place.spans) == 1
    arena = in_place.spans[0].arena
    assert arena.dtype == torch.bfloat16 and arena.numel() == (512 + 4 * 33) // 4
    for name in ("n0", "n1", "n2"):
        assert engine[name].untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
        assert engine[name].data_ptr() == arena.data_ptr() + placed[name][0] // 2
    for name in ("h", "out"):
        assert engine[name].untyped_storage().data_ptr() != arena.untyped_storage().data_ptr()
    assert all(torch.equal(engine[n], before[n]) for n in engine)  # values kept

    for view in views.values():
        view.copy_(torch.randn(view.shape, device=device))
    in_place.cast_in()
    for name, view in views.items():
        expected = view.to(engine[name].dtype)
        assert torch.equal(engine[name].view(torch.uint8), expected.view(torch.uint8)), name

    in_place.release()
    assert not in_place.spans
    kept = {n: t.clone() for n, t in engine.items()}
    staging.zero_()
    assert all(torch.equal(engine[n], kept[n]) for n in engine)
