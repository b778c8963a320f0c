"""Drive refit on a whole `vllm.LLM` whose workers carry `RefitWorkerExtension`.

`RefitEngine.refit_to` runs the extension's `refit_to` on every worker (they agree among
themselves, so the engine switches as a whole or not at all), raises `RefitError` when the
engine stayed on its old version, and then drops the prefix cache: KV blocks computed with the
old weights must not be reused for new requests.

`probe` is the fidelity check: vLLM's own logprob of every prompt token after the first,
computed by the engine's normal scheduling path (prompt logprobs), so it measures exactly what
rollouts see. A worker cannot run such a pass on its own without the scheduler's KV cache.

`shutdown` stops the engine so that each of its processes exits on its own: nothing killed,
no shared memory left behind.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from inference_ext.refit_options import RefitError, RefitOptions, RefitStats
from refit_sidecar.core.manifest import Box

EXTENSION = "inference_ext.RefitWorkerExtension"

log = logging.getLogger(__name__)

ENGINE_STOP_TIMEOUT_S = 60.0
"""How long `RefitEngine.shutdown` lets an engine's processes take to exit on their own."""


@dataclass(frozen=True)
class EngineRefit:
    version: int
    workers: tuple[RefitStats, ...]
    """Per worker, in TP-rank order."""

    @property
    def bytes_pulled(self) -> int:
        return sum(w.bytes_pulled for w in self.workers)

    @property
    def seconds(self) -> float:
        """Wall time of the slowest worker (workers run in parallel)."""
        return max(
            (w.plan_s + w.pull_s + w.translate_s + w.install_s for w in self.workers), default=0.0
        )


class RefitEngine:
    """Wraps an engine built with ``worker_extension_cls=EXTENSION``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def refit_init(self, sidecar: str, options: RefitOptions | None = None) -> None:
        opts = options.to_dict() if options is not None else None
        self.llm.collective_rpc("refit_init", args=(sidecar, opts))

    def refit_to(self, version: int | None = None) -> EngineRefit:
        replies: list[dict[str, Any]] = self.llm.collective_rpc("refit_to", args=(version,))
        failures = [r["error"] for r in replies if not r["ok"]]
        if failures:
            raise RefitError(failures[0])
        self.llm.reset_prefix_cache()
        stats = tuple(RefitStats(**{k: v for k, v in r.items() if k != "ok"}) for r in replies)
        return EngineRefit(stats[0].version, tuple(sorted(stats, key=lambda s: s.tp_rank)))

    def installed_version(self) -> int | None:
        replies = self.llm.collective_rpc("refit_status")
        versions = {r["installed_version"] for r in replies}
        if len(versions) != 1:
            raise RefitError(f"workers serve different versions: {sorted(map(str, versions))}")
        return versions.pop()

    def slices(
        self, names: Sequence[str] | None = None
    ) -> list[dict[str, tuple[Box, torch.Tensor]]]:
        """Per worker (TP-rank order): HF name -> (box, tensor) of what it installed last."""
        replies = self.llm.collective_rpc("refit_slices", args=(names,))
        return [{name: decode_slice(s) for name, s in reply.items()} for reply in replies]

    def probe(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """vLLM's logprob of token i given tokens < i, for i >= 1, of each prompt."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        result = []
        for prompt, output in zip(prompts, outputs, strict=True):
            per_token = output.prompt_logprobs[1:]
            result.append([per_token[i][tok].logprob for i, tok in enumerate(prompt[1:])])
        return result

    def probe_routing(
        self, prompts: Sequence[Sequence[int]]
    ) -> list[tuple[list[float], np.ndarray]]:
        """`probe`'s logprobs of each prompt with the experts vLLM routed its tokens to in
        every MoE layer, ``[len(prompt), layers, top_k]`` (a prompt's last token included, as
        vLLM reports routing): what the trainer replays (``routed_experts``). Prompts run one
        at a time, so each forward's routing is one prompt's."""
        self.llm.collective_rpc("refit_capture_routing", args=(True,))
        try:
            out = []
            for prompt in prompts:
                logprobs = self.probe([prompt])[0]
                reply = self.llm.collective_rpc("refit_routed_experts")[0]  # TP ranks agree
                routed = np.frombuffer(reply["data"], np.int64).reshape(reply["shape"])
                if routed.shape[0] != len(prompt):
                    raise RefitError(
                        f"captured routing of {routed.shape[0]} tokens for a prompt of "
                        f"{len(prompt)} (was the engine serving other requests?)"
                    )
                out.append((logprobs, routed.copy()))
            return out
        finally:
            self.llm.collective_rpc("refit_capture_routing", args=(False,))

    def close(self) -> None:
        """Every worker drops its receiver: its registered memory, NIXL agent and channel to
        the sidecar. The engine keeps serving the weights it has."""
        self.llm.collective_rpc("refit_close")

    def shutdown(self, *, release: bool = True, timeout_s: float = ENGINE_STOP_TIMEOUT_S) -> None:
        """Stop the engine's processes (a multiprocessing engine's core and its workers).

        With `release`, the workers `close` their receivers first, so they exit promptly and
        in order; leave it off when the engine's processes may be gone already (after a
        Ctrl-C they got the signal too): that call is an RPC to them. `timeout_s` is how long
        the engine core gets to stop its workers and exit before vLLM kills it and them; vLLM's
        default of 5 s is too short on a busy host, and a killed engine core leaves its shared
        memory for the resource tracker to reclaim (and warn about).
        """
        try:
            if release:
                self.close()
        except Exception as e:  # a dead engine cannot release: stop what is left of it
            log.warning("releasing the engine's receivers failed: %s", e)
        finally:
            self.llm.llm_engine.engine_core.shutdown(timeout=timeout_s)


def decode_slice(encoded: dict[str, Any]) -> tuple[Box, torch.Tensor]:
    """Inverse of `worker.encode_slice`."""
    dtype = getattr(torch, encoded["dtype"])
    raw = torch.frombuffer(bytearray(encoded["data"]), dtype=torch.uint8)
    box = Box(tuple(tuple(r) for r in encoded["box"]))
    return box, raw.view(dtype).reshape(encoded["shape"])
