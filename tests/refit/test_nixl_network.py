"""Where NIXL agents listen: a source limited to an interface listens on that interface only
(and sources default to loopback), a puller starts no metadata listener unless asked, and the
process environment is left as it was. Pulls from loopback-only sources are covered by
test_nixl.py, whose sources all use the default."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from refit_sidecar.core.network import (
    NixlNetwork,
    create_ucx_backend,
    interface_addresses,
    interface_of,
)
from refit_sidecar.memory.host_arena import HostArena
from refit_sidecar.publish.shard_source import SourceAgent, SourceConfig
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from tests.support.isolation import in_child_process
from trainer_svc.cli import parse_config

_LISTEN = "0A"
"""TCP state LISTEN in /proc/net/tcp."""


def _listening_addresses() -> set[str]:
    """The local addresses of this process's listening TCP sockets."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != _LISTEN or fields[9] not in inodes:
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            # /proc prints the address as 32-bit words in host (little-endian) order.
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(socket.inet_ntop(family, packed))
    return found


def _non_loopback_address() -> str | None:
    for name, addresses in sorted(interface_addresses().items()):
        for address in sorted(addresses, key=str):
            if address.version == 4 and not address.is_loopback and name != "lo":
                return str(address)
    return None


def test_an_address_names_its_interface() -> None:
    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(ValueError, match=r"no network interface .* 203\.0\.113\.77 .*lo: "):
        interface_of("203.0.113.77")


def test_the_ucx_device_list_of_a_network() -> None:
    assert NixlNetwork().ucx_net_devices() is None
    assert NixlNetwork(host="0.0.0.0").ucx_net_devices() is None
    assert NixlNetwork(host="::").ucx_net_devices() is None
    restricted = NixlNetwork(host="127.0.0.1", extra_devices=("mlx5_0:1", "mlx5_1:1"))
    assert restricted.ucx_net_devices() == "lo,mlx5_0:1,mlx5_1:1"


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"host": "trainer-0.example"}, "must be an IP address"),
        ({"extra_devices": ("mlx5_0:1",)}, "need a NIXL host"),
        ({"host": "0.0.0.0", "extra_devices": ("mlx5_0:1",)}, "need a NIXL host"),
        ({"host": "127.0.0.1", "extra_devices": ("mlx5_0:1,mlx5_1:1",)}, "one name"),
    ],
)
def test_bad_networks_are_refused(values: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NixlNetwork(**values)
    with pytest.raises(ValueError, match=match):
        SourceConfig(
            name="bad",
            host=values.get("host", "0.0.0.0"),
            net_devices=values.get("extra_devices", ()),
        )


@in_child_process
def test_a_source_listens_on_its_interface_only() -> None:
    """UCX listens on loopback only for a default source, and the environment UCX read is
    restored afterwards."""
    os.environ.pop("UCX_NET_DEVICES", None)
    assert _listening_addresses() == set()
    agent = SourceAgent.create(SourceConfig(name="loopback-source"))
    arena = HostArena.allocate(1 << 16, 256)
    registration = agent.register(arena)
    assert agent.record().metadata
    listening = _listening_addresses()
    assert listening and all(a.startswith("127.") for a in listening), listening
    assert "UCX_NET_DEVICES" not in os.environ
    agent.deregister(registration)
    agent.close()


@in_child_process
def test_a_puller_runs_no_metadata_listener_unless_asked() -> None:
    """NIXL's metadata listener binds every interface whatever the UCX devices: a puller
    starts it only with metadata_listener, and its UCX endpoints follow `host`."""
    os.environ["UCX_NET_DEVICES"] = "all"
    quiet = NixlTransport.create(NixlConfig(name="quiet-puller", host="127.0.0.1"))
    listening = _listening_addresses()
    assert listening and all(a.startswith("127.") for a in listening), listening
    assert os.environ["UCX_NET_DEVICES"] == "all"
    listener = NixlTransport.create(NixlConfig(name="listening-puller", metadata_listener=True))
    assert "0.0.0.0" in _listening_addresses()
    quiet.close()
    listener.close()


@pytest.mark.skipif(_non_loopback_address() is None, reason="no non-loopback interface")
@in_child_process
def test_a_source_on_every_interface_listens_beyond_loopback() -> None:
    """What the default protects against: 0.0.0.0 leaves UCX on every interface."""
    os.environ.pop("UCX_NET_DEVICES", None)
    agent = SourceAgent.create(SourceConfig(name="open-source", host="0.0.0.0"))
    assert any(not a.startswith("127.") for a in _listening_addresses())
    agent.close()


def test_trainer_flags_choose_the_nixl_network(capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = parse_config(["--insecure"])
    assert (config.refit.nixl_host, config.refit.nixl_net_devices) == ("127.0.0.1", ())
    flags = ["--nixl-host", "10.1.2.3", "--nixl-net-device", "mlx5_0:1"]
    config, _ = parse_config([*flags, "--nixl-net-device", "mlx5_1:1", "--insecure"])
    assert config.refit.nixl_host == "10.1.2.3"
    assert config.refit.nixl_net_devices == ("mlx5_0:1", "mlx5_1:1")
    with pytest.raises(SystemExit) as info:
        parse_config(["--nixl-host", "trainer-0", "--insecure"])
    assert info.value.code == 2
    assert "must be an IP address" in capsys.readouterr().err


def test_agents_are_created_with_cuda_ipc_reads_on_unless_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX turns GETs over CUDA IPC off without NVLink (two processes on one GPU): every
    agent is created with them on and its devices set, the environment restored after; a
    value the environment sets wins."""
    names = ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "UCX_NET_DEVICES")
    seen: dict[str, str | None] = {}

    class Agent:
        def create_backend(self, backend: str, params: dict[str, str]) -> None:
            seen.update({name: os.environ.get(name) for name in names})

    for name in names:
        monkeypatch.delenv(name, raising=False)
    create_ucx_backend(Agent(), NixlNetwork(host="127.0.0.1"))
    assert seen == {names[0]: "y", names[1]: interface_of("127.0.0.1")}
    assert not any(name in os.environ for name in names)
    monkeypatch.setenv(names[0], "n")
    create_ucx_backend(Agent(), NixlNetwork())
    assert seen == {names[0]: "n", names[1]: None}
    assert os.environ[names[0]] == "n"
