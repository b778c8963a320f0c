"""A short end-to-end session: start trainer-svc (TP=2 on local ranks), stream a supervised
copying task to it over gRPC with the split step, and show the loss fall.

    python -m trainer_svc.demo --steps 30

Exits non-zero when the loss did not fall. Every process it started is stopped on exit,
Ctrl-C included.
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm
from transformers import AutoTokenizer

from trainer_svc.builtin_model import write_builtin_model
from trainer_svc.client import TrainerClient
from trainer_svc.domain import LossConfig, OptimizerOverrides, SequenceBatch

ALPHABET = "abcdefghij"


def copying_batch(tokenizer, rng: random.Random, size: int) -> SequenceBatch:
    """Sequences "<s>xyz>xyz</s>": the loss covers the copy after '>'."""
    sequences, masks = [], []
    for _ in range(size):
        word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 6)))
        prompt = [tokenizer.bos_token_id, *tokenizer.encode(word + ">", add_special_tokens=False)]
        answer = [*tokenizer.encode(word, add_special_tokens=False), tokenizer.eos_token_id]
        sequences.append(prompt + answer)
        masks.append([False] * len(prompt) + [True] * len(answer))
    return SequenceBatch.from_lists(sequences, loss_mask=masks)


def start_trainer(workdir: Path, model_dir: Path, tp: int) -> tuple[subprocess.Popen, str]:
    port_file = workdir / "port"
    log = (workdir / "trainer.log").open("wb")
    command = [sys.executable, "-m", "trainer_svc", "--model", str(model_dir), "--tp", str(tp)]
    command += ["--port", "0", "--host", "127.0.0.1", "--port-file", str(port_file)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    with tqdm(desc="starting trainer ranks", bar_format="{desc}: {elapsed}") as bar:
        while not port_file.exists():
            if process.poll() is not None:
                raise SystemExit(f"trainer-svc exited early; see {workdir / 'trainer.log'}")
            time.sleep(0.2)
            bar.update()
    return process, f"127.0.0.1:{port_file.read_text()}"


def stop_trainer(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def run(args: argparse.Namespace, workdir: Path) -> int:
    model_dir = write_builtin_model(workdir / "model", seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    process, target = start_trainer(workdir, model_dir, args.tp)
    try:
        with TrainerClient(target) as trainer:
            trainer.wait_ready()
            status = trainer.status()
            print(
                f"trainer ready at {target}: {status.model.architecture}, "
                f"{status.model.num_parameters:,} parameters, TP={status.layout.tensor_parallel}"
            )
            rng = random.Random(args.seed)
            loss_config = LossConfig()
            optimizer = OptimizerOverrides(learning_rate=args.lr)
            losses = []
            for step in tqdm(range(args.steps), desc="training", unit="step"):
                step_id = f"step-{step}"
                trainer.begin_step(step_id, loss_config, optimizer)
                for micro in range(args.microbatches):
                    batch = copying_batch(tokenizer, rng, args.batch_size)
                    trainer.train_microbatch(step_id, f"{step_id}-mb{micro}", batch)
                result = trainer.finish_step(step_id)
                losses.append(result.metrics.loss)
                tqdm.write(
                    f"version {result.weights_version:3d}  loss {result.metrics.loss:.4f}  "
                    f"grad-norm {result.metrics.grad_norm:.3f}  "
                    f"tokens {result.metrics.counts.valid_tokens}"
                )
    finally:
        stop_trainer(process)
    head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"loss {head:.4f} -> {tail:.4f} over {args.steps} steps")
    if tail >= head * 0.9:
        print("the loss did not fall: something is wrong", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per step")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per microbatch")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 6:
        parser.error("--steps must be at least 6 to compare the first and last losses")
    with tempfile.TemporaryDirectory(prefix="trainer-refit-demo-") as workdir:
        try:
            sys.exit(run(args, Path(workdir)))
        except KeyboardInterrupt:
            print("interrupted; trainer stopped", file=sys.stderr)
            sys.exit(130)


if __name__ == "__main__":
    main()
