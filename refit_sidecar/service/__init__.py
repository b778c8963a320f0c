"""The sidecar process (registry, source tree, gRPC edge) and its typed client."""
