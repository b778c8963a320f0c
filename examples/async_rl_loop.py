"""Asynchronous GRPO: generation runs one weights version ahead of training, against the
synchronous loop on the same stack.

    python -m examples.async_rl_loop            # both schedules, then their throughput
    python -m examples.async_rl_loop --help

The stack: `trainer-svc`, `refit-sidecar` and one `vllm serve` replica that follows the
trainer by itself (auto-refit: it pulls each new version while it generates and switches
between two scheduler steps). The task and the warm-up are those of `examples.rl_loop`.

Each schedule starts from the same warm-up checkpoint and runs the same GRPO steps; only
when a batch may be sampled differs. Batch k trains in step k; with a lag of L it is sampled
once the replica serves the weights step k-L began with:

- lag 0 (synchronous): batch k waits for step k-1's version to be installed, so sampling and
  training take turns and every token is on-policy;
- lag 1 (asynchronous): batch k is sampled while step k-1 trains, with weights at most one
  version behind the step that trains on it. A completion may cross a refit: the replica
  reports which version sampled which tokens (`weight_versions` spans), and the microbatch
  passes them on (`version_spans`), so the step's staleness bound (`max_staleness` 1, stale
  tokens masked) holds per token and its histogram counts what it trained.

The objective (`--objective`) is PPO's clipped ratio against vLLM's own sampling logprobs
(`behaviour`, the default): the clip is a trust region around the policy that sampled, which
one version of lag needs. `tis` takes the ratio against the step's own weights and corrects
for the sampler with truncated importance sampling, as `examples.rl_loop` does; with one
version of lag at this learning rate it did not learn (BENCHMARKS.md, "Asynchronous GRPO").

The run prints one line per step, then each schedule's trained tokens per second and reward,
and exits non-zero if the reward did not rise in either.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import run_meta
from examples.console import Console
from examples.local_stack import LocalStack, StackConfig
from examples.reverse_task import Prompt, ReverseTask
from examples.rl_loop import Group, grpo_batch, warm_up
from trainer_refit.auth import Role
from trainer_svc.builtin_model import write_builtin_model
from trainer_svc.client import TrainerClient
from trainer_svc.domain import (
    Correction,
    LossConfig,
    LossKind,
    OptimizerOverrides,
    SequenceBatch,
    StaleData,
    StalenessBound,
    VersionSpan,
)

CHECKPOINT = "warm-up"
"""The warm-up's checkpoint, under the trainer's work directory: each schedule starts there."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m examples.async_rl_loop",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workdir", type=Path, help="logs and the model (default: a temp dir)")
    parser.add_argument(
        "--lags",
        type=int,
        nargs="+",
        default=[0, 1],
        help="schedules to run, each from the warm-up checkpoint: how many versions behind "
        "the weights its step begins with a batch may be sampled (0: synchronous)",
    )
    parser.add_argument(
        "--peer-timeout-seconds",
        type=float,
        default=None,
        help="how long the trainer's ranks wait to hear from each other (default: "
        "trainer-svc's); longer on a machine whose cores other programs share",
    )
    parser.add_argument("--warmup-steps", type=int, default=60, help="supervised steps first")
    parser.add_argument("--iterations", type=int, default=24, help="GRPO steps per schedule")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument(
        "--objective",
        choices=[o.value for o in Objective],
        default=Objective.BEHAVIOUR.value,
        help="behaviour: PPO's ratio against vLLM's sampling logprobs; tis: against the step's "
        "own weights, with truncated importance sampling against vLLM's",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-reward-gain", type=float, default=0.05, help="last vs first steps, per schedule"
    )
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    return parser


class Objective(enum.Enum):
    BEHAVIOUR = "behaviour"
    TIS = "tis"

    def loss(self) -> LossConfig:
        if self is Objective.TIS:
            return LossConfig(
                kind=LossKind.PPO,
                clip_low=0.2,
                clip_high=0.2,
                correction=Correction.TIS,
                tis_cap=2.0,
            )
        return LossConfig(kind=LossKind.PPO, clip_low=0.2, clip_high=0.2)

    def inputs(self, batch: SequenceBatch) -> SequenceBatch:
        """`grpo_batch`'s inputs as this objective takes them: with BEHAVIOUR, vLLM's
        sampling logprobs are the behaviour policy's."""
        if self is Objective.TIS:
            return batch
        return dataclasses.replace(
            batch, behaviour_logprobs=batch.sampler_logprobs, sampler_logprobs=None
        )


@dataclass(frozen=True)
class Sampled:
    """One prompt's group, with the weights version spans of each completion."""

    group: Group
    spans: list[list[VersionSpan]]


class Replica:
    """The `vllm serve` replica: its installed version and its token-in generate route."""

    def __init__(self, url: str, task: ReverseTask) -> None:
        self.url, self.task = url, task

    def installed(self) -> int | None:
        with urllib.request.urlopen(f"{self.url}/trainer_refit/status", timeout=30) as reply:
            version = json.load(reply).get("installed_version")
        return None if version is None else int(version)

    def wait_installed(self, version: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (self.installed() or -1) < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replica did not install version {version}")
            time.sleep(0.02)

    def sample(self, prompt: Prompt, n: int, seed: int) -> Sampled:
        body = {
            "token_ids": prompt.tokens,
            "sampling_params": {
                "n": n,
                "temperature": 1.0,
                "max_tokens": 8,
                "logprobs": 0,
                "stop_token_ids": [self.task.eos],
                "seed": seed,
            },
        }
        request = urllib.request.Request(
            f"{self.url}/inference/v1/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            choices = sorted(json.load(reply)["choices"], key=lambda c: c["index"])
        completions = [list(c["token_ids"]) for c in choices]
        logprobs = [[t["logprob"] for t in c["logprobs"]["content"]] for c in choices]
        start = len(prompt.tokens)  # spans count output tokens; the trainer, sequence tokens
        spans = [
            [
                VersionSpan(start + s["start"], start + s["end"], int(s["version"]))
                for s in c["weight_versions"]
            ]
            for c in choices
        ]
        rewards = [self.task.reward(prompt, c) for c in completions]
        return Sampled(Group(prompt, completions, logprobs, rewards), spans)


@dataclass
class Schedule:
    """When batch k may be sampled: once step k-lag has begun and the replica serves the
    weights it began with. Filled in by the training loop, read by the sampler."""

    lag: int
    begun: list[int] = field(default_factory=list)
    """The weights version each step began with, in step order."""
    changed: threading.Condition = field(default_factory=threading.Condition)
    stopped: bool = False

    def begin(self, version: int) -> None:
        with self.changed:
            self.begun.append(version)
            self.changed.notify_all()

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()

    def version_for(self, batch: int) -> int | None:
        """The version batch `batch` must be sampled with at least (None: stopped)."""
        step = max(batch - self.lag, 0)
        with self.changed:
            self.changed.wait_for(lambda: self.stopped or len(self.begun) > step)
            return None if self.stopped else self.begun[step]


@dataclass
class Outcome:
    lag: int
    rewards: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    sampling_s: float = 0.0
    waiting_s: float = 0.0
    """Of the sampler's time: sampling, and waiting for the replica to install a version."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class Sampler(threading.Thread):
    """Samples batch after batch as the schedule allows, each batch's groups concurrently;
    `next_batch` hands them to the training loop in order."""

    def __init__(
        self, replica: Replica, task: ReverseTask, schedule: Schedule, args: argparse.Namespace
    ) -> None:
        super().__init__(name=f"sampler-lag{schedule.lag}", daemon=True)
        self.replica, self.task, self.schedule, self.args = replica, task, schedule, args
        self._batches: list[list[Sampled]] = []
        self._ready = threading.Semaphore(0)
        self._error: BaseException | None = None
        self.waiting_s = 0.0
        """Time spent waiting for the replica to serve the version a batch needs."""
        self.sampling_s = 0.0

    def next_batch(self, k: int) -> list[Sampled]:
        self._ready.acquire()
        if self._error is not None:
            raise RuntimeError("sampling failed") from self._error
        return self._batches[k]

    def run(self) -> None:
        args = self.args
        rng = random.Random(args.seed + 1)
        try:
            with ThreadPoolExecutor(args.concurrency) as pool:
                for k in range(args.iterations):
                    version = self.schedule.version_for(k)
                    if version is None:
                        return
                    began = time.monotonic()
                    self.replica.wait_installed(version)
                    sampled = time.monotonic()
                    self.waiting_s += sampled - began
                    prompts = [self.task.prompt(rng) for _ in range(args.prompts)]
                    seeds = [args.seed + 1000 * k + i for i in range(len(prompts))]
                    groups = pool.map(
                        lambda p, s: self.replica.sample(p, args.group_size, s), prompts, seeds
                    )
                    self._batches.append(list(groups))
                    self.sampling_s += time.monotonic() - sampled
                    self._ready.release()
        except BaseException as error:  # the training loop raises it
            self._error = error
            self._ready.release()


def run_schedule(
    lag: int,
    *,
    trainer: TrainerClient,
    replica: Replica,
    task: ReverseTask,
    args: argparse.Namespace,
    console: Console,
) -> Outcome:
    start = trainer.load_checkpoint(CHECKPOINT).weights_version
    replica.wait_installed(start)
    objective = Objective(args.objective)
    loss = objective.loss()
    bound = StalenessBound(max_versions=1, stale=StaleData.MASK)
    schedule, outcome = Schedule(lag), Outcome(lag)
    sampler = Sampler(replica, task, schedule, args)
    began = time.monotonic()
    version = start
    sampler.start()
    try:
        for k in range(args.iterations):
            step_id = f"lag{lag}-{k}"
            trainer.begin_step(
                step_id, loss, OptimizerOverrides(learning_rate=args.lr), staleness=bound
            )
            schedule.begin(version)
            groups = sampler.next_batch(k)
            sent = 0
            for i, sampled in enumerate(groups):
                batch = grpo_batch(sampled.group, sampled.spans)
                if batch is not None:
                    batch = objective.inputs(batch)
                    trainer.train_microbatch(step_id, f"{step_id}-{i}", batch)
                    outcome.tokens += batch.num_tokens
                    sent += 1
            reward = statistics.fmean(r for s in groups for r in s.group.rewards)
            outcome.rewards.append(reward)
            if sent == 0:
                trainer.abort_step(step_id)
                console.line(f"lag {lag} step {k:<3d} reward {reward:.3f}  (no reward spread)")
                continue
            result = trainer.finish_step(step_id)
            version = result.weights_version
            behind = " ".join(f"{b}:{n}" for b, n in result.metrics.staleness)
            mismatch = result.metrics.terms.sampler
            kl = f"  sampler KL {mismatch.kl:.1e}" if mismatch else ""
            console.line(
                f"lag {lag} step {k:<3d} v{version:<4d} reward {reward:.3f}  "
                f"sequences by versions behind {behind}{kl}"
            )
    finally:
        schedule.stop()
        sampler.join(timeout=600)
    outcome.seconds = time.monotonic() - began
    outcome.waiting_s, outcome.sampling_s = sampler.waiting_s, sampler.sampling_s
    return outcome


def train(args: argparse.Namespace, workdir: Path) -> int:
    model_dir = write_builtin_model(workdir / "model", seed=args.seed)  # the demo's tiny Llama
    from transformers import AutoTokenizer

    task = ReverseTask(AutoTokenizer.from_pretrained(model_dir))
    # Three slots: the version the replica serves, the one it prefetches, the next step's.
    config = StackConfig(
        workdir=workdir,
        model_dir=model_dir,
        seed=args.seed,
        refit_slots=3,
        peer_timeout_s=args.peer_timeout_seconds,
    )
    outcomes = []
    console = Console(sys.stdout, sys.stderr, None)
    with ExitStack() as stack:
        console.line(f"starting trainer-svc, refit-sidecar and vllm serve (logs in {workdir})")
        local = stack.enter_context(LocalStack(config))
        trainer = stack.enter_context(
            TrainerClient(local.trainer_address, auth=local.auth(Role.ORCHESTRATOR))
        )
        trainer.wait_ready()
        replica = Replica(local.serve_vllm(), task)
        warm_up(trainer, task, args, console)
        trainer.save_checkpoint(CHECKPOINT)
        # Until its first refit the replica serves the weights it loaded, which no version
        # names ("default" in its spans).
        replica.wait_installed(trainer.status().weights_version)
        # The replica's first batch takes seconds more than the rest (vLLM's first runs of
        # each batch shape): outside the timed schedules, so it burdens neither.
        rng = random.Random(args.seed - 1)
        with ThreadPoolExecutor(args.concurrency) as pool:
            prompts = [task.prompt(rng) for _ in range(args.prompts)]
            list(pool.map(lambda p: replica.sample(p, args.group_size, 0), prompts))
        for lag in args.lags:
            outcomes.append(
                run_schedule(
                    lag, trainer=trainer, replica=replica, task=task, args=args, console=console
                )
            )
    failed = False
    window = max(1, min(3, args.iterations // 3))
    for outcome in outcomes:
        first = statistics.fmean(outcome.rewards[:window])
        last = statistics.fmean(outcome.rewards[-window:])
        console.line(
            f"lag {outcome.lag}: {outcome.tokens_per_second:.0f} trained tokens/s "
            f"({outcome.tokens} tokens in {outcome.seconds:.1f} s; sampling "
            f"{outcome.sampling_s:.1f} s, waiting for versions {outcome.waiting_s:.1f} s), "
            f"reward {first:.3f} -> {last:.3f}"
        )
        if last < first + args.min_reward_gain:
            console.error(f"FAIL: lag {outcome.lag}: reward did not rise by {args.min_reward_gain}")
            failed = True
    if args.out is not None:
        result = {
            "meta": run_meta("examples.async_rl_loop", args.argv),
            "schedules": [
                {**dataclasses.asdict(o), "tokens_per_second": o.tokens_per_second}
                for o in outcomes
            ],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if len(outcomes) > 1 and outcomes[0].tokens_per_second:
        ratio = outcomes[-1].tokens_per_second / outcomes[0].tokens_per_second
        console.line(
            f"lag {outcomes[-1].lag} over lag {outcomes[0].lag}: {ratio:.2f}x trained tokens/s"
        )
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trainer-refit-async-"))
    workdir.mkdir(parents=True, exist_ok=True)
    return train(args, workdir)


if __name__ == "__main__":
    sys.exit(main())
