"""The getting-started tour (docs/getting-started.md) as a new user runs it: every shell and
Python block of the page in order, in one bash session from the repository's root, with the
venv's commands and the built kubectl first on PATH: the demo node, then the real control plane
with process kubelets that the page starts (as root) and stops. Only blocks marked
`<!-- tour: skip ... -->` (the set-up, which make test has done) are left out; the port and the
scratch folder are swapped for a free port and a folder of the test's, so that a server
already on the machine's port 8000 cannot answer in the node's place. The README's tour is the
same blocks, so it cannot rot either."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedllm_testing.cluster import binary, network
from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.docs_site import DOCS, README, REPO, Block, blocks
from pagedllm_testing.serve_harness import free_port

PAGE = DOCS / "getting-started.md"
TIMEOUT_S = 300
# What the page's blocks say, as the test runs them: the node's port and the cluster's folder.
NODE_PORT, SCRATCH = "8000", "/tmp/pagedllm-tour"


def tour() -> list[Block]:
    return [
        b
        for b in blocks(PAGE.read_text())
        if b.language in ("sh", "python") and not b.note.startswith("tour: skip")
    ]


def script(tmp_path: Path, scratch: Path) -> str:
    """The blocks as one bash script, each Python block a file run by the venv's python."""
    swaps = {NODE_PORT: str(free_port()), SCRATCH: str(scratch)}
    text = "\n".join(b.text for b in tour())
    for old in swaps:
        assert old in text, f"the tour no longer uses {old}: update this test's swaps"
    lines = ["set -euo pipefail"]
    for i, block in enumerate(tour()):
        body = block.text
        for old, new in swaps.items():
            body = body.replace(old, new)
        lines.append(f"echo '>>> block {i}'")
        if block.language == "python":
            path = tmp_path / f"block{i}.py"
            path.write_text(body)
            lines.append(f"python {path}")
        else:
            lines.append(body)
    return "\n".join(lines) + "\n"


def test_the_tour_runs_as_written(tmp_path: Path) -> None:
    path = tmp_path / "tour.sh"
    # Short: the pods' unix sockets live under the cluster's folder.
    scratch = Path(tempfile.mkdtemp(prefix="pllm-tour-"))
    path.write_text(script(tmp_path, scratch))
    log_path = tmp_path / "tour.log"
    bin_dir = str(Path(sys.executable).parent)
    # The venv's commands and the built kubectl first.
    kubectl_dir = str(Path(binary.kubectl()).parent)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{kubectl_dir}:{os.environ['PATH']}",
        "TMPDIR": str(tmp_path),
    }
    env.pop("KUBECONFIG", None)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            ["bash", str(path)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code = process.wait(TIMEOUT_S)
    finally:
        # Whatever the tour left running (it stops its servers itself when it gets that far).
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        ControlPlane(scratch / "cluster").down()
    out = log_path.read_text(errors="replace")
    assert code == 0, out[-6000:]
    assert f">>> block {len(tour()) - 1}" in out, out[-6000:]
    assert '"text"' in out and '"usage"' in out, "the completion's JSON"
    assert "CompletionUsage(" in out, "the openai SDK's answer"
    assert "pagedllm.pagedllm.io/demo created" in out
    assert "FIELD: router <Object>" in out and "loadBound" in out, "kubectl explain"
    assert "pagedllm.pagedllm.io/demo condition met" in out
    for made in ("deployment.apps/demo ", "deployment.apps/demo-router", "service/demo "):
        assert made in out, f"the operator made no {made.strip()}\n{out[-6000:]}"
    # The models the demo serves, through the apiserver's service proxy and the routers.
    assert '"object":"list"' in out.replace(" ", "") and '"id":"demo"' in out.replace(" ", "")
    assert not network.bridge_exists(network.Bridge(bridge_of(out))), "the cluster's bridge"
    shutil.rmtree(scratch)


def bridge_of(out: str) -> int:
    """The cluster's bridge, from the node addresses `kubectl get pods -o wide` printed."""
    match = re.search(r"\b10\.213\.(\d+)\.\d+\b", out)
    assert match is not None, "no pod address in the tour's output"
    return int(match[1])


def test_the_readme_tour_is_the_getting_started_tour() -> None:
    page = {" ".join(b.text.split()) for b in tour()}
    readme = [b for b in blocks(README.read_text()) if b.language in ("sh", "python")]
    shared = [b for b in readme if " ".join(b.text.split()) in page]
    assert len(shared) >= 3, "the README's tour: serve, curl, the openai SDK, the cluster"
    for b in readme:
        if b not in shared:
            assert b.note.startswith("tour: skip"), f"a README block the tour does not run:\n{b}"
