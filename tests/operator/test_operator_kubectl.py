"""The real kubectl against the emulator while the real operator runs: the user's workflow."""

from __future__ import annotations

import pytest

from pagedllm_testing.operator_harness import CRD_PATH, SAMPLES, Kube, Kubectl, eventually

pytestmark = pytest.mark.usefixtures("operator_process")


def test_apply_get_scale_wait_delete(kubectl: Kubectl, kube: Kube, namespace: str) -> None:
    assert "created" in kubectl("apply", "-f", str(CRD_PATH)).stdout
    kubectl("wait", "--for=condition=Established", "crd/pagedllms.pagedllm.io", "--timeout=10s")
    assert (
        "pagedllm.pagedllm.io/demo created"
        in kubectl("apply", "-f", str(SAMPLES / "demo-cpu.yaml")).stdout
    )

    deployment = f"/apis/apps/v1/namespaces/{namespace}/deployments/demo"
    eventually(lambda: kube.get(deployment), timeout=15, what="the operator's Deployment")
    table = eventually(
        lambda: (out := kubectl("get", "pllm").stdout) and "http://" in out and out,
        what="the URL column",
    )
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "MODEL", "READY", "REPLICAS", "URL", "AGE"]
    assert row.split()[:5] == ["demo", "demo", "0", "1", f"http://demo.{namespace}.svc:80"]

    assert "scaled" in kubectl("scale", "pllm/demo", "--replicas=3").stdout
    eventually(
        lambda: kube.get(deployment)["spec"]["replicas"] == 3,
        what="the Deployment to follow kubectl scale",
    )

    # What the Deployment controller would report once the pods (and the routers in front of
    # them) pass readiness.
    for path in (deployment, f"{deployment}-router"):
        live = kube.get(path)
        replicas = live["spec"]["replicas"]
        kube.merge(
            path + "/status",
            {
                "status": {
                    "observedGeneration": live["metadata"]["generation"],
                    "replicas": replicas,
                    "updatedReplicas": replicas,
                    "readyReplicas": replicas,
                    "availableReplicas": replicas,
                }
            },
        )
    kubectl("wait", "--for=condition=Ready", "pllm/demo", "--timeout=20s")

    kubectl("patch", "pllm", "demo", "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":8}}}')

    def max_num_seqs() -> str:
        args = kube.get(deployment)["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--max-num-seqs") + 1]

    eventually(lambda: max_num_seqs() == "8", what="the patched engine flag")

    rejected = kubectl(
        "patch",
        "pllm",
        "demo",
        "--type=merge",
        "-p",
        '{"spec":{"replicas":null,"autoscaling":{"minReplicas":3,"maxReplicas":2,"target":4}}}',
        check=False,
    )
    assert rejected.returncode != 0
    assert "minReplicas must not exceed maxReplicas" in rejected.stderr

    kubectl("delete", "pllm", "demo", "--timeout=20s")
    # Garbage-collected through its ownerReference, in the background as on a cluster (and
    # again should the operator have written it once more just before the delete).
    eventually(lambda: kube.get(deployment) is None, what="the Deployment to be collected")
    assert "No resources found" in kubectl("get", "pllm").stderr
