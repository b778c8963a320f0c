"""Publication on a GPU waits for the update it publishes. FinishTrainStep answers while the GPU
still applies the optimizer step, and the next step's microbatches run without a host
synchronization; a receiver that pulls each version into VRAM the moment it is readable (WSUM-64
verified on its GPU) must still get ExportHF's weights bit for bit, step after step. A snapshot
copy that did not wait for the update would copy a half-updated model. Run on a lent GPU machine:

    python -m pytest -m gpu tests/gpu -s
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.trainer_step import write_model
from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.convert import megatron_to_hf
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.plan import plan_pull, whole
from refit_sidecar.memory.region import Region
from refit_sidecar.memory.tensor_arena import TorchArena
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from tests.support.batches import make_batch
from tests.support.isolation import in_child_process
from tests.support.sidecar import running_sidecar
from tests.support.trainer import TrainerProcess
from trainer_svc.domain import ExportDType, LossConfig, OptimizerOverrides

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _model_dir(path: Path) -> Path:
    """A config-only Llama of about 250M parameters (`benchmarks.trainer_step.write_model`):
    its update takes milliseconds on the GPU, long enough for a snapshot that did not wait for
    it to catch it half done."""
    shape = dict(layers=16, hidden=1024, ffn=2816, heads=16, kv_heads=8, vocab=32000)
    return write_model(
        path,
        SimpleNamespace(**shape, max_positions=1024, params_dtype="bfloat16", hf_weights=False),
    )


@in_child_process
def test_a_version_pulled_the_moment_it_is_readable_equals_export(tmp_path) -> None:
    model = _model_dir(tmp_path / "model")
    spec = ModelSpec.from_pretrained_dir(model)
    loss = LossConfig()
    batch = make_batch(seed=1, lengths=[512] * 8, loss=loss, vocab_size=32000)
    with running_sidecar(tmp_path / "sidecar") as sidecar:
        trainer = TrainerProcess(
            tmp_path / "trainer",
            [
                *("--model", str(model), "--device", "cuda", "--params-dtype", "bfloat16"),
                *("--max-seq-len", "512", *sidecar.trainer_args(), "--refit-slots", "2"),
            ],
        )
        transport = NixlTransport.create(NixlConfig(name="publication-gpu", pull_timeout_s=60))
        client = sidecar.client()
        staging: TorchArena | None = None
        try:
            for step in range(1, 4):
                step_id = f"s{step}"
                trainer.client.begin_step(step_id, loss, OptimizerOverrides(learning_rate=1e-3))
                for j in range(2):
                    trainer.client.train_microbatch(step_id, f"m{j}", batch)
                version = trainer.client.finish_step(step_id).weights_version
                assert client.wait_visible(version) == version  # at once: no pause
                manifest = client.manifest(version)
                plan = plan_pull(manifest, whole(manifest))
                if staging is None:
                    staging = TorchArena.allocate(plan.nbytes, 256, device=torch.device("cuda"))
                region = Region(staging.address, staging.nbytes, staging.mem_type, 0, owner=staging)
                stats = transport.pull(plan, region, verify=True)
                assert stats.verified_shards == len(plan.targets)
                tensors = {
                    t.name: staging.tensor[t.span].view(_DTYPES[t.dtype.value]).view(t.box.shape)
                    for t in plan.targets
                }
                pulled = megatron_to_hf(tensors, spec)
                export = tmp_path / "trainer" / "exports" / step_id
                trainer.client.export_hf(export, dtype=ExportDType.PARAMS)
                exported = {k: v.cuda() for k, v in load_hf_state_dict(export).items()}
                assert pulled.keys() == exported.keys()
                differing = [n for n, t in exported.items() if not torch.equal(pulled[n], t)]
                assert not differing, f"version {version}: {differing[:5]} differ from ExportHF"
        finally:
            client.close()
            transport.close()
            assert trainer.stop() == 0
