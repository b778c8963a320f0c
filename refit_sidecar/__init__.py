"""The refit sidecar: each finished step's weights, published for one-sided NIXL reads.

Control plane: `registry` (versions, slots, leases), `server` and `cli` (gRPC). Data plane and
puller library: `manifest`, `plan` and `checksum` (torch- and NIXL-free), `transport` (the pull
seam, with an in-memory reference), `nixl_transport` and `source` (the two NIXL ends), `arena`
(a source's memory: host, or `tensor_arena` on a device, the one module that imports torch), and
`layout` (shard specs; from megatron_hf's TP placements, imported on demand).
"""
