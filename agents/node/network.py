"""Which address and network interface an agent's ranks use (issue 44): the address other hosts
reach this one on is what the agent advertises (rank 0's rendezvous comes from it), and gloo and
NCCL bind to its interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME). The defaults follow the
route to the broker: the interface the kernel would send the broker's traffic from is the one
the cluster's hosts share. Never the host name: it resolves differently on every machine (and to
127.0.1.1 on Debian), the source of most of torchrun's rendezvous failures."""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from urllib.parse import urlsplit

SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address


class NetworkError(ValueError):
    """A setting names an address or interface this host does not have."""


def address_towards(url: str) -> str:
    """This host's source address for traffic to the host of `url` (a redis:// URL): the kernel's
    route, found by connecting a UDP socket (which sends nothing)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    try:
        target = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
    except socket.gaierror as exc:
        raise NetworkError(f"the broker's host {host!r} does not resolve: {exc}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(target)
        except OSError as exc:
            raise NetworkError(f"no route to the broker at {host}:{port}: {exc}") from None
        return probe.getsockname()[0]


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interfaces() -> dict[str, str]:
    """Interface name -> its IPv4 address, for those that have one."""
    out = {}
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        if address is not None:
            out[name] = address
    return out


def interface_for(address: str) -> str | None:
    return next((name for name, a in interfaces().items() if a == address), None)


def choose(broker_url: str, advertise: str | None = None, interface: str | None = None) -> tuple[str, str | None]:
    """(the address to advertise, the interface for gloo/NCCL). An explicit interface gives its
    address unless one is advertised; without either, the route to the broker decides."""
    have = interfaces()
    if interface is not None and interface not in have:
        raise NetworkError(f"--interface {interface}: no such interface with an IPv4 address here "
                           f"(have: {', '.join(sorted(have)) or 'none'})")
    if advertise is not None:
        try:
            ipaddress.ip_address(advertise)
        except ValueError:
            raise NetworkError(f"--advertise {advertise!r}: give an IPv4 address other hosts reach this one "
                               f"on (e.g. 10.0.0.12)") from None
        return advertise, interface or interface_for(advertise)
    if interface is not None:
        return have[interface], interface
    address = address_towards(broker_url)
    return address, interface_for(address)
