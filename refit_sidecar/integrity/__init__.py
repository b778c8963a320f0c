"""Checksums: CRC-32 and WSUM-64 (the specification and the device kernels)."""
