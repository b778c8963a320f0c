"""A receiver's pulling end: plans read over NIXL, checked, pipelined, leased."""
