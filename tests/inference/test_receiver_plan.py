"""A receiver's pull plan over a manifest published like the trainer publishes it: which bytes
each vLLM TP rank reads, replaying the plan on later versions (`rebase`), and an end-to-end pull
through the in-memory transport that reassembles the HF checkpoint's slices bit for bit."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from inference_ext.receiver import TORCH_DTYPES
from inference_ext.receiver_plan import HFSlice, ReceiverPlan, ReceiverPlans, plan_receiver
from inference_ext.slices import ReceiverLayout, hf_slice, vocab_rows
from megatron_hf.convert import VOCAB_PADDED, hf_names, hf_to_megatron
from megatron_hf.sharding import stage_of, tp_placement
from megatron_hf.spec import ModelSpec, padded_vocab_size
from refit_sidecar.core.manifest import Box, Manifest
from refit_sidecar.core.plan import PullPlan, UnsupportedRequest, layout_key, rebase
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.transport import InMemoryTransport, SourceLost
from refit_sidecar.service.client import Lease
from tests.inference.conftest import Tiny
from tests.inference.publish import Published, publish

Models = Callable[[str], Tiny]


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box.ranges)


def _megatron(model: Tiny, trainer_tp: int, dtype: torch.dtype = torch.float32):
    meg = hf_to_megatron(model.hf, model.spec, padded_vocab_size(model.spec.vocab_size, trainer_tp))
    return {name: tensor.to(dtype) for name, tensor in meg.items()}


def _skip_unless_megatron_splits(spec: ModelSpec, trainer_tp: int) -> None:
    if spec.num_query_groups % trainer_tp:
        pytest.skip(f"Megatron cannot split {spec.num_query_groups} KV groups over TP {trainer_tp}")


def _plans(published: Published, spec: ModelSpec, tp: int) -> list[ReceiverPlan]:
    names = hf_names(spec)
    return [
        plan_receiver(published.manifest, spec, ReceiverLayout(r, tp), names) for r in range(tp)
    ]


def _coverage(manifest: Manifest, plan: PullPlan) -> dict[str, np.ndarray]:
    """How often the plan reads each element of each global Megatron tensor, worked out from
    the source byte ranges of its reads and the shards' pieces alone."""
    counts: dict[str, np.ndarray] = {}
    for reads in plan.reads:
        record = manifest.get(reads.parameter)
        assert record is not None
        shard = record.shards[reads.shard]
        assert shard.location == reads.location
        global_index = np.arange(math.prod(record.shape)).reshape(record.shape)
        local = np.full(shard.location.shape, -1, np.int64)
        for piece in shard.pieces:
            local[_index(Box.at(piece.local_start, piece.box.shape))] = global_index[
                _index(piece.box)
            ]
        local = local.reshape(-1)
        item = record.dtype.itemsize
        count = counts.setdefault(reads.parameter, np.zeros(math.prod(record.shape), np.int64))
        for offset, length in zip(reads.shard_offsets, reads.lengths, strict=True):
            assert offset % item == 0 and length % item == 0
            read = local[offset // item : (offset + length) // item]
            assert np.all(read >= 0), "a read outside the shard's pieces"
            np.add.at(count, read, 1)
    return {name: c.reshape(manifest.get(name).shape) for name, c in counts.items()}  # type: ignore[union-attr]


def _real(name: str, shape: Sequence[int], spec: ModelSpec) -> np.ndarray:
    """1 where the global Megatron tensor holds model weights, 0 on padded vocabulary rows."""
    mask = np.ones(shape, np.int64)
    if name in VOCAB_PADDED:
        mask[spec.vocab_size :] = 0
    return mask


def _wanted(plan: ReceiverPlan, manifest: Manifest) -> dict[str, np.ndarray]:
    """1 on each element of the plan's targets (which are distinct)."""
    out: dict[str, np.ndarray] = {}
    for target in plan.pull.targets:
        shape = manifest.get(target.name).shape  # type: ignore[union-attr]
        mask = out.setdefault(target.name, np.zeros(shape, np.int64))
        mask[_index(target.box)] += 1
    assert all(m.max() == 1 for m in out.values()), "two targets overlap"
    return out


def _bytes(coverage: dict[str, np.ndarray], names: Sequence[str], itemsize: int) -> int:
    return sum(int(coverage.get(n, np.zeros(0)).sum()) * itemsize for n in names)


# -- what each rank reads ---------------------------------------------------------------------


@pytest.mark.parametrize("trainer_tp", [1, 2])
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied", "qwen3"])
def test_tp2_ranks_split_the_tp_split_bytes_and_each_reads_the_norms(
    tiny: Models, name: str, trainer_tp: int
) -> None:
    model = tiny(name)
    spec = model.spec
    published = publish(_megatron(model, trainer_tp), spec, tp=trainer_tp)
    manifest = published.manifest
    plans = _plans(published, spec, 2)
    coverage = [_coverage(manifest, p.pull) for p in plans]
    split = [n for n in manifest.names if tp_placement(n).dim is not None]
    replicated = [n for n in manifest.names if tp_placement(n).dim is None]
    assert split and replicated
    for plan, cover in zip(plans, coverage, strict=True):
        # a plan reads each byte it wants once, and nothing else
        wanted = _wanted(plan, manifest)
        assert cover.keys() == wanted.keys()
        for parameter, mask in wanted.items():
            assert np.array_equal(cover[parameter], mask), parameter
        assert plan.pull.bytes_read == sum(t.nbytes for t in plan.pull.targets)
        for parameter in replicated:  # norms: whole, by each rank
            assert np.all(cover[parameter] == 1), parameter
    for parameter in split:  # both ranks together: every real byte exactly once
        record = manifest.get(parameter)
        assert record is not None
        total = sum(c.get(parameter, np.zeros(record.shape, np.int64)) for c in coverage)
        assert np.array_equal(total, _real(parameter, record.shape, spec)), parameter

    # each rank reads half, but for the vocabulary rows (64 and 37 of the 101)
    item, row = 4, spec.hidden_size * 4
    vocab = [n for n in split if n in VOCAB_PADDED]
    others = [n for n in split if n not in VOCAB_PADDED]
    assert len(vocab) == (1 if spec.tie_word_embeddings else 2)
    both = sum(_bytes(c, others, item) for c in coverage)
    rows = [vocab_rows(spec, ReceiverLayout(r, 2)) for r in range(2)]
    assert rows == [(0, 64), (64, 101)]
    for cover, (start, stop) in zip(coverage, rows, strict=True):
        assert _bytes(cover, others, item) * 2 == both
        assert _bytes(cover, vocab, item) == len(vocab) * (stop - start) * row
    split_bytes = [_bytes(c, split, item) for c in coverage]
    assert split_bytes[0] - split_bytes[1] == len(vocab) * (64 - 37) * row


@pytest.mark.parametrize(("trainer_tp", "pp"), [(1, 1), (2, 1), (2, 2)])
def test_a_tp1_receiver_reads_the_whole_model_once(
    tiny: Models, variant: str, trainer_tp: int, pp: int
) -> None:
    model = tiny(variant)
    spec = model.spec
    _skip_unless_megatron_splits(spec, trainer_tp)
    published = publish(_megatron(model, trainer_tp), spec, tp=trainer_tp, pp=pp)
    manifest = published.manifest
    (plan,) = _plans(published, spec, 1)
    cover = _coverage(manifest, plan.pull)
    assert set(cover) == set(manifest.names)
    for record in manifest.parameters:
        assert np.array_equal(cover[record.name], _real(record.name, record.shape, spec))
    real = sum(int(_real(r.name, r.shape, spec).sum()) * 4 for r in manifest.parameters)
    assert plan.pull.bytes_read == real
    assert plan.pull.agents.keys() == published.buffers.keys()  # every trainer rank serves
    for record in manifest.parameters:  # global names, each served by its own stage's ranks
        stage = stage_of(record.name, spec.num_layers, pp)
        assert [s.pipeline_stage for s in record.shards] == [stage] * trainer_tp, record.name
        assert [s.rank for s in record.shards] == [
            stage * trainer_tp + r for r in range(trainer_tp)
        ]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_replicated_mqa_kv_head_is_read_by_every_rank(tiny: Models, tp: int) -> None:
    """With one KV head every rank reads the same Megatron box of k and v (once each); the
    query rows are split."""
    model = tiny("llama_mqa_tied")
    spec = model.spec
    published = publish(_megatron(model, 1), spec, tp=1)  # Megatron splits whole KV groups
    plans = _plans(published, spec, tp)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    d, heads = spec.head_dim, spec.num_attention_heads  # group rows: [q x 4, k, v] x d
    k_rows, v_rows = (heads * d, (heads + 1) * d), ((heads + 1) * d, (heads + 2) * d)
    for plan in plans:
        boxes = [t.box.ranges[0] for t in plan.pull.targets if t.name == qkv]
        assert boxes.count(k_rows) == 1 and boxes.count(v_rows) == 1
    total = np.sum([_coverage(published.manifest, p.pull)[qkv] for p in plans], axis=0)
    assert np.all(total[: heads * d] == 1) and np.all(total[heads * d :] == tp)


def test_one_megatron_box_wanted_by_two_hf_slices_is_one_target(tiny: Models) -> None:
    """A tied LM head is the word embedding: a receiver asking for both (an HF model does)
    reads the embedding box once and assembles both slices from it; so does a name asked
    for twice."""
    model = tiny("qwen2_tied")
    spec = model.spec
    manifest = publish(_megatron(model, 2), spec, tp=2).manifest
    layout = ReceiverLayout(1, 2)
    base = plan_receiver(manifest, spec, layout, hf_names(spec))
    norm = "model.layers.0.input_layernorm.weight"
    names = [*hf_names(spec), "lm_head.weight", norm]
    plan = plan_receiver(manifest, spec, layout, names)
    assert len(plan.pull.targets) == len(base.pull.targets)
    assert plan.pull.bytes_read == base.pull.bytes_read
    embed = plan.slices[[s.name for s in plan.slices].index("model.embed_tokens.weight")]
    head = plan.slices[[s.name for s in plan.slices].index("lm_head.weight")]
    assert embed.parts == head.parts and embed.box == head.box
    assert plan.pull.targets[embed.parts[0][0]].name == "embedding.word_embeddings.weight"
    norms = [s for s in plan.slices if s.name == norm]
    assert len(norms) == 2 and norms[0].parts == norms[1].parts


# -- replaying a plan on later versions -------------------------------------------------------


def test_rebase_reads_the_new_slot_with_the_same_ranges(tiny: Models) -> None:
    model = tiny("qwen3")
    spec = model.spec
    meg = _megatron(model, 2)
    first = publish(meg, spec, tp=2, version=1, slot=0)
    later = {name: tensor + 1 for name, tensor in meg.items()}
    second = publish(later, spec, tp=2, version=2, slot=1)
    assert layout_key(first.manifest) == layout_key(second.manifest)
    assert set(first.buffers).isdisjoint(second.buffers)

    layout = ReceiverLayout(0, 2)
    plan = plan_receiver(first.manifest, spec, layout, hf_names(spec))
    replayed = rebase(plan.pull, second.manifest)
    fresh = plan_receiver(second.manifest, spec, layout, hf_names(spec)).pull
    assert replayed.version == 2 and replayed.layout == plan.pull.layout == fresh.layout
    assert replayed.targets == plan.pull.targets == fresh.targets
    assert replayed.nbytes == plan.pull.nbytes
    assert set(replayed.agents) == {a.replace("-slot0", "-slot1") for a in plan.pull.agents}
    assert all(replayed.agents[a] == second.manifest.agents[a] for a in replayed.agents)
    for old, new, planned in zip(plan.pull.reads, replayed.reads, fresh.reads, strict=True):
        record = second.manifest.get(new.parameter)
        assert record is not None
        assert (new.parameter, new.shard, new.complete) == (old.parameter, old.shard, old.complete)
        assert new.location == record.shards[new.shard].location != old.location
        assert new.crc32 == record.shards[new.shard].crc32 != old.crc32
        for column in ("shard_offsets", "lengths", "dest_offsets"):
            assert np.array_equal(getattr(new, column), getattr(old, column))
            assert np.array_equal(getattr(new, column), getattr(planned, column))
        assert new.location == planned.location

    # the replayed plan pulls the later version (checksums of the new slot verified); the old
    # plan cannot reach the new slot's agents at all
    transport = InMemoryTransport(second.buffers)
    dest = np.zeros(replayed.nbytes, np.uint8)
    stats = transport.pull(replayed, Region.of_array(dest), verify=True)
    assert stats.verified_shards == sum(r.complete for r in replayed.reads) > 0
    hf_later = {k: v + 1 for k, v in model.hf.items()}
    for hf in plan.slices:
        assert torch.equal(
            _assemble(replayed, dest, hf)[_index(hf.box)], hf_later[hf.name][_index(hf.box)]
        )
    with pytest.raises(SourceLost, match="no source agent"):
        transport.pull(plan.pull, Region.of_array(np.zeros(plan.pull.nbytes, np.uint8)))


def test_layout_key_follows_shapes_dtypes_and_the_trainer_layout(tiny: Models) -> None:
    model = tiny("llama_gqa")
    spec = model.spec
    meg = _megatron(model, 2)
    base = publish(meg, spec, tp=2).manifest
    key = layout_key(base)
    # another slot, another version, other values: the same layout
    assert (
        layout_key(publish({k: -v for k, v in meg.items()}, spec, tp=2, version=9, slot=3).manifest)
        == key
    )
    others = {
        "trainer tp 1": publish(meg, spec, tp=1).manifest,
        "trainer pp 2": publish(meg, spec, tp=2, pp=2).manifest,
        "padded vocab 512": publish(_megatron_padded(model, 512), spec, tp=2).manifest,
        "bfloat16": publish(_megatron(model, 2, torch.bfloat16), spec, tp=2).manifest,
    }
    keys = {what: layout_key(m) for what, m in others.items()}
    assert key not in keys.values() and len(set(keys.values())) == len(keys)
    plan = plan_receiver(base, spec, ReceiverLayout(0, 2), hf_names(spec)).pull
    for manifest in others.values():
        with pytest.raises(UnsupportedRequest, match="another layout than the plan's"):
            rebase(plan, manifest)


def _megatron_padded(model: Tiny, padded: int) -> dict[str, torch.Tensor]:
    return hf_to_megatron(model.hf, model.spec, padded)


# -- end to end: pull and reassemble ----------------------------------------------------------


def _assemble(plan: PullPlan, dest: np.ndarray, hf: HFSlice) -> torch.Tensor:
    """The HF tensor of full shape with the slice's box filled from the pulled targets, as
    `Receiver._assemble` builds it."""
    dtype = TORCH_DTYPES[plan.targets[hf.parts[0][0]].dtype]
    full = torch.full(hf.shape, float("nan"), dtype=dtype)
    cover = torch.zeros(hf.shape, dtype=torch.int32)
    for index, sub_box in hf.parts:
        target = plan.targets[index]
        assert target.box.shape == sub_box.shape and hf.box.contains(sub_box)
        raw = bytearray(dest[target.span].tobytes())
        full[_index(sub_box)] = torch.frombuffer(raw, dtype=dtype).reshape(target.box.shape)
        cover[_index(sub_box)] += 1
    assert torch.all(cover[_index(hf.box)] == 1) and int(cover.sum()) == hf.box.numel
    return full


@pytest.mark.parametrize("receiver_tp", [1, 2, 4])
@pytest.mark.parametrize(("trainer_tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_pulled_slices_equal_the_hf_checkpoint(
    tiny: Models, variant: str, trainer_tp: int, pp: int, receiver_tp: int
) -> None:
    model = tiny(variant)
    spec = model.spec
    _skip_unless_megatron_splits(spec, trainer_tp)
    published = publish(_megatron(model, trainer_tp), spec, tp=trainer_tp, pp=pp, version=5)
    transport = InMemoryTransport(published.buffers)
    for rank, plan in enumerate(_plans(published, spec, receiver_tp)):
        layout = ReceiverLayout(rank, receiver_tp)
        dest = np.zeros(plan.pull.nbytes, np.uint8)
        stats = transport.pull(plan.pull, Region.of_array(dest), verify=True)
        assert stats.nbytes == sum(t.nbytes for t in plan.pull.targets)
        assert [s.name for s in plan.slices] == hf_names(spec)
        for hf in plan.slices:
            assert hf.box == hf_slice(hf.name, spec, layout)
            got = _assemble(plan.pull, dest, hf)[_index(hf.box)]
            assert torch.equal(got, model.hf[hf.name][_index(hf.box)]), (hf.name, layout)


@pytest.mark.parametrize("last_first", [False, True])
def test_bfloat16_slices_are_pulled_bit_for_bit(tiny: Models, last_first: bool) -> None:
    model = tiny("qwen2_tied")
    spec = model.spec
    published = publish(
        _megatron(model, 2, torch.bfloat16), spec, tp=2, pp=2, last_first=last_first
    )
    transport = InMemoryTransport(published.buffers)
    for plan in _plans(published, spec, 2):
        dest = np.zeros(plan.pull.nbytes, np.uint8)
        transport.pull(plan.pull, Region.of_array(dest), verify=True)
        for hf in plan.slices:
            got = _assemble(plan.pull, dest, hf)[_index(hf.box)]
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, model.hf[hf.name][_index(hf.box)].to(torch.bfloat16)), hf.name


@pytest.mark.parametrize("tp", [1, 2])
def test_staging_follows_the_order_of_the_slots(tiny: Models, tp: int) -> None:
    """A receiver stages its boxes in the order their bytes sit in each trainer rank's slot,
    so that its requests, cut in staging order, read every slot front to back (behind the
    rank's snapshot copy, its first request waits for the first pieces only). Megatron's
    buffer holds the last layer first, the opposite of the HF names: the staging follows the
    slot, and each HF tensor read from one Megatron tensor stays contiguous (adoptable in
    place) either way."""
    model = tiny("llama_gqa")
    spec = model.spec
    meg = _megatron(model, tp, torch.bfloat16)
    plans = {
        last_first: plan_receiver(
            publish(meg, spec, tp=tp, last_first=last_first).manifest,
            spec,
            ReceiverLayout(0, 1),
            hf_names(spec),
        )
        for last_first in (False, True)
    }
    for plan in plans.values():
        # Per rank: where each tensor's bytes start in the slot and in staging.
        by_agent: dict[str, list[tuple[int, int]]] = {}
        for reads in plan.pull.reads:
            start = (int(reads.remote_addresses.min()), int(reads.dest_offsets.min()))
            by_agent.setdefault(reads.location.agent, []).append(start)
        for starts in by_agent.values():
            dests = [dst for _, dst in sorted(starts)]
            assert dests == sorted(dests)
    first = {t.name: t.offset for t in plans[False].pull.targets}
    last = {t.name: t.offset for t in plans[True].pull.targets}
    embedding = "embedding.word_embeddings.weight"
    assert first[embedding] == min(first.values()) and last[embedding] == max(last.values())
    contiguous = [[s.contiguous for s in p.slices] for p in plans.values()]
    assert contiguous[0] == contiguous[1] and sum(contiguous[0]) == len(hf_names(spec))


def test_asking_ahead_plans_each_slots_layout_once_then_stops_asking(tiny: Models) -> None:
    """`ReceiverPlans.prepare_ahead` plans a layout it has not met from the sidecar's pending
    manifest, and stops asking once the layouts asked about were held four times in a row;
    `layout` still plans one not met (its fetch). A stand-in for the sidecar counts the
    calls; `test_before_readable.py` runs the real path."""
    model = tiny("llama_gqa")
    spec = model.spec
    slots = [publish(_megatron(model, 1), spec, tp=1, slot=s).manifest for s in range(3)]
    asked: list[int] = []

    def key(slot: int) -> bytes:
        return f"{layout_key(slots[slot])}/{slot}".encode()

    class Sidecar:
        slot = 0

        def pending_manifest(self, version: int) -> tuple[Manifest, bytes]:
            asked.append(version)
            return slots[self.slot], key(self.slot)

    sidecar = Sidecar()
    plans = ReceiverPlans(
        sidecar,  # type: ignore[arg-type]
        spec,
        ReceiverLayout(),
        hf_names(spec),
        verify=False,
    )
    for version in range(1, 10):
        sidecar.slot = version % 2
        plans.prepare_ahead(version)
    assert asked == [1, 2, 3, 4, 5, 6]  # two layouts planned, then held four times in a row
    assert plans.held(key(0)) and plans.held(key(1))
    sidecar.slot = 2
    plans.prepare_ahead(10)
    assert asked[-1] == 6 and plans.held(key(2)) is None  # no longer asked ahead
    lease = Lease("id", 10, 30.0, manifest_key=key(2), receiver_id="r", pending=True)
    held = plans.layout(lease)
    first = plans.held(key(0))
    assert held is not None and held == plans.held(key(2)) and first is not None
    assert held[0].pull.bytes_read == first[0].pull.bytes_read
