"""`python -P -m pagedllm_testing.cluster.kubelet --cluster ROOT --node NAME [--gpus N]
[--label K=V] [--taint KEY] [--env K=V] [--bin-dir DIR]`: one node's kubelet for the control
plane under ROOT (its state file names the apiserver's port and the bridge). SIGTERM ends it as
a lost node ends: every pod process killed, every pod network removed."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from pagedllm_testing.cluster import binary, network, pki
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.cluster.kubelet.api import Api
from pagedllm_testing.cluster.kubelet.kubelet import Kubelet
from pagedllm_testing.cluster.kubelet.node import NodeSpec


def pairs(values: list[str], what: str) -> dict[str, str]:
    result = {}
    for value in values:
        key, sep, item = value.partition("=")
        if not sep or not key:
            raise SystemExit(f"{what} {value!r}: expected KEY=VALUE")
        result[key] = item
    return result


async def serve(kubelet: Kubelet) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    running = loop.create_task(kubelet.run())
    stopped = loop.create_task(stop.wait())
    await asyncio.wait({running, stopped}, return_when=asyncio.FIRST_COMPLETED)
    running.cancel()
    try:
        await running
    except asyncio.CancelledError:
        pass
    finally:
        await kubelet.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P -m pagedllm_testing.cluster.kubelet")
    parser.add_argument("--cluster", type=Path, required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--gpus", type=int, default=0)
    parser.add_argument("--label", action="append", default=[])
    parser.add_argument("--taint", action="append", default=[], help="a NoSchedule taint's key")
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--bin-dir", action="append", default=[])
    args = parser.parse_args(argv)
    if args.gpus < 0:
        parser.error("--gpus must be 0 or more")
    cluster = ControlPlane(args.cluster)
    state = cluster.current
    node = NodeSpec(args.node, args.gpus, pairs(args.label, "--label"), tuple(args.taint))
    # The credentials TLS bootstrapping would end with: a client certificate of the node.
    ca = pki.Pair(cluster.layout.pki / "ca.crt", cluster.layout.pki / "ca.key")
    client = pki.issue(
        ca,
        cluster.layout.pki,
        f"kubelet-{node.name}",
        f"system:node:{node.name}",
        organization="system:nodes",
    )
    api = Api(cluster.server, cluster.ca, client.cert, client.key, f"kubelet/{node.name}")
    kubelet = Kubelet(
        api,
        node,
        root=cluster.layout.root,
        bridge=network.Bridge(state.bridge),
        apiserver_port=state.ports["kube-apiserver"],
        version=binary.kubernetes_version(),
        bin_dirs=args.bin_dir,
        image_env=pairs(args.env, "--env"),
    )
    asyncio.run(serve(kubelet))
    return 0


if __name__ == "__main__":
    sys.exit(main())
