"""Server-side Tables (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`), what
`kubectl get` prints: the built-in kinds with the columns of a real API server's printers,
custom resources with their CRD's additionalPrinterColumns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm_testing.emulator.objects import age, get_path
from pagedllm_testing.emulator.resources import ResourceType
from pagedllm_testing.emulator.selectors import selector_string

TABLE_GROUP_VERSION = "meta.k8s.io/v1"
NONE = "<none>"  # what a real server's printers put in an empty cell

Cell = Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class Column:
    name: str
    cell: Cell
    type: str = "string"
    priority: int = 0  # 1: shown by `kubectl get -o wide` only
    description: str = ""
    format: str = ""

    def definition(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "format": self.format,
            "priority": self.priority,
            "description": self.description,
        }


def wants_table(accept: str) -> bool:
    """Whether a request's Accept header asks for a Table."""
    return "as=Table" in accept


def table(
    rtype: ResourceType, items: list[dict[str, Any]], include_object: str, revision: int
) -> dict[str, Any]:
    """`include_object` is the request's includeObject: Object, or PartialObjectMetadata."""
    columns = columns_of(rtype)
    rows = []
    for obj in items:
        row_object = (
            obj
            if include_object == "Object"
            else {
                "kind": "PartialObjectMetadata",
                "apiVersion": TABLE_GROUP_VERSION,
                "metadata": obj["metadata"],
            }
        )
        rows.append({"cells": [column.cell(obj) for column in columns], "object": row_object})
    return {
        "kind": "Table",
        "apiVersion": TABLE_GROUP_VERSION,
        "metadata": {"resourceVersion": str(revision)},
        "columnDefinitions": [column.definition() for column in columns],
        "rows": rows,
    }


def columns_of(rtype: ResourceType) -> list[Column]:
    builtin = BUILTIN_COLUMNS.get((rtype.group, rtype.plural))
    if builtin is not None:
        return [NAME, *builtin]
    columns = [NAME]
    columns += [
        Column(c.name, _printer_cell(c.json_path, c.type), type=c.type, priority=c.priority)
        for c in rtype.printer_columns
    ]
    if not any(c.name == "Age" for c in rtype.printer_columns):
        columns.append(Column("Age", _age_cell, type="date", description="CreationTimestamp"))
    return columns


def _printer_cell(json_path: str, column_type: str) -> Cell:
    def cell(obj: dict[str, Any]) -> Any:
        value = get_path(obj, json_path)
        if column_type == "date":
            value = age(value)
        return "" if value is None else value

    return cell


def _age_cell(obj: dict[str, Any]) -> str:
    return age(obj["metadata"].get("creationTimestamp"))


def _count(path: str) -> Cell:
    return lambda obj: get_path(obj, path) or 0


def _or_none(path: str) -> Cell:
    return lambda obj: get_path(obj, path) or NONE


NAME = Column(
    "Name",
    lambda obj: obj["metadata"]["name"],
    format="name",
    description="Name must be unique within a namespace.",
)
AGE = Column("Age", _age_cell, description="CreationTimestamp is when the object was created.")


# --- workloads ---------------------------------------------------------------------------


def _ready_of_desired(obj: dict[str, Any]) -> str:
    desired = get_path(obj, ".spec.replicas")
    return f"{get_path(obj, '.status.readyReplicas') or 0}/{1 if desired is None else desired}"


def _template_containers(field: str) -> Cell:
    def cell(obj: dict[str, Any]) -> str:
        containers = get_path(obj, ".spec.template.spec.containers") or []
        return ",".join(str(c.get(field, "")) for c in containers) or NONE

    return cell


def _selector(obj: dict[str, Any]) -> str:
    return selector_string(get_path(obj, ".spec.selector")) or NONE


TEMPLATE_COLUMNS = (
    Column(
        "Containers",
        _template_containers("name"),
        priority=1,
        description="Names of each container in the template.",
    ),
    Column(
        "Images",
        _template_containers("image"),
        priority=1,
        description="Images referenced by each container in the template.",
    ),
)
SELECTOR = Column(
    "Selector", _selector, priority=1, description="Label query over pods that should match."
)

DEPLOYMENT_COLUMNS = (
    Column("Ready", _ready_of_desired, description="Number of the pod with ready state"),
    Column(
        "Up-to-date",
        _count(".status.updatedReplicas"),
        description="Total number of non-terminated pods targeted by this deployment that "
        "have the desired template spec.",
    ),
    Column(
        "Available",
        _count(".status.availableReplicas"),
        description="Total number of available pods (ready for at least minReadySeconds) "
        "targeted by this deployment.",
    ),
    AGE,
    *TEMPLATE_COLUMNS,
    SELECTOR,
)

REPLICASET_COLUMNS = (
    Column(
        "Desired",
        _count(".spec.replicas"),
        type="integer",
        description="Replicas is the number of desired replicas.",
    ),
    Column(
        "Current",
        _count(".status.replicas"),
        type="integer",
        description="Replicas is the most recently observed number of replicas.",
    ),
    Column(
        "Ready",
        _count(".status.readyReplicas"),
        type="integer",
        description="The number of ready replicas for this replica set.",
    ),
    AGE,
    *TEMPLATE_COLUMNS,
    SELECTOR,
)

STATEFULSET_COLUMNS = (
    Column("Ready", _ready_of_desired, description="Number of the pod with ready state"),
    AGE,
    *TEMPLATE_COLUMNS,
)


# --- pods ----------------------------------------------------------------------------------


def _pod_ready(pod: dict[str, Any]) -> str:
    statuses = get_path(pod, ".status.containerStatuses") or []
    total = len(get_path(pod, ".spec.containers") or [])
    return f"{sum(1 for s in statuses if s.get('ready'))}/{total}"


def _container_reason(status: dict[str, Any]) -> str | None:
    """A container's own word on the pod's status (waiting or terminated), if it has one."""
    state = status.get("state") or {}
    waiting, terminated = state.get("waiting"), state.get("terminated")
    if waiting and waiting.get("reason"):
        return str(waiting["reason"])
    if terminated and terminated.get("reason"):
        return str(terminated["reason"])
    if terminated:
        signal = terminated.get("signal")
        return f"Signal:{signal}" if signal else f"ExitCode:{terminated.get('exitCode', 0)}"
    return None


def pod_status(pod: dict[str, Any]) -> str:
    """The STATUS of `kubectl get pods`, as the API server's pod printer derives it (init
    containers left out: the operator's pods have none)."""
    status = pod.get("status") or {}
    # A real server defaults the phase to Pending at creation.
    reason = status.get("reason") or status.get("phase") or "Pending"
    for container in reversed(status.get("containerStatuses") or []):
        reason = _container_reason(container) or reason
    if pod["metadata"].get("deletionTimestamp"):
        return "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    return reason


def _restarts(pod: dict[str, Any]) -> str:
    statuses = get_path(pod, ".status.containerStatuses") or []
    return str(sum(int(s.get("restartCount") or 0) for s in statuses))


def _readiness_gates(pod: dict[str, Any]) -> str:
    gates = get_path(pod, ".spec.readinessGates") or []
    if not gates:
        return NONE
    true = {
        c.get("type")
        for c in get_path(pod, ".status.conditions") or []
        if c.get("status") == "True"
    }
    return f"{sum(1 for g in gates if g.get('conditionType') in true)}/{len(gates)}"


POD_COLUMNS = (
    Column(
        "Ready",
        _pod_ready,
        description="The aggregate readiness state of this pod for accepting traffic.",
    ),
    Column("Status", pod_status, description="The aggregate status of the containers in this pod."),
    Column(
        "Restarts",
        _restarts,
        description="The number of times the containers in this pod have been restarted.",
    ),
    AGE,
    Column("IP", _or_none(".status.podIP"), priority=1, description="IP address of the pod."),
    Column(
        "Node",
        _or_none(".spec.nodeName"),
        priority=1,
        description="Name of the node the pod is scheduled on.",
    ),
    Column(
        "Nominated Node",
        _or_none(".status.nominatedNodeName"),
        priority=1,
        description="Name of the node the pod is nominated to by preemption.",
    ),
    Column(
        "Readiness Gates",
        _readiness_gates,
        priority=1,
        description="The pod's readiness gates that are true, of all.",
    ),
)


# --- services ------------------------------------------------------------------------------


def _service_type(service: dict[str, Any]) -> str:
    return str(get_path(service, ".spec.type") or "ClusterIP")


def _external_ip(service: dict[str, Any]) -> str:
    spec = service.get("spec") or {}
    kind = _service_type(service)
    if kind == "ExternalName":
        return str(spec.get("externalName") or NONE)
    addresses = list(spec.get("externalIPs") or [])
    if kind == "LoadBalancer":
        ingress = get_path(service, ".status.loadBalancer.ingress") or []
        addresses = [i.get("ip") or i.get("hostname") for i in ingress] + addresses
        return ",".join(addresses) or "<pending>"
    return ",".join(addresses) or NONE


def _ports(service: dict[str, Any]) -> str:
    ports = []
    for port in get_path(service, ".spec.ports") or []:
        node_port = f":{port['nodePort']}" if port.get("nodePort") else ""
        ports.append(f"{port.get('port')}{node_port}/{port.get('protocol', 'TCP')}")
    return ",".join(ports) or NONE


def _service_selector(service: dict[str, Any]) -> str:
    selector = get_path(service, ".spec.selector") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items())) or NONE


SERVICE_COLUMNS = (
    Column("Type", _service_type, description="The type of the service."),
    Column("Cluster-IP", _or_none(".spec.clusterIP"), description="The IP address of the service."),
    Column("External-IP", _external_ip, description="The external IPs of the service."),
    Column("Port(s)", _ports, description="The ports the service exposes."),
    AGE,
    Column(
        "Selector", _service_selector, priority=1, description="The pods the service routes to."
    ),
)

NAMESPACE_COLUMNS = (
    Column("Status", _or_none(".status.phase"), description="The phase of the namespace."),
    AGE,
)

BUILTIN_COLUMNS: dict[tuple[str, str], tuple[Column, ...]] = {
    ("apps", "deployments"): DEPLOYMENT_COLUMNS,
    ("apps", "replicasets"): REPLICASET_COLUMNS,
    ("apps", "statefulsets"): STATEFULSET_COLUMNS,
    ("", "pods"): POD_COLUMNS,
    ("", "services"): SERVICE_COLUMNS,
    ("", "namespaces"): NAMESPACE_COLUMNS,
}
