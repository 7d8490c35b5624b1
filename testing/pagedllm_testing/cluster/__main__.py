"""`python -m pagedllm_testing.cluster up|down|status [--root DIR]`: what `make cluster` and
`make cluster-down` run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedllm_testing.cluster.binary import REPO, BuildError
from pagedllm_testing.cluster.control_plane import COMPONENTS, ControlPlane, ControlPlaneError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm_testing.cluster")
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--root", type=Path, default=REPO / ".cluster")
    args = parser.parse_args(argv)
    cluster = ControlPlane(args.root)
    try:
        if args.action == "up":
            cluster.up()
            print(f"KUBECONFIG={cluster.layout.kubeconfig}")
        elif args.action == "down":
            cluster.down()
        else:
            if not cluster.layout.state.exists():
                print("no cluster running")
                return 1
            for name in COMPONENTS:
                print(f"{name}: {'running' if cluster.running(name) else 'stopped'}")
    except (BuildError, ControlPlaneError) as error:
        print(f"cluster {args.action}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
