"""The Megatron side of the service: what every rank runs (model, step engine, command loop)."""
