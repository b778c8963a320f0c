"""The wire: Python stubs generated from ``protos/`` (regenerate with ``make protos``) and the
gRPC serving plumbing both services share (``serving.py``).

Only ``v1/`` is generated; a test fails when the committed stubs differ from what the .proto
files generate.
"""
