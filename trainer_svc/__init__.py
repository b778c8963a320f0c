"""trainer_svc: a Megatron-core trainer served over gRPC with a split training step."""
