"""Static facts about the served model, computed once at start-up for GetStatus."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hf.spec import ModelSpec
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import trainer_pb2 as pb
from trainer_svc.config import ParamsDType

_DTYPES = {
    ParamsDType.FLOAT32: common_pb2.DTYPE_FLOAT32,
    ParamsDType.BFLOAT16: common_pb2.DTYPE_BFLOAT16,
}


@dataclass(frozen=True, kw_only=True)
class ServiceInfo:
    spec: ModelSpec
    padded_vocab: int
    num_parameters: int
    params_dtype: ParamsDType
    max_sequence_length: int
    sidecar: str = ""
    refit_snapshot_bytes: int = 0
    pass_token_budget: int = 0
    sequence_layout: str = ""
    reference_policy: str = ""
    reference_placement: str = ""

    def model_info(self) -> pb.ModelInfo:
        spec = self.spec
        return pb.ModelInfo(
            architecture=spec.architecture,
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_query_groups,
            vocab_size=spec.vocab_size,
            padded_vocab_size=self.padded_vocab,
            num_parameters=self.num_parameters,
            params_dtype=_DTYPES[self.params_dtype],
            tied_embeddings=spec.tie_word_embeddings,
            max_sequence_length=self.max_sequence_length,
        )
