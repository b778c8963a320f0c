"""vLLM's ``vllm.general_plugins`` entry point (declared in pyproject.toml): registers the
`trainer_refit` weight-transfer backend by module path, so the backend's module (and NIXL)
is imported only by engines configured to use it. On a CPU platform it also lets vLLM's MoE
experts kernel take expert parallelism's map (`cpu_expert_map`).

vLLM runs general plugins in each of its processes, once per process; `register` may run again
(an ``LLM`` built after another in the same process) and then does nothing.
"""

from __future__ import annotations

import contextlib

BACKEND = "trainer_refit"
"""The name in ``--weight-transfer-config '{"backend": "trainer_refit"}'``."""


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.platforms import current_platform

    with contextlib.suppress(ValueError):  # registered already in this process
        WeightTransferEngineFactory.register_engine(
            BACKEND, "inference_ext.transfer_backend", "TrainerRefitEngine"
        )
    if current_platform.is_cpu():
        from inference_ext import cpu_expert_map

        cpu_expert_map.install()
