"""The vLLM side of refit: `RefitWorkerExtension` (load it with
``worker_extension_cls="inference_ext.RefitWorkerExtension"``) pulls the slices of each
published version its worker needs, translates them to HF names and installs them in place.

`receiver` does the engine-agnostic work (plan, pull, verify, assemble), `slices` says what a
vLLM TP rank keeps of each HF tensor, `translate` where that lives in the Megatron tensors, and
`engine` drives a whole `vllm.LLM` (refit every worker atomically, probe logprobs).
"""

from typing import Any

__all__ = ["RefitWorkerExtension"]


def __getattr__(name: str) -> Any:
    # vLLM resolves the extension by qualified name; importing it lazily keeps the pure
    # modules (slices, translate) importable without vLLM's worker machinery.
    if name == "RefitWorkerExtension":
        from inference_ext.worker import RefitWorkerExtension

        return RefitWorkerExtension
    raise AttributeError(f"module 'inference_ext' has no attribute {name!r}")
