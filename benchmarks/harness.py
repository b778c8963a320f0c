"""What the benchmarks share: the results file's metadata, a child process's environment, the
deployed configuration (tokens, the trainer's path root) and a trainer server to measure."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from trainer_refit.auth import ClientAuth, TokenDir
from trainer_svc.client import TrainerClient

REPO = Path(__file__).resolve().parents[1]
_PACKAGES = (
    "torch",
    "transformers",
    "megatron-core",
    "nixl",
    "nixl-cu13",
    "nixl-cu12",
    "grpcio",
    "protobuf",
    "numpy",
)


def versions() -> dict[str, str]:
    """The interpreter's and the measured packages' versions ("-" where not installed)."""
    out = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "-"
    return out


def run_meta(module: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """The part of every results file's metadata that says when, with which command and which
    versions it was measured; each benchmark adds its own configuration."""
    args = sys.argv[1:] if argv is None else list(argv)
    return dict(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        command=" ".join([os.path.basename(sys.executable), "-m", module, *args]),
        versions=versions(),
        transport_env={k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
    )


def child_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# -- the deployed configuration: tokens and the trainer's path root -------------------------------


def tokens_for(work: Path) -> TokenDir:
    """Authentication as deployed, set up as ``examples.local_stack`` does: fresh random
    bearer tokens for every role in ``<work>/tokens`` that both services read; each client
    presents its own role's token."""
    return TokenDir.create(work / "tokens")


def trainer_root(work: Path) -> Path:
    """The trainer's ``--work-dir`` and so its path root: whatever it saves or exports lies
    below it, apart from the token files and the run's other files (as in local_stack)."""
    root = work / "trainer"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def served_process(
    name: str,
    module_args: Sequence[str],
    port_file: Path,
    log_path: Path,
    *,
    timeout_s: float,
    stop_timeout_s: float,
) -> Iterator[tuple[str, float]]:
    """Starts ``python -m MODULE_ARGS --host 127.0.0.1 --port 0 --port-file PORT_FILE`` in a
    session of its own, logging to `log_path`; yields (HOST:PORT, its `time.perf_counter()` at
    the start) once the port file is written. On exit: SIGTERM, then SIGKILL to the whole
    session after `stop_timeout_s`."""
    port_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", *module_args, "--host", "127.0.0.1", "--port", "0"]
    started = time.perf_counter()
    out = log_path.open("ab")
    process = subprocess.Popen(
        [*command, "--port-file", str(port_file)],
        cwd=REPO,
        env=child_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = started + timeout_s
        while not port_file.exists():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{tail(log_path)}")
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{name} did not serve within {timeout_s} s")
            time.sleep(0.05)
        yield f"127.0.0.1:{int(port_file.read_text())}", started
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # a clean stop: the trainer stops its ranks
        try:
            process.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the session of the process we started
            process.wait()
        out.close()


@contextlib.contextmanager
def trainer_server(
    plan: dict[str, Any], run_dir: Path, log_path: Path, *, auth: ClientAuth
) -> Iterator[tuple[str, float]]:
    """Starts ``python -m trainer_svc`` on a free port (its authentication flags are in
    plan["trainer_args"]); yields (target, seconds to SERVING) once it answers a client of
    `auth`."""
    with served_process(
        "trainer-svc",
        ["trainer_svc", *plan["trainer_args"]],
        run_dir / "port",
        log_path,
        timeout_s=plan["timeout_s"],
        stop_timeout_s=90,
    ) as (target, started):
        with TrainerClient(target, auth=auth) as client:
            client.wait_ready(timeout=60.0)
        yield target, time.perf_counter() - started


@contextlib.contextmanager
def sidecar_server(
    run_dir: Path,
    log_path: Path,
    timeout_s: float,
    tokens: TokenDir,
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """Starts ``python -m refit_sidecar`` on a free port, accepting `tokens` (and given
    `extra_args`); yields its HOST:PORT."""
    with served_process(
        "refit-sidecar",
        ["refit_sidecar", *tokens.server_args(), *extra_args],
        run_dir / "sidecar-port",
        log_path,
        timeout_s=timeout_s,
        stop_timeout_s=60,
    ) as (target, _):
        yield target
