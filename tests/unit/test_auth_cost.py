"""`python -m benchmarks.auth_cost` runs (a few calls per mode): every mode answers and the
table it prints has each mode and the split between client and server."""

from __future__ import annotations

import pytest

from benchmarks.auth_cost import measure


def test_the_auth_cost_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    medians = measure(calls=5, blocks=2)
    assert set(medians) == {"auth", "token-only", "insecure"}
    assert all(m > 0 for m in medians.values())
    out = capsys.readouterr().out
    assert "auth adds" in out and "client interceptor" in out and "server interceptor" in out
