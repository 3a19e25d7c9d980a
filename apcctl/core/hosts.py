"""This machine on the network: whether a URL points at it, and a port free on it.

``is_local_url`` decides what may be stopped and sampled (signals and psutil act on local
processes only); ``free_port`` picks ports for servers and gateways that apcctl and the tests start.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse

import psutil


def is_local_url(url: str) -> bool:
    """The URL's host is this machine: ``localhost``, a loopback or wildcard address, or an
    address of one of its interfaces. Other names are not resolved: they may be anywhere."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified or str(address) in _interface_addresses()


def _interface_addresses() -> set[str]:
    return {a.address.split("%", 1)[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel picks it; a small race remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_busy(host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port`` (a wildcard host probes loopback)."""
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((probe_host, port)) == 0
