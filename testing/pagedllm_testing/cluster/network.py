"""The cluster's test network: a Linux bridge on this machine with an address of its own (the
address the apiserver advertises), into which each pod's network namespace is wired by a veth
pair. Every address of it lives on this machine; nothing here routes anywhere else. Creating it
needs root (or CAP_NET_ADMIN)."""

from __future__ import annotations

import ipaddress
import random
import subprocess
from dataclasses import dataclass

# 10.213.N.0/24, one N a cluster: an N no interface of this machine has an address in.
NETWORK = ipaddress.ip_network("10.213.0.0/16")
PREFIX = 24
BRIDGE_PREFIX = "pllm"


class NetworkError(RuntimeError):
    pass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError as error:
        raise NetworkError("the test network needs iproute2's `ip`") from error
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


@dataclass(frozen=True)
class Bridge:
    """The bridge ``pllm<N>`` on 10.213.N.0/24; the host's address on it is .1."""

    index: int

    @property
    def name(self) -> str:
        return f"{BRIDGE_PREFIX}{self.index}"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"10.213.{self.index}.0/{PREFIX}")

    @property
    def host_address(self) -> str:
        return str(self.subnet.network_address + 1)

    def address(self, host: int) -> str:
        """The address of the ``host``-th test host (pod) on the bridge, from .2 on."""
        if not 1 <= host <= self.subnet.num_addresses - 3:
            raise NetworkError(f"no address {host} on {self.subnet}")
        return str(self.subnet.network_address + 1 + host)


def taken_indexes() -> set[int]:
    found = set()
    for line in ip("-o", "-4", "addr").stdout.splitlines():
        address = ipaddress.ip_interface(line.split()[3])
        if address.ip in NETWORK:
            found.add(int(str(address.ip).split(".")[2]))
    return found


def create_bridge() -> Bridge:
    free = sorted(set(range(1, 255)) - taken_indexes())
    if not free:
        raise NetworkError(f"every /{PREFIX} of {NETWORK} is in use")
    # Any free one: a cluster's address differs from the last one's, whose discovery kubectl
    # may still hold in its cache (keyed by the server's address).
    bridge = Bridge(random.choice(free))
    ip("link", "add", bridge.name, "type", "bridge")
    ip("addr", "add", f"{bridge.host_address}/{PREFIX}", "dev", bridge.name)
    ip("link", "set", bridge.name, "up")
    return bridge


def delete_bridge(bridge: Bridge) -> None:
    """The bridge gone (its veths go with their namespaces); a missing one is fine."""
    ip("link", "del", bridge.name, check=False)


def bridge_exists(bridge: Bridge) -> bool:
    return ip("link", "show", bridge.name, check=False).returncode == 0
