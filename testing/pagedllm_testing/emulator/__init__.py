"""A Kubernetes API server emulator on loopback, good enough for kopf and the real kubectl.

It keeps objects in memory and speaks the REST API: discovery (/api, /apis), OpenAPI v3 and
v2 with the CRDs' schemas (`kubectl explain`), list and watch (replay from a resourceVersion,
bookmarks, the initial-events bookmark), get, create, replace, the four patch types (JSON,
merge, strategic, server-side apply), delete with finalizers and owner-reference garbage
collection, the status and scale subresources, pod binding and eviction (PodDisruptionBudgets
honoured: 429 when they allow no disruption), label and field selectors, server-side Tables
for `kubectl get`, and custom resources from the CRDs created in it (defaults, pruning, schema
and CEL validation).

No controllers run here: nothing turns a Deployment into pods. Run it standalone with

    python -m pagedllm_testing.emulator --port 8001 --kubeconfig /tmp/kubeconfig

or in-process from tests with `EmulatorThread`.

Modules, from the bottom up: resources (the kinds), errors, objects (timestamps, field
paths), patches, selectors, events, crd_validation, store (the cluster's state), disruption
and pod_actions (eviction, binding), routing, tables, watches, discovery, openapi and
openapi_v2_proto, server (HTTP), running.
"""

from pagedllm_testing.emulator.running import EmulatorThread, kubeconfig_text
from pagedllm_testing.emulator.server import EmulatorServer
from pagedllm_testing.emulator.store import KubeEmulator

__all__ = ["EmulatorServer", "EmulatorThread", "KubeEmulator", "kubeconfig_text"]
