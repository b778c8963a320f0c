"""Which network interfaces a NIXL agent's UCX endpoints listen on.

UCX opens a listening socket for its TCP transport on every network device it uses, on ports it
picks, and puts those addresses in the agent's metadata; it authenticates no peer (docs/
security.md, "Data plane"). `NixlNetwork` narrows that to one interface, named by one of its
addresses (what Kubernetes' downward API gives: `status.podIP`), plus RDMA ports named as UCX
names them. Shared memory and CUDA IPC are not network devices and stay available.

NIXL 1.5.1 offers no way to pass a TCP device: its `device_list` backend parameter appends an
RDMA port number to each name, and its `ucx_devices` parameter leaves the TCP listeners on every
interface (both checked here). UCX reads `UCX_NET_DEVICES` from the environment when the
backend is created, so `create_ucx_backend` sets it for that call only and then restores it
(the environment is the process's: agents are created one at a time, from one thread), with
the UCX defaults of `_UCX_DEFAULTS`.
NIXL's own metadata listener takes a port but no address and binds every interface; the
sources here publish their metadata through the sidecar instead, and pullers start that
listener only when asked (`NixlConfig.metadata_listener`).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SIOCGIFADDR = 0x8915
"""Linux ioctl: an interface's (primary) IPv4 address."""
_UCX_NET_DEVICES = "UCX_NET_DEVICES"
_UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
"""UCX settings every agent here is created with, unless the environment sets them. UCX turns
one-sided reads (GET) over CUDA IPC off where it finds no NVLink between the GPUs, and the two
processes of one GPU (a trainer and an inference engine colocated) have none: their reads then
go through TCP, staged through the host (docs/refit.md, "Colocated on one GPU"; the results
page has the cost). Every read of a refit is a GET."""
_BACKEND_PARAMS = {"ucx_error_handling_mode": "peer"}
"""A source that dies mid-transfer raises NIXL_ERR_REMOTE_DISCONNECT instead of hanging."""

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, kw_only=True)
class NixlNetwork:
    host: str | None = None
    """An address of the interface the agent's UCX network transports are limited to. None,
    0.0.0.0 or ::: every interface (UCX's choice, or UCX_NET_DEVICES from the environment)."""
    extra_devices: tuple[str, ...] = ()
    """More UCX network devices the agent may use besides that interface: RDMA ports as UCX
    names them (``mlx5_0:1``). Only with a host."""

    def __post_init__(self) -> None:
        if self.host is not None:
            try:
                ipaddress.ip_address(self.host)
            except ValueError:
                raise ValueError(
                    f"the NIXL host must be an IP address of this host, got {self.host!r}"
                ) from None
        if self.extra_devices and self.unrestricted:
            raise ValueError(
                "extra NIXL network devices need a NIXL host: without one UCX uses every device"
            )
        for device in self.extra_devices:
            if not device or "," in device or device != device.strip():
                raise ValueError(f"a UCX network device is one name like mlx5_0:1, got {device!r}")

    @property
    def unrestricted(self) -> bool:
        return self.host is None or ipaddress.ip_address(self.host).is_unspecified

    def ucx_net_devices(self) -> str | None:
        """The UCX_NET_DEVICES value this network needs; None to leave UCX's own."""
        if self.host is None or self.unrestricted:
            return None
        return ",".join((interface_of(self.host), *self.extra_devices))


def interface_addresses() -> dict[str, set[Address]]:
    """Each network interface of this host and its addresses (IPv4: the primary one)."""
    found: dict[str, set[Address]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            found.setdefault(name, set())
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):  # no IPv4 address
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
                found[name].add(ipaddress.IPv4Address(reply[20:24]))
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
            found.setdefault(fields[5], set()).add(address)
    return found


def interface_of(host: str) -> str:
    """The name of the network interface that holds the address `host`."""
    wanted = ipaddress.ip_address(host)
    interfaces = interface_addresses()
    for name, addresses in sorted(interfaces.items()):
        if wanted in addresses:
            return name
    listed = "; ".join(
        f"{name}: {', '.join(sorted(map(str, addresses))) or 'no address'}"
        for name, addresses in sorted(interfaces.items())
    )
    raise ValueError(f"no network interface of this host has the address {host} ({listed})")


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in the process's environment for the block, then what was there before."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def ucx_settings(network: NixlNetwork) -> dict[str, str]:
    """The UCX environment an agent on `network` is created with: its devices, and the
    defaults the environment does not set already."""
    settings = {k: v for k, v in _UCX_DEFAULTS.items() if k not in os.environ}
    devices = network.ucx_net_devices()
    if devices is not None:
        settings[_UCX_NET_DEVICES] = devices
    return settings


def create_ucx_backend(agent: Any, network: NixlNetwork) -> None:
    """Creates `agent`'s UCX backend on `network`'s devices (`ucx_settings`)."""
    with _environment(ucx_settings(network)):
        agent.create_backend("UCX", dict(_BACKEND_PARAMS))


class ProgressPoller:
    """Progresses a NIXL agent's UCX workers from a daemon thread every `interval` seconds
    (fetching notifications does it), for an agent whose memory others read while it does
    not transfer itself. NIXL's own progress thread yields in a tight loop and so takes a
    core's share on a small machine; the agent needs strict sync mode either way."""

    def __init__(self, agent: Any, name: str, interval: float) -> None:
        if not interval > 0:
            raise ValueError(f"a progress interval must be positive, got {interval}")
        self._agent = agent
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name=f"nixl-progress-{name}", daemon=True
        )
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self._agent.get_new_notifs()
            except Exception:  # a peer gone mid-handshake; the next poll goes on
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
