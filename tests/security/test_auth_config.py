"""Authentication settings: every RPC of both services is in its access table, the configs
refuse contradictory or incomplete settings, and both CLIs refuse to start without a token
directory or an explicit --insecure (exit 2, naming both flags)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from inference_ext.refit_options import ReceiverAuth, RefitOptions
from refit_sidecar.service import access as sidecar_access
from refit_sidecar.service.cli import parse_config as parse_sidecar
from trainer_refit.auth import ClientAuth, Role, ServerAuth, method_roles, write_token_dir
from trainer_svc.cli import parse_config as parse_trainer
from trainer_svc.server import access as trainer_access

TABLES = {
    "TrainerService": (trainer_access.SERVICE, trainer_access.METHOD_ROLES),
    "RefitService": (sidecar_access.SERVICE, sidecar_access.METHOD_ROLES),
}


@pytest.mark.parametrize("service", sorted(TABLES))
def test_every_rpc_of_the_service_is_in_its_access_table(service: str) -> None:
    descriptor, table = TABLES[service]
    methods = {f"/{descriptor.full_name}/{m.name}" for m in descriptor.methods}
    assert set(table) == methods
    assert all(table[m] for m in methods), "a listed method allows no role"


def test_the_tables_give_each_role_its_rpcs() -> None:
    def allowed(role: Role, table: dict) -> set[str]:
        return {m.rsplit("/", 1)[1] for m, roles in table.items() if role in roles}

    sidecar = dict(sidecar_access.METHOD_ROLES)
    assert allowed(Role.TRAINER, sidecar) == {
        "RegisterTrainer",
        "RenewRegistration",
        "ReserveSlot",
        "PublishShards",
    }
    assert allowed(Role.RECEIVER, sidecar) == {
        "GetLatestVersion",
        "WatchVersions",
        "GetManifest",
        "GetChecksums",
        "AcquireLease",
        "RenewLease",
        "ReleaseLease",
        "GetSources",
        "ReleaseSources",
        "ListTree",
    }
    assert set(trainer_access.METHOD_ROLES.values()) == {frozenset({Role.ORCHESTRATOR})}


def test_a_table_naming_an_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match=r"RefitService has no methods \['Reboot'\]"):
        method_roles(sidecar_access.SERVICE, {"Reboot": [Role.TRAINER]})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs a token directory .* or insecure mode explicitly"),
        ({"token_dir": Path("t"), "insecure": True}, "token_dir=t, insecure=True"),
        ({"insecure": True, "tls_cert": Path("c")}, "both a certificate and its key"),
        ({"insecure": True, "tls_client_ca": Path("ca")}, "a client CA .* needs TLS"),
    ],
)
def test_server_auth_refuses_incomplete_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerAuth(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs its role's token file, or insecure mode explicitly"),
        ({"token_file": Path("t"), "insecure": True}, "token_file=t, insecure=True"),
        ({"insecure": True, "tls_ca": Path("ca"), "tls_cert": Path("c")}, "needs its key"),
        ({"insecure": True, "tls_cert": Path("c"), "tls_key": Path("k")}, "needs TLS"),
    ],
)
def test_client_auth_refuses_incomplete_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClientAuth(**kwargs)


def test_write_token_dir_keeps_tokens_private(tmp_path: Path) -> None:
    directory = write_token_dir(tmp_path / "tokens")
    assert directory.stat().st_mode & 0o777 == 0o700
    tokens = set()
    for role in Role:
        path = directory / role.value
        assert path.stat().st_mode & 0o777 == 0o600
        tokens.add(path.read_text().strip())
    assert len(tokens) == 3 and all(len(t) >= 32 for t in tokens)


# -- the command lines ------------------------------------------------------------------------

MISSING = "pass --auth-token-dir DIR .* or --insecure to accept every caller"


@pytest.mark.parametrize("module", ["refit_sidecar", "trainer_svc"])
def test_starting_without_a_token_dir_or_insecure_exits_2(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "--auth-token-dir" in result.stderr and "--insecure" in result.stderr


@pytest.fixture
def token_dir(tmp_path: Path) -> Path:
    return write_token_dir(tmp_path / "tokens")


def test_the_flags_map_to_the_configs(token_dir: Path, tmp_path: Path) -> None:
    tls = [f"--tls-{name}" for name in ("cert", "key", "client-ca")]
    for flag in tls:
        (tmp_path / flag).write_text("pem")
    tls_args = [a for flag in tls for a in (flag, str(tmp_path / flag))]
    config, _ = parse_sidecar(["--auth-token-dir", str(token_dir), *tls_args])
    assert config.auth == ServerAuth(
        token_dir=token_dir,
        tls_cert=tmp_path / "--tls-cert",
        tls_key=tmp_path / "--tls-key",
        tls_client_ca=tmp_path / "--tls-client-ca",
    )
    trainer, _ = parse_trainer(
        [
            *("--auth-token-dir", str(token_dir), "--sidecar", "h:1"),
            *("--sidecar-token-file", str(token_dir / "trainer")),
            *("--sidecar-tls-ca", str(tmp_path / "--tls-client-ca")),
            *("--sidecar-tls-cert", str(tmp_path / "--tls-cert")),
            *("--sidecar-tls-key", str(tmp_path / "--tls-key")),
        ]
    )
    assert trainer.server.auth == ServerAuth(token_dir=token_dir)
    assert trainer.refit.auth == ClientAuth(
        token_file=token_dir / "trainer",
        tls_ca=tmp_path / "--tls-client-ca",
        tls_cert=tmp_path / "--tls-cert",
        tls_key=tmp_path / "--tls-key",
    )
    insecure, _ = parse_trainer(["--insecure", "--sidecar", "h:1"])
    assert insecure.server.auth == ServerAuth(insecure=True)
    assert insecure.refit.auth == ClientAuth(insecure=True)


def _usage_error(parse: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("parse", [parse_sidecar, parse_trainer], ids=["sidecar", "trainer"])
def test_contradictory_or_incomplete_server_flags_are_usage_errors(
    parse: Any, token_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        ([], MISSING),
        (["--auth-token-dir", str(token_dir), "--insecure"], "exclude each other"),
        (["--insecure", "--tls-cert", "c"], "--tls-cert and --tls-key go together"),
        (["--insecure", "--tls-client-ca", "ca"], "--tls-client-ca needs --tls-cert"),
        (["--insecure", "--tls-cert", "c", "--tls-key", "k"], "TLS file c does not exist"),
        (["--auth-token-dir", str(tmp_path / "none")], "token directory .*none does not exist"),
    ]
    for argv, message in cases:
        err = _usage_error(parse, argv, capsys)
        assert re.search(message, err), (argv, err)


def test_a_token_dir_without_a_token_the_service_needs_is_a_usage_error(
    token_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (token_dir / "receiver").unlink()  # the sidecar needs it; the trainer does not
    err = _usage_error(parse_sidecar, ["--auth-token-dir", str(token_dir)], capsys)
    assert re.search(r"receiver: No such file or directory: .*tokens/receiver", err)
    config, _ = parse_trainer(["--auth-token-dir", str(token_dir)])
    assert config.server.auth == ServerAuth(token_dir=token_dir)
    (token_dir / "orchestrator").write_text("two words\n")
    err = _usage_error(parse_trainer, ["--auth-token-dir", str(token_dir)], capsys)
    assert "orchestrator: line 1 of token file" in err and "other than printable ASCII" in err


def test_the_trainer_needs_the_sidecar_token_unless_insecure(
    token_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--auth-token-dir", str(token_dir)]
    err = _usage_error(parse_trainer, [*base, "--sidecar", "h:1"], capsys)
    assert "--sidecar needs --sidecar-token-file FILE" in err
    err = _usage_error(parse_trainer, [*base, "--sidecar-token-file", "t"], capsys)
    assert "--sidecar-token-file without --sidecar" in err
    missing = ["--sidecar", "h:1", "--sidecar-token-file", str(token_dir / "nope")]
    err = _usage_error(parse_trainer, [*base, *missing], capsys)
    assert "--sidecar-token-file: " in err and "nope does not exist" in err


def test_receiver_options_carry_the_client_auth(tmp_path: Path) -> None:
    options = RefitOptions.from_dict({"token_file": "/t", "tls_ca": "/ca"})
    assert options.client_auth() == ClientAuth(token_file=Path("/t"), tls_ca=Path("/ca"))
    assert RefitOptions(auth=ReceiverAuth(insecure=True)).client_auth() == ClientAuth(insecure=True)
    with pytest.raises(ValueError, match="token file, or insecure mode explicitly"):
        RefitOptions()
    with pytest.raises(ValueError, match=r"^token_file must be a file path or null, got 3"):
        RefitOptions.from_dict({"token_file": 3})
    with pytest.raises(ValueError, match=r"^insecure must be true or false, got 'yes'"):
        RefitOptions.from_dict({"insecure": "yes"})
