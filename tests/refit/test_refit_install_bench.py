"""`benchmarks/refit_install.py` end to end on the CPU with a bfloat16 trainer: the receiver
reads each version behind the trainer's snapshot copy straight into a transformers model's
tensors (in place), casts the norms the trainer keeps in float32 into the model's bfloat16
ones from one arena, and the installed model must equal ExportHF bit for bit and compute the
trainer's Forward logprobs (the benchmark's own check, on the last version). The same for a
mixture of experts, whose fused expert tensors the pull fills in place; and the fused layout
itself against transformers' own loading of a checkpoint's per-expert tensors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.hf_model import as_loaded, hf_parameters
from inference_ext.expert_slices import (
    ExpertTarget,
    FusedExpertTensor,
    receiver_names,
    target_name,
)
from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.convert import hf_names
from megatron_hf.spec import ModelFamily, ModelSpec
from megatron_hf.tiny import write_tiny_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(preset: str, tmp_path: Path, *args: str) -> tuple[dict, Path]:
    out, logs = tmp_path / "install.json", tmp_path / "logs"
    command = [sys.executable, "-m", "benchmarks.refit_install", "--preset", preset]
    command += ["--device", "cpu", "--steps", "2", *args]
    command += ["--out", str(out), "--log-dir", str(logs), "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text()), logs


def test_an_in_place_refit_with_cast_norms_equals_export_and_forward(tmp_path: Path) -> None:
    result, logs = _run("tiny", tmp_path, "--params-dtype", "bfloat16", "--trace")
    check = result["check"]
    assert check["identical"] and not check["differing"] and not check["not_exported"], check
    assert check["cast_to_model_dtype"] > 0  # the fp32 norms, cast into bf16 tensors
    assert check["max_logprob_gap"] < 0.02, check  # bf16 against the trainer's Forward
    timed = [r["refit"]["stats"] for r in result["records"] if not r["warmup"]]
    assert len(timed) == 2
    for stats in timed:
        assert stats["in_place_bytes"] > 0, stats
        assert stats["lease_held_by"] == "checksums", stats  # every read verified
        # --trace: the pull's timeline, from its start to its check's end, in time order.
        # Behind the copy, the gate opened on its first look (in the trace and the stats) or,
        # when the sidecar's answer came first, on its word that the version is readable
        # (that may be while the early pull was planned, before it began).
        events = [name for _, name, _, _ in stats["trace"]]
        pulled = [name for name in events if name != "readable"]
        assert pulled[0] == "began" and pulled[-1] == "verified", events
        assert {"prepared", "posted", "landed"} <= set(events), events
        times = [at for at, *_ in stats["trace"]]
        assert times == sorted(times)
        if "saw" in events:
            assert stats["gate_rounds"] >= 1 and 0 < stats["gate_first_s"] < stats["pull_s"]
        else:
            assert "readable" in events and stats["gate_rounds"] == 0, (events, stats)
    traced = set(result["summary"]["trace_ms"])
    assert {"prepared", "posted", "landed", "verified"} <= traced
    assert traced & {"saw", "readable"}, traced
    assert traced <= {"prepared", "saw", "readable", "posted", "landed", "verified"}, traced
    # Every cast tensor lives in the one arena its fp32 slices' span maps to.
    adopted = re.findall(
        r"(\d+) cast in, (\d+) of them from (\d+) arenas", (logs / "receiver.log").read_text()
    )
    assert adopted and all(int(n) > 0 and n == m and k == "1" for n, m, k in adopted), adopted


def test_a_moe_refit_pulls_fused_experts_in_place_equal_to_export(tmp_path: Path) -> None:
    """Qwen3-MoE (8 experts, top-2, 2 layers): the receiver installs 2 fused expert tensors a
    layer instead of 24 per-expert ones, every byte pulled straight into the model's tensors,
    and they equal ExportHF's per-expert tensors fused as transformers fuses them."""
    result, _ = _run("tiny-moe", tmp_path)
    check, summary = result["check"], result["summary"]
    assert check["identical"] and not check["differing"] and not check["not_exported"], check
    receiver = result["receiver"]
    tensors = {
        k: receiver[k] for k in ("installed_tensors", "fused_expert_tensors", "expert_tensors")
    }
    assert tensors == dict(installed_tensors=25, fused_expert_tensors=4, expert_tensors=48)
    # the model's tensors compared: ExportHF's 48 per-expert tensors as its 4 fused ones
    assert check["checked_tensors"] == receiver["installed_tensors"]
    assert check["exported_tensors"] == 25 - 4 + 48
    assert check["max_logprob_gap"] < 1e-4, check  # float32 on both sides
    for record in result["records"][1:]:  # once the first refit adopted them
        stats = record["refit"]["stats"]
        assert stats["in_place_bytes"] == stats["bytes_pulled"] > 0, stats
    # The control plane (each refit's time before its first read): the lease, then the
    # manifest and plan, inside the refit.
    for record in result["records"]:
        stats = record["refit"]["stats"]
        assert 0 < stats["lease_s"] < stats["plan_s"] < record["refit"]["latency_s"], stats
    median = summary["median_ms"]
    assert 0 < median["lease"] < median["plan"] < median["latency"]


@pytest.mark.parametrize("family", [ModelFamily.QWEN3_MOE, ModelFamily.MIXTRAL])
def test_fused_experts_are_as_transformers_loads_a_checkpoint(
    tmp_path: Path, family: ModelFamily
) -> None:
    """transformers 5 fuses a layer's experts when it loads them: gate_up_proj [E, 2I, H] with
    each expert's gate rows, then its up rows, and down_proj [E, H, I]. The benchmark's
    receiver names map onto the model's parameters one to one, and its fusing of a
    checkpoint's per-expert tensors gives what transformers loads."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_checkpoint(tmp_path, family, num_layers=2, seed=7)
    spec = ModelSpec.from_pretrained_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loaded = model.state_dict()
    fused = as_loaded(load_hf_state_dict(path), spec)
    assert fused.keys() == loaded.keys()
    for name, tensor in loaded.items():
        assert torch.equal(fused[name], tensor), name
    params = hf_parameters(model, spec, receiver_names(spec, hf_names(spec)))
    w13 = params[target_name(spec, ExpertTarget(1, FusedExpertTensor.W13))]
    assert w13 is model.model.layers[1].mlp.experts.gate_up_proj
