"""The main job, shortened: `python -m examples.rl_loop` brings up the whole stack (trainer
TP=2, sidecar, vLLM engines TP=1 and TP=2), learns, keeps every engine within 1e-4 of the
trainer, and leaves no process behind (interrupted with Ctrl-C too: `test_demo_interrupt`).
Its terminal shows progress bars, the version lines and the summary only; vLLM's logs go to the
file it names (with --verbose, to the terminal).

The short run is shared by the tests that read it (it takes minutes on 2 cores)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from megatron_hf.tiny import write_tiny_checkpoint
from refit_sidecar.pull import shared_word as progress_file
from tests.demo.demo_process import VERSION_LINE, start, wait_gone

SHORT_RUN = ["--iterations", "24"]


def _demo_model(directory: Path) -> Path:
    """The demo's own tiny model (its defaults, seed 0) with tied embeddings (the fidelity
    tests cover untied models), written here and given with --model; the interrupted run
    covers the model the demo writes itself."""
    return write_tiny_checkpoint(
        directory,
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        tie_word_embeddings=True,
    )


SUMMARY_LINE = re.compile(r"reward ([0-9.]+) -> ([0-9.]+) .* largest fidelity gap ([0-9.e+-]+)")

LOG_LINE = re.compile(r"^vLLM logs: (.+?); ", re.MULTILINE)
TERMINAL_LINES = [
    LOG_LINE,
    re.compile(r"^starting trainer-svc \(TP=\d+, PP=\d+\) and refit-sidecar$"),
    re.compile(r"^[\w() -]+: +\d+%\|[^|]*\| \d+/\d+ \[[^\]]*\]$"),  # a progress bar
    re.compile(r"^v\d+ +warm-up done +refit .* gap \S+$"),
    VERSION_LINE,
    re.compile(r"^reward [0-9.]+ +\(no reward spread in any group: no step\)$"),
    SUMMARY_LINE,
]
"""Every line the demo may show on a run that passes; vLLM's output is not among them."""


def _unexpected_lines(output: str) -> list[str]:
    """Terminal lines (split at line feeds and tqdm's carriage returns, its cursor-up codes
    dropped) that are none of `TERMINAL_LINES`."""
    lines = (line.strip() for line in re.split(r"[\r\n]", output.replace("\x1b[A", "")))
    return [
        line
        for line in lines
        if line and not any(pattern.search(line) for pattern in TERMINAL_LINES)
    ]


@dataclass(frozen=True)
class DemoRun:
    returncode: int
    output: str
    """The terminal: stdout and stderr together."""
    workdir: Path
    leftovers: list[str]
    progress_files: list[str]
    """Receivers' progress files made during the run and still there after it."""


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoRun]:
    workdir = tmp_path_factory.mktemp("demo") / "run"
    before = _progress_files()
    model = _demo_model(tmp_path_factory.mktemp("demo-model"))
    process, log_path = start(workdir, *SHORT_RUN, "--model", str(model))
    members: set[int] = set()
    done = threading.Event()
    watcher = threading.Thread(target=_session_members, args=(process.pid, members, done))
    watcher.start()
    try:
        returncode = process.wait(timeout=1500)
    finally:
        done.set()
        watcher.join()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    leftovers = wait_gone(process, workdir)  # the run's last messages are written by then
    # Only the demo's own processes' files count: the default run's other worker runs test
    # modules beside it whose receivers, some killed on purpose, leave files of their own.
    left = sorted(name for name in _progress_files() - before if _pid_of(name) in members)
    yield DemoRun(returncode, log_path.read_text(), workdir, leftovers, left)


def _session_members(session: int, members: set[int], done: threading.Event) -> None:
    """Adds the pids of the demo's session (it starts one of its own) to `members`, looking
    every 0.2 s until `done`: every receiver lives for many of those."""
    while not done.wait(0.2):
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(proc.pid) == session:
                    members.add(proc.pid)


def _pid_of(name: str) -> int | None:
    """The pid a progress file's name holds."""
    match = progress_file.NAME.fullmatch(name)
    return None if match is None else int(match[2])


def _progress_files() -> set[str]:
    """The serving receivers' progress files on this host (`refit_sidecar.pull.shared_word`)."""
    directory = Path(progress_file.DEFAULT_DIR)
    if not directory.is_dir():
        return set()
    return {p.name for p in directory.iterdir() if progress_file.NAME.fullmatch(p.name)}


def test_short_demo_learns_keeps_fidelity_and_cleans_up(short_run: DemoRun) -> None:
    output = short_run.output
    assert short_run.returncode == 0, output[-4000:]
    versions = VERSION_LINE.findall(output)
    assert len(versions) >= 4, output[-4000:]
    # The engine that refits second reads each version from the first engine's copy (and, when
    # that copy falls behind on a loaded machine, some pieces from the trainer).
    assert re.search(r"tp1 [^|]* from trainer \| tp2 [^|]* from engine-tp1[ +]", output)
    assert all(
        re.search(r"\| tp2 [^|]* from engine-tp1[ +]", line)
        for line in output.splitlines()
        if VERSION_LINE.match(line)
    ), output[-4000:]
    assert all(float(gap) <= 1e-4 for _, _, gap in versions)
    # GRPO runs with TIS against vLLM's logprobs; vLLM samples what the trainer computes, so
    # the KL between them is tiny and reported on every version's line.
    kls = [float(m[1]) for m in re.finditer(r"sampler KL ([0-9.e+-]+)", output)]
    assert len(kls) == len(versions) and all(0 <= kl <= 1e-4 for kl in kls), kls
    summary = SUMMARY_LINE.search(output)
    assert summary is not None, output[-2000:]
    assert float(summary[2]) >= float(summary[1]) + 0.05
    assert float(summary[3]) <= 1e-4
    assert short_run.leftovers == []
    assert short_run.progress_files == []  # each engine's receivers removed theirs


def test_short_demo_terminal_shows_only_progress_versions_and_summary(short_run: DemoRun) -> None:
    assert _unexpected_lines(short_run.output)[:20] == []
    assert len(LOG_LINE.findall(short_run.output)) == 1


def test_short_demo_vllm_logs_are_in_the_printed_file(short_run: DemoRun) -> None:
    printed = LOG_LINE.search(short_run.output)
    assert printed is not None, short_run.output[:2000]
    log_path = Path(printed[1])
    assert log_path == short_run.workdir / "vllm.log"
    log = log_path.read_text()
    # This process's vLLM, each engine's core and the workers of both engines.
    for source in ("(MainProcess pid=", "(EngineCore pid=", "(Worker pid=", "(Worker_TP1 pid="):
        assert source in log, f"no {source} lines in {log_path}"
    assert "Traceback" not in log


@pytest.mark.slow
def test_the_mixture_of_experts_demo_trains_with_routing_replay(tmp_path: Path) -> None:
    """`--model-family qwen3-moe`: the trainer deals the experts over its two sequence-parallel
    TP ranks, the engine reports the routing of every sample and the trainer replays it
    (routing of the wrong shape would be refused and fail the run); the engine keeps within
    1e-4 of the trainer through every refit. Slow: the default run covers its parts (the
    routing of each sample, `test_routing_replay_vllm`; its way into the batch,
    `test_demo_arguments`; the refit of experts, the fidelity matrix)."""
    workdir = tmp_path / "run"
    args = ["--model-family", "qwen3-moe", "--trainer-ep", "2", "--engine-tp", "1"]
    args += ["--warmup-steps", "10", "--iterations", "3", "--min-reward-gain", "-1"]
    process, log_path = start(workdir, *args)
    try:
        returncode = process.wait(timeout=900)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = log_path.read_text()
    assert returncode == 0, output[-4000:]
    assert "starting trainer-svc (TP=2, PP=1, EP=2) and refit-sidecar" in output
    assert "routing replay: the trainer routes each sampled token as its engine did" in output
    versions = VERSION_LINE.findall(output)
    assert versions, output[-4000:]
    assert all(float(gap) <= 1e-4 for _, _, gap in versions)
    assert not wait_gone(process, workdir)
