"""A receiver's pulling end: plans read over NIXL, checked, pipelined, leased.

Reading path: `puller.py` (the seam a receiver's fetch goes through: lease, plan, pull, end),
`direct_puller.py` (from the trainer's ranks) and `tree_puller.py` (through the source tree:
`tree_pull.py`, `pipelined.py`), `leasing.py` (leases asked ahead, kept alive, ended), then
the transports (`transport.py`, `nixl_transport.py`, `pending_pull.py`).
"""
