"""Each pod's network: a network namespace of its own with one address on the cluster's bridge
(a veth pair, its host end in the bridge), loopback up and a default route through the host's
address on the bridge. Its processes bind there, so pod IPs are real, distinct and reachable
from the host and from other pods, as EndpointSlices need them; nothing routes beyond the
machine.

Addresses come from the bridge's /24 and are shared by every kubelet of the cluster: a pod
takes one by creating ``ROOT/ipam/ADDRESS`` exclusively and gives it back by removing it."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from pagedllm_testing.cluster import network

NETNS_DIR = Path("/run/netns")


@dataclass(frozen=True)
class PodNetwork:
    bridge: network.Bridge
    host: int

    @property
    def address(self) -> str:
        return self.bridge.address(self.host)

    @property
    def namespace(self) -> str:
        return f"{self.bridge.name}-{self.host}"

    @property
    def namespace_path(self) -> Path:
        return NETNS_DIR / self.namespace

    @property
    def veth(self) -> str:
        return f"{self.bridge.name}v{self.host}"


def of_address(bridge: network.Bridge, address: str) -> PodNetwork:
    """The pod network holding ``address`` (a pod's status.podIP) on ``bridge``."""
    return PodNetwork(bridge, int(address.rsplit(".", 1)[1]) - 1)


def allocate(ipam: Path, bridge: network.Bridge, owner: str) -> PodNetwork:
    """A free address of the bridge, taken for ``owner`` (a pod's uid)."""
    ipam.mkdir(parents=True, exist_ok=True)
    for host in range(2, bridge.subnet.num_addresses - 2):
        try:
            fd = os.open(ipam / bridge.address(host), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as claim:
            claim.write(owner)
        return PodNetwork(bridge, host)
    raise network.NetworkError(f"no free address left on {bridge.subnet}")


def create(pod: PodNetwork) -> None:
    ns, veth = pod.namespace, pod.veth
    network.ip("netns", "add", ns)
    network.ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    network.ip("link", "set", veth, "master", pod.bridge.name, "up")
    network.ip("-n", ns, "addr", "add", f"{pod.address}/{network.PREFIX}", "dev", "eth0")
    network.ip("-n", ns, "link", "set", "eth0", "up")
    network.ip("-n", ns, "link", "set", "lo", "up")
    network.ip("-n", ns, "route", "add", "default", "via", pod.bridge.host_address)


def processes_in(namespace_path: Path) -> list[int]:
    """Processes whose network namespace is the one at ``namespace_path``."""
    try:
        target = os.stat(namespace_path).st_ino
    except FileNotFoundError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def delete(pod: PodNetwork, ipam: Path) -> None:
    """The namespace gone (its veth pair with it, after any process left in it is killed) and
    the address given back."""
    for pid in processes_in(pod.namespace_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    network.ip("netns", "del", pod.namespace, check=False)
    network.ip("link", "del", pod.veth, check=False)
    with contextlib.suppress(FileNotFoundError):
        (ipam / pod.address).unlink()


def leftovers(bridge: network.Bridge) -> list[PodNetwork]:
    """Pod network namespaces of the bridge that still exist."""
    prefix = f"{bridge.name}-"
    if not NETNS_DIR.exists():
        return []
    return [
        PodNetwork(bridge, int(path.name[len(prefix) :]))
        for path in NETNS_DIR.iterdir()
        if path.name.startswith(prefix) and path.name[len(prefix) :].isdigit()
    ]


def any_pod_network() -> bool:
    """Whether any cluster of this machine has a pod network namespace now."""
    prefix = network.BRIDGE_PREFIX
    return NETNS_DIR.exists() and any(p.name.startswith(prefix) for p in NETNS_DIR.iterdir())


def sweep(bridge: network.Bridge, ipam: Path) -> None:
    """Every pod network of the bridge removed (a cluster going down)."""
    for pod in leftovers(bridge):
        delete(pod, ipam)
