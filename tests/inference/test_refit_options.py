"""`RefitOptions` travel as JSON (collective_rpc, vLLM's --additional-config): a misspelt
key or a timeout that is not a positive number fails when the options are read, naming it.
(Their authentication settings: tests/security/test_auth_config.py.)"""

from __future__ import annotations

import pytest

from inference_ext.refit_options import ReceiverAuth, RefitOptions


def test_refit_options_from_dict() -> None:
    token = {"token_file": "/run/tokens/receiver"}
    assert RefitOptions.from_dict(token) == RefitOptions(
        auth=ReceiverAuth(token_file="/run/tokens/receiver")
    )
    options = RefitOptions.from_dict(
        {"receiver_id": "r", "pull_timeout_s": 5, "verify_checksums": False, **token}
    )
    assert (options.receiver_id, options.pull_timeout_s, options.verify_checksums) == (
        "r",
        5,
        False,
    )
    assert RefitOptions.from_dict(options.to_dict()) == options


def test_refit_options_reject_unknown_keys_naming_the_known_ones() -> None:
    known = sorted(RefitOptions.json_keys())
    with pytest.raises(ValueError) as error:
        RefitOptions.from_dict({"pull_timeout": 5, "sidecar": "x:1", "receiver_id": "r"})
    assert str(error.value) == f"unknown refit options ['pull_timeout', 'sidecar']; known: {known}"


@pytest.mark.parametrize(
    "field", ["lease_ttl_s", "pull_timeout_s", "connect_timeout_s", "rpc_timeout_s"]
)
@pytest.mark.parametrize("value", [0, -1.5, float("nan"), float("inf"), "30", None, True])
def test_refit_options_reject_bad_timeouts(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be a positive number of seconds, got"):
        RefitOptions.from_dict({field: value})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"receiver_id": ""}, "^receiver_id must be a non-empty string"),
        ({"receiver_id": 3}, "^receiver_id must be a non-empty string"),
        ({"verify_checksums": "no"}, "^verify_checksums must be true or false, got 'no'"),
        ({"chunk_bytes": 1024}, "^chunk_bytes must be at least 4096"),
        ({"chunk_taper": -1}, "^chunk_taper must be an integer from 0 to 8, got -1"),
        ({"chunk_taper": "2"}, "^chunk_taper must be an integer from 0 to 8, got '2'"),
        ({"chunk_bytes": 8192, "chunk_taper": 2}, "^chunk_bytes 8192 halved 2 times is under"),
        ({"trace_pull": 1}, "^trace_pull must be true or false, got 1"),
        ({"check_part_bytes": 0}, "^check_part_bytes must be a positive integer, got 0"),
        ({"check_part_bytes": 1.5}, "^check_part_bytes must be a positive integer, got 1.5"),
        ({"progress_dir": "shm"}, "^progress_dir must be an absolute path or empty, got 'shm'"),
        ({"progress_dir": None}, "^progress_dir must be an absolute path or empty, got None"),
    ],
)
def test_refit_options_reject_bad_values(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RefitOptions.from_dict(values)
