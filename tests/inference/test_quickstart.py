"""docs/quickstart.md, run as written: its CPU blocks (`quickstart-cpu`, then
`quickstart-cpu-stop`) in a fresh directory with this venv on PATH, the vLLM port the only
substitution, no VLLM_* variables inherited and TMPDIR a directory of its own. Between the
two, /trainer_refit/ready must have answered 503 before the step and 200 after it, and the
served version must be the trainer's, its prompt logprobs the trainer's Forward within the
page's bound; after the stop, every process the page started has exited, vLLM's engine shut
down without being killed, and nothing is left in the temp directory.

It starts its own `vllm serve`: the page's server follows the trainer by itself with its
refit settings fixed at start, which would refuse the other init_info and race the explicit
updates of test_vllm_serve.py's server.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import psutil

from tests.support.fidelity import FIDELITY, PROMPTS
from tests.support.trainer import kill_tree
from tests.support.vllm_server import free_port
from trainer_refit.auth import ClientAuth
from trainer_svc.client import TrainerClient
from trainer_svc.domain import SequenceBatch

PAGE = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"
PORT_LINE = "export VLLM_PORT=8000"
SERVERS = ("vllm", "trainer", "sidecar")


def page_blocks(tag: str) -> str:
    """The page's ```bash <tag> blocks, in order, as one script."""
    pattern = re.compile(r"^```bash (\S+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
    blocks = [body for info, body in pattern.findall(PAGE.read_text()) if info == tag]
    assert blocks, f"no ```bash {tag} block in {PAGE}"
    return "\n".join(blocks)


def run_script(script: str, cwd: Path, env: dict[str, str], log: Path, timeout: float) -> None:
    with log.open("ab") as out:
        code = subprocess.run(
            ["bash", "-c", f"set -euo pipefail\n{script}"],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        ).returncode
    assert code == 0, f"exit {code}\n{_tails(log)}"


def _tails(log: Path, lines: int = 40) -> str:
    """The ends of the script's output and of the servers' logs."""
    parts = []
    for path in [log, *(log.parent / "refit-quickstart" / f"{n}.log" for n in SERVERS)]:
        if path.is_file():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(parts)


def served_and_trained(work: Path, port: int) -> tuple[str, int, float]:
    """The version that served PROMPTS[0], the trainer's version, and the largest gap between
    the served prompt logprobs and the trainer's Forward."""
    prompt = PROMPTS[0]
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}}
    response = httpx.post(f"http://127.0.0.1:{port}/inference/v1/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    reply = response.json()
    (span,) = reply["choices"][0]["weight_versions"]
    served = [reply["prompt_logprobs"][i][str(t)]["logprob"] for i, t in enumerate(prompt) if i]
    auth = ClientAuth(token_file=work / "tokens" / "orchestrator")
    target = f"127.0.0.1:{(work / 'trainer.port').read_text()}"
    with TrainerClient(target, auth=auth, timeout=60) as trainer:
        forward = trainer.forward(SequenceBatch.from_lists([prompt]))
    assert forward.logprobs is not None
    gap = float(np.abs(np.asarray(served) - forward.logprobs[1:]).max())
    return span["version"], forward.weights_version, gap


def _processes(work: Path) -> list[psutil.Process]:
    """The servers the page started (by their pid files) and all their descendants."""
    found = []
    for name in SERVERS:
        with contextlib.suppress(OSError, ValueError, psutil.NoSuchProcess):
            server = psutil.Process(int((work / f"{name}.pid").read_text()))
            found += [server, *server.children(recursive=True)]
    return found


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_quickstart_runs_as_written() -> None:
    run = page_blocks("quickstart-cpu")
    stop = page_blocks("quickstart-cpu-stop")
    assert run.count(PORT_LINE) == 1, f"the page must set the port once, as {PORT_LINE!r}"
    port = free_port()
    run = run.replace(PORT_LINE, f"export VLLM_PORT={port}")
    (bound,) = re.findall(r"^BOUND = (\S+)", run, re.MULTILINE)
    assert float(bound) <= FIDELITY

    # A short directory: vLLM's sockets live under it (107 bytes at most per path).
    with tempfile.TemporaryDirectory(prefix="qs-") as tmp:
        root = Path(tmp)
        scratch = root / "tmp"
        scratch.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env |= {
            "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env['PATH']}",
            "TMPDIR": str(scratch),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        log = root / "quickstart.log"
        work = root / "refit-quickstart"
        started: list[psutil.Process] = []
        try:
            run_script(run, root, env, log, timeout=600)
            started = _processes(work)
            # The page's /trainer_refit/ready probes: 503 before the step, 200 after it.
            codes = re.findall(r" HTTP (\d{3})$", log.read_text(), re.MULTILINE)
            assert codes == ["503", "200"], codes
            version, trained, gap = served_and_trained(work, port)
            assert trained >= 1, "the page's step published no version"
            assert version == str(trained), f"serves version {version}, the trainer {trained}"
            assert gap <= float(bound), f"served logprobs differ from Forward by {gap}"
        finally:
            started = started or _processes(work)
            try:
                if work.is_dir():
                    run_script(stop, work, env, log, timeout=180)
            finally:
                left = [p for p in started if _alive(p)]
                for process in left:
                    kill_tree(process)
        assert not left, f"still running after the page's stop: {left}"
        vllm_log = (work / "vllm.log").read_text(errors="replace")
        assert "force killing" not in vllm_log, _tails(log)
        assert not (work / "vllm-tmp").exists()
        assert not list(scratch.iterdir()), f"left in TMPDIR: {list(scratch.iterdir())}"
