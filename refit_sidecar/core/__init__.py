"""Torch-, NIXL- and gRPC-free records every room below builds on."""
