"""The gRPC edge: proto <-> domain conversion, the servicer, and server assembly."""
