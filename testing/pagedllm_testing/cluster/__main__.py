"""`python -m pagedllm_testing.cluster up|down|status [--root DIR] [--gpu-nodes N]`: what
`make cluster` and `make cluster-down` run. `up` starts the control plane and a process kubelet
for a system node and N GPU nodes (one `nvidia.com/gpu` each), and waits until every Node is
Ready."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedllm_testing.cluster.binary import REPO, BuildError
from pagedllm_testing.cluster.control_plane import COMPONENTS, ControlPlane, ControlPlaneError
from pagedllm_testing.cluster.image import BIN_DIR, image_env
from pagedllm_testing.cluster.kubelet.node import cluster_nodes


def up(cluster: ControlPlane, gpu_nodes: int) -> None:
    cluster.up()
    known = {node.name: node for node in cluster.nodes()}
    env = image_env()
    for node in [*known.values(), *(n for n in cluster_nodes(gpu_nodes) if n.name not in known)]:
        if not cluster.running(f"kubelet/{node.name}"):
            cluster.add_node(node, image_env=env, bin_dirs=[str(BIN_DIR)])
    cluster.wait_nodes_ready()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm_testing.cluster")
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--root", type=Path, default=REPO / ".cluster")
    parser.add_argument("--gpu-nodes", type=int, default=2)
    args = parser.parse_args(argv)
    if args.gpu_nodes < 0:
        parser.error("--gpu-nodes must be 0 or more")
    cluster = ControlPlane(args.root)
    try:
        if args.action == "up":
            up(cluster, args.gpu_nodes)
            print(f"KUBECONFIG={cluster.layout.kubeconfig}")
        elif args.action == "down":
            cluster.down()
        else:
            if not cluster.layout.state.exists():
                print("no cluster running")
                return 1
            for name in COMPONENTS:
                print(f"{name}: {'running' if cluster.running(name) else 'stopped'}")
            for node in cluster.nodes():
                running = cluster.running(f"kubelet/{node.name}")
                print(f"kubelet {node.name}: {'running' if running else 'stopped'}")
    except (BuildError, ControlPlaneError, RuntimeError) as error:
        print(f"cluster {args.action}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
