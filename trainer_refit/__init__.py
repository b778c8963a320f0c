"""Python stubs generated from ``protos/`` (the wire contract). Regenerate with ``make protos``.

Nothing here is written by hand except this file and ``codegen.py``; a test fails when the
committed stubs differ from what the .proto files generate.
"""
