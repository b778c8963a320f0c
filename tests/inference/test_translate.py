"""What a vLLM TP rank keeps of each HF tensor (`slices`) and where that lives in the Megatron
tensors (`translate`), against transformers' own models of every supported layout."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference_ext.receiver_plan import wanted_slices
from inference_ext.slices import (
    VLLM_VOCAB_PADDING,
    ReceiverLayout,
    UnsupportedLayout,
    hf_slice,
    kv_heads,
    vocab_rows,
)
from inference_ext.translate import megatron_part, megatron_sources
from megatron_hf.checkpoint import save_hf_checkpoint
from megatron_hf.convert import hf_names, hf_shape, hf_to_megatron, megatron_to_hf
from megatron_hf.spec import ModelFamily, ModelSpec, padded_vocab_size
from refit_sidecar.core.manifest import Box
from tests.inference.conftest import Tiny
from tests.support.specs import synthetic_spec

Models = Callable[[str], Tiny]
TOKENS = torch.tensor([[1, 23, 24, 17, 25, 26, 35, 26, 28, 5, 40]])


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box.ranges)


def _within(inner: Box, outer: Box) -> Box:
    """`inner` in the coordinates of `outer`'s first element."""
    return Box(tuple((a - o, b - o) for (a, b), o in zip(inner.ranges, outer.start, strict=True)))


_spec = synthetic_spec


def _receiver_names(spec: ModelSpec) -> list[str]:
    """Every HF name, plus the tied LM head (which the receiver never asks for)."""
    return hf_names(spec) + (["lm_head.weight"] if spec.tie_word_embeddings else [])


# -- HF -> Megatron: boxes --------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_megatron_sources_reproduce_every_hf_slice(tiny: Models, variant: str, tp: int) -> None:
    """For every HF name and receiver rank, the Megatron boxes `megatron_sources` names, cut out
    of the converted (vocab-padded) Megatron tensors, tile the rank's HF slice exactly once and
    reproduce it bit for bit. tp 2 and 4 replicate the MQA model's one KV head."""
    model = tiny(variant)
    spec = model.spec
    padded = padded_vocab_size(spec.vocab_size, 2)
    assert padded > spec.vocab_size
    meg = hf_to_megatron(model.hf, spec, padded)
    for rank in range(tp):
        layout = ReceiverLayout(rank, tp)
        for name in _receiver_names(spec):
            box = hf_slice(name, spec, layout)
            assert box is not None, (name, layout)  # 101 rows: every rank holds some
            assert box.within(hf_shape(name, spec))
            sources = megatron_sources(name, box, spec)
            got = torch.full(box.shape, float("nan"))
            cover = torch.zeros(box.shape, dtype=torch.int32)
            for source in sources:
                tensor = meg[source.megatron_name]
                assert source.megatron_box.shape == source.hf_box.shape, source
                assert source.megatron_box.within(tensor.shape), source
                assert box.contains(source.hf_box), source
                local = _index(_within(source.hf_box, box))
                got[local] = tensor[_index(source.megatron_box)]
                cover[local] += 1
            assert torch.all(cover == 1), (name, layout, sources)
            assert torch.equal(got, model.hf[name][_index(box)]), (name, layout)
            if megatron_part(name, spec)[0] == "embedding.word_embeddings.weight":
                # never a padded vocabulary row
                assert all(s.megatron_box.ranges[0][1] <= spec.vocab_size for s in sources)


def test_qkv_slices_come_from_whole_query_groups(tiny: Models) -> None:
    """A q slice spanning several query groups is one source per group; a k/v slice of one
    head is one source at that group's k (v) rows of linear_qkv."""
    spec = tiny("llama_gqa").spec  # 4 heads of 16 in 2 groups: group rows [q q k v] x 16
    q = "model.layers.1.self_attn.q_proj.weight"
    sources = megatron_sources(q, Box.full(hf_shape(q, spec)), spec)
    assert [s.megatron_box.ranges[0] for s in sources] == [(0, 32), (64, 96)]
    assert [s.hf_box.ranges[0] for s in sources] == [(0, 32), (32, 64)]
    assert {s.megatron_name for s in sources} == {
        "decoder.layers.1.self_attention.linear_qkv.weight"
    }
    v = "model.layers.1.self_attn.v_proj.weight"
    box = hf_slice(v, spec, ReceiverLayout(1, 2))
    assert box == Box(((16, 32), (0, 64)))  # KV head 1
    (source,) = megatron_sources(v, box, spec)
    assert source.megatron_box == Box(((112, 128), (0, 64)))  # v rows of group 1
    up = "model.layers.0.mlp.up_proj.weight"
    (source,) = megatron_sources(up, Box(((32, 64), (0, 64))), spec)
    assert source.megatron_box == Box(((160, 192), (0, 64)))


# -- Megatron -> HF: tensors ------------------------------------------------------------------


def test_megatron_to_hf_is_the_models_own_state_dict(tiny: Models, variant: str) -> None:
    """HF -> padded Megatron -> HF gives the transformers model's own state_dict bit for bit
    (the tied LM head is the embedding), and a freshly initialised model of the same class
    loaded with it computes the original logits exactly."""
    model = tiny(variant)
    spec = model.spec
    back = megatron_to_hf(
        hf_to_megatron(model.hf, spec, padded_vocab_size(spec.vocab_size, 4)), spec
    )
    expected = {
        k: v
        for k, v in model.hf.items()
        if not (spec.tie_word_embeddings and k == "lm_head.weight")
    }
    assert list(back) == hf_names(spec)
    assert set(back) == set(expected)
    for name, tensor in expected.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    if spec.tie_word_embeddings:
        assert torch.equal(model.hf["lm_head.weight"], back["model.embed_tokens.weight"])

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        fresh = type(model.model)(model.model.config).float().eval()
    assert not torch.equal(fresh.model.embed_tokens.weight, model.hf["model.embed_tokens.weight"])
    result = fresh.load_state_dict(back, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    if spec.tie_word_embeddings:
        assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(fresh(TOKENS).logits, model.model(TOKENS).logits)


def test_exported_mqa_checkpoint_reloads_with_the_same_logits(tiny: Models, tmp_path: Path) -> None:
    """The tied MQA model exported from Megatron (save_hf_checkpoint) and reloaded by
    transformers keeps its logits: the one KV head and the tied head survive the export."""
    model = tiny("llama_mqa_tied")
    spec = model.spec
    back = megatron_to_hf(hf_to_megatron(model.hf, spec, 256), spec)
    out = save_hf_checkpoint(tmp_path / "export", back, model.path)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, model.model(TOKENS).logits)


# -- what vLLM keeps --------------------------------------------------------------------------

# (vocab, TP) pairs: the tiny models' 101, one whose last rank holds only padding (70 over
# 4), and real vocabularies (Llama 2, GPT-2, Llama 3, Qwen).
_VOCAB_CASES = [(101, 1), (101, 2), (101, 4), (70, 4), (70, 2), (32000, 2), (50257, 4)]
_VOCAB_CASES += [(128256, 8), (151936, 4), (151936, 8), (1, 2)]

_VLLM_INDICES = """
import json, sys
from vllm.model_executor.layers.vocab_parallel_embedding import (
    DEFAULT_VOCAB_PADDING_SIZE, VocabParallelEmbedding, pad_vocab_size)
out = []
for vocab, tp in json.loads(sys.argv[1]):
    padded = pad_vocab_size(vocab, DEFAULT_VOCAB_PADDING_SIZE)
    for rank in range(tp):
        i = VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp)
        out.append([vocab, tp, rank, i.org_vocab_start_index, i.org_vocab_end_index])
print("INDICES " + json.dumps([DEFAULT_VOCAB_PADDING_SIZE, out]))
"""


@pytest.fixture(scope="module")
def vllm_vocab_indices() -> tuple[int, list[list[int]]]:
    """vLLM's own vocab shard ranges, computed in a child process: importing vLLM takes ~8 s
    and sets environment variables (LD_LIBRARY_PATH, TORCHINDUCTOR_*), so the test process
    never imports it."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    result = subprocess.run(
        [sys.executable, "-c", _VLLM_INDICES, json.dumps(_VOCAB_CASES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("INDICES ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    padding, indices = json.loads(lines[-1].removeprefix("INDICES "))
    return int(padding), indices


def test_vocab_rows_are_vllms_shard_indices(
    vllm_vocab_indices: tuple[int, list[list[int]]],
) -> None:
    padding, indices = vllm_vocab_indices
    assert padding == VLLM_VOCAB_PADDING
    assert len(indices) == sum(tp for _, tp in _VOCAB_CASES)
    for vocab, tp, rank, start, stop in indices:
        spec = _spec(vocab_size=vocab)
        layout = ReceiverLayout(rank, tp)
        assert vocab_rows(spec, layout) == (start, stop), (vocab, tp, rank)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            box = hf_slice(name, spec, layout)
            if start == stop:
                assert box is None, (vocab, tp, rank)
            else:
                assert box == Box(((start, stop), (0, spec.hidden_size))), (vocab, tp, rank)


def test_a_rank_of_only_vocab_padding_wants_no_embedding() -> None:
    spec = _spec(vocab_size=70)  # padded to 128: ranks of 32 rows, the last holds rows 96..
    layout = ReceiverLayout(3, 4)
    assert vocab_rows(spec, layout) == (70, 70)
    names = [n for n, _, _ in wanted_slices(spec, layout, hf_names(spec))]
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert hf_slice("model.embed_tokens.weight", spec, ReceiverLayout(2, 4)) == Box(
        ((64, 70), (0, 64))
    )


def _vllm_qkv_rows(spec: ModelSpec, rank: int, tp: int) -> dict[str, tuple[int, int]]:
    """QKVParallelLinear.weight_loader's narrow (vLLM 0.32): q by tp_rank, k and v by
    tp_rank // num_kv_head_replicas, num_kv_heads heads each."""
    total_kv, d = spec.num_query_groups, spec.head_dim
    num_heads = spec.num_attention_heads // tp
    if tp >= total_kv:
        num_kv_heads, replicas = 1, tp // total_kv
    else:
        num_kv_heads, replicas = total_kv // tp, 1
    q_size, kv_size = num_heads * d, num_kv_heads * d
    kv_start = (rank // replicas) * kv_size
    return {
        "q_proj": (rank * q_size, (rank + 1) * q_size),
        "k_proj": (kv_start, kv_start + kv_size),
        "v_proj": (kv_start, kv_start + kv_size),
    }


@pytest.mark.parametrize(
    ("heads", "kv", "tp"),
    [(4, 2, 1), (4, 2, 2), (4, 2, 4), (4, 1, 2), (4, 1, 4), (8, 8, 4), (8, 2, 8), (32, 8, 8)],
)
def test_qkv_and_row_parallel_slices_follow_vllms_narrowing(heads: int, kv: int, tp: int) -> None:
    spec = _spec(num_attention_heads=heads, num_query_groups=kv, head_dim=8, qkv_bias=True)
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q_cover = torch.zeros(heads * d, dtype=torch.int32)
    kv_cover = torch.zeros(kv * d, dtype=torch.int32)
    for rank in range(tp):
        layout = ReceiverLayout(rank, tp)
        for key, rows in _vllm_qkv_rows(spec, rank, tp).items():
            weight = hf_slice(f"model.layers.0.self_attn.{key}.weight", spec, layout)
            bias = hf_slice(f"model.layers.0.self_attn.{key}.bias", spec, layout)
            assert weight == Box((rows, (0, h))), (key, layout)
            assert bias == Box((rows,)), (key, layout)
        first, last = kv_heads(spec, layout)
        assert (first * d, last * d) == _vllm_qkv_rows(spec, rank, tp)["k_proj"]
        q_cover[slice(*_vllm_qkv_rows(spec, rank, tp)["q_proj"])] += 1
        kv_cover[slice(first * d, last * d)] += 1
        per_head, per_ffn = heads * d // tp, f // tp
        o_cols = (rank * per_head, (rank + 1) * per_head)
        ffn = (rank * per_ffn, (rank + 1) * per_ffn)
        assert hf_slice("model.layers.1.self_attn.o_proj.weight", spec, layout) == Box(
            ((0, h), o_cols)
        )
        assert hf_slice("model.layers.1.mlp.gate_proj.weight", spec, layout) == Box((ffn, (0, h)))
        assert hf_slice("model.layers.1.mlp.up_proj.weight", spec, layout) == Box((ffn, (0, h)))
        assert hf_slice("model.layers.1.mlp.down_proj.weight", spec, layout) == Box(((0, h), ffn))
        for whole in ("model.norm.weight", "model.layers.1.input_layernorm.weight"):
            assert hf_slice(whole, spec, layout) == Box.full(hf_shape(whole, spec))
    assert torch.all(q_cover == 1)  # query heads split
    assert torch.all(kv_cover == max(tp // kv, 1))  # KV heads split, or replicated tp/kv times


def test_qk_norms_are_read_whole() -> None:
    spec = _spec(family=ModelFamily.QWEN3, architecture="Qwen3ForCausalLM", head_dim=24)
    for name in (
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
    ):
        assert hf_slice(name, spec, ReceiverLayout(1, 4)) == Box(((0, 24),))


def test_tied_lm_head_is_the_word_embedding(tiny: Models) -> None:
    for name in ("llama_mqa_tied", "qwen2_tied"):
        spec = tiny(name).spec
        assert spec.tie_word_embeddings
        assert "lm_head.weight" not in hf_names(spec)
        for tp in (1, 2, 4):
            wanted = wanted_slices(spec, ReceiverLayout(tp - 1, tp), hf_names(spec))
            assert "lm_head.weight" not in [n for n, _, _ in wanted]
        assert megatron_part("lm_head.weight", spec) == ("embedding.word_embeddings.weight", 0)
    untied = tiny("llama_gqa").spec
    assert "lm_head.weight" in hf_names(untied)
    assert megatron_part("lm_head.weight", untied) == ("output_layer.weight", 0)
    assert megatron_part("model.layers.1.self_attn.v_proj.bias", untied) == (
        "decoder.layers.1.self_attention.linear_qkv.bias",
        2,
    )
    assert megatron_part("model.layers.0.mlp.up_proj.weight", untied) == (
        "decoder.layers.0.mlp.linear_fc1.weight",
        1,
    )


# -- bad input --------------------------------------------------------------------------------


def test_boxes_outside_the_hf_tensor_are_rejected() -> None:
    spec = _spec()
    with pytest.raises(
        ValueError, match=r"model.embed_tokens.weight: box .* is outside \(101, 64\)"
    ):
        megatron_sources("model.embed_tokens.weight", Box(((96, 102), (0, 64))), spec)
    with pytest.raises(ValueError, match="outside"):
        megatron_sources("model.layers.0.self_attn.k_proj.weight", Box(((0, 33), (0, 64))), spec)
    with pytest.raises(ValueError, match="outside"):  # wrong number of dimensions
        megatron_sources("model.norm.weight", Box(((0, 1), (0, 1))), spec)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.o_proj.bias",
        "model.layers.0.mlp.fc.weight",
        "model.layers.x.self_attn.q_proj.weight",
        "model.layers.2.self_attn.q_proj.weight",  # the model has layers 0 and 1
        "model.rotary_emb.inv_freq",
        "lm_head.bias",
        "embed_tokens.weight",
    ],
)
def test_unknown_hf_names_are_rejected(name: str) -> None:
    spec = _spec()
    with pytest.raises(ValueError, match="no Megatron counterpart for HF name"):
        megatron_part(name, spec)
    try:
        box = Box.full(hf_shape(name, spec))
    except ValueError as e:
        assert "unknown HF parameter" in str(e)
        box = Box(((0, 1),))
    with pytest.raises(ValueError, match=r"unknown HF parameter|no Megatron counterpart"):
        megatron_sources(name, box, spec)


@pytest.mark.parametrize(
    ("spec", "tp", "name", "message"),
    [
        (_spec(), 8, "model.layers.0.self_attn.q_proj.weight", r"attention heads \(4\) .* 8 ranks"),
        (_spec(), 8, "model.layers.0.self_attn.o_proj.weight", r"attention heads \(4\) .* 8 ranks"),
        (
            _spec(num_attention_heads=6, num_query_groups=3),
            2,
            "model.layers.0.self_attn.k_proj.weight",
            "3 key/value heads do not split over 2 ranks",
        ),
        (
            _spec(num_attention_heads=12, num_query_groups=3),
            4,
            "model.layers.0.self_attn.v_proj.weight",
            "4 ranks cannot replicate 3 key/value heads",
        ),
        (
            _spec(ffn_hidden_size=100, num_attention_heads=8, num_query_groups=8, head_dim=8),
            8,
            "model.layers.0.mlp.down_proj.weight",
            r"ffn_hidden_size \(100\) does not split over 8 ranks",
        ),
        (
            _spec(),
            3,
            "lm_head.weight",
            r"vocabulary 101 \(padded to 128\) does not split over 3 ranks",
        ),
    ],
)
def test_layouts_vllm_cannot_split_are_rejected(
    spec: ModelSpec, tp: int, name: str, message: str
) -> None:
    with pytest.raises(UnsupportedLayout, match=message):
        hf_slice(name, spec, ReceiverLayout(0, tp))
    with pytest.raises(UnsupportedLayout, match=message):
        wanted_slices(spec, ReceiverLayout(tp - 1, tp), hf_names(spec))
    assert issubclass(UnsupportedLayout, ValueError)


def test_receiver_layout_rank_out_of_range() -> None:
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="out of range"):
            ReceiverLayout(rank, size)
