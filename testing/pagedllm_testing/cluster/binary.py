"""The control plane's one binary (e2e/cluster: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kubectl from Kubernetes' own Go modules), built with the machine's Go when
its sources changed since the last build. Go's module and build caches make a rebuild after a
source change take seconds; the first build on a machine takes many minutes (docs/contributing)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MODULE = REPO / "e2e" / "cluster"
# Where the binary is built, once for every control plane of the checkout.
BIN_DIR = REPO / ".cluster" / "bin"
SOURCES = ("go.mod", "go.sum", "main.go")
COMMANDS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
# The version stamped into both version packages, so that `kubectl version` names the server's
# and the client's: the k8s.io/kubernetes release the module requires.
VERSION_PACKAGES = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")


class BuildError(RuntimeError):
    pass


def kubernetes_version() -> str:
    """The k8s.io/kubernetes release e2e/cluster/go.mod requires, for example ``v1.37.2``."""
    match = re.search(r"^\s*k8s\.io/kubernetes (v\S+)", (MODULE / "go.mod").read_text(), re.M)
    if match is None:
        raise BuildError(f"{MODULE / 'go.mod'} requires no k8s.io/kubernetes release")
    return match[1]


def ldflags(version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    stamps = []
    for package in VERSION_PACKAGES:
        stamps += [
            f"-X {package}.gitVersion={version}",
            f"-X {package}.gitMajor={major}",
            f"-X {package}.gitMinor={minor}",
            f"-X {package}.gitTreeState=clean",
        ]
    # -s -w: no symbol table or DWARF, a third smaller; the components' stack traces still name
    # their functions.
    return " ".join(["-s", "-w", *stamps])


def _fingerprint(version: str) -> str:
    digest = hashlib.sha256(ldflags(version).encode())
    for name in SOURCES:
        digest.update((MODULE / name).read_bytes())
    return digest.hexdigest()


def build(bin_dir: Path) -> Path:
    """``bin_dir/cluster`` and a link to it named after each command, built if missing or
    stale. Returns the directory, to put first on PATH."""
    # Go's own installer puts it in /usr/local/go, which not every PATH names.
    go = shutil.which("go") or shutil.which("go", path="/usr/local/go/bin")
    if go is None:
        raise BuildError("building the control plane needs Go 1.26 or newer on the PATH")
    bin_dir.mkdir(parents=True, exist_ok=True)
    binary = bin_dir / "cluster"
    stamp = bin_dir / ".fingerprint"
    version = kubernetes_version()
    fingerprint = _fingerprint(version)
    if not (binary.exists() and stamp.exists() and stamp.read_text() == fingerprint):
        # GOTOOLCHAIN=local: the machine's Go, never a toolchain download; -mod=readonly: the
        # build uses go.sum as committed.
        env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly -buildvcs=false"}
        command = [go, "build", "-trimpath", "-ldflags", ldflags(version), "-o", str(binary), "."]
        result = subprocess.run(command, cwd=MODULE, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"go build of {MODULE} failed:\n{result.stderr[-4000:]}")
        stamp.write_text(fingerprint)
    for name in COMMANDS:
        link = bin_dir / name
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to("cluster")
    return bin_dir


def kubectl() -> str:
    """The built kubectl (built first if need be): the tests' and the tour's kubectl, whatever
    else is on the PATH."""
    return str(build(BIN_DIR) / "kubectl")


if __name__ == "__main__":
    # `make cluster-bin`: the binary into .cluster/bin (what the tests and `make cluster` use).
    print(build(BIN_DIR) / "cluster")
