"""Where the node's ZeroMQ sockets live, and how they are opened.

Every process binds the one PULL socket it reads from and connects PUSH sockets to the
processes it writes to, so start-up order does not matter: ZeroMQ queues what is sent before
the peer binds. The sockets are unix sockets in a private directory of the pod.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

import zmq

from pagedllm.ipc import messages
from pagedllm.ipc.codec import WireError

log = logging.getLogger(__name__)

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
_LONGEST_NAME = "api-999"


@dataclass(frozen=True)
class IpcPaths:
    directory: str

    def _address(self, name: str) -> str:
        return f"ipc://{self.directory}/{name}"

    @property
    def requests(self) -> str:
        """Scheduler's inbox: requests from the API servers."""
        return self._address("requests")

    @property
    def results(self) -> str:
        """Scheduler's inbox: step results from worker rank 0."""
        return self._address("results")

    @property
    def control(self) -> str:
        """Supervisor's inbox: ready and idle reports."""
        return self._address("control")

    def plans(self, rank: int) -> str:
        """Worker ``rank``'s inbox: step plans."""
        return self._address(f"plans-{rank}")

    def api(self, index: int) -> str:
        """API server ``index``'s inbox: outputs from the scheduler, orders from the
        supervisor."""
        return self._address(f"api-{index}")

    @property
    def dist_init_file(self) -> str:
        """torch.distributed's rendezvous file for the tensor-parallel workers."""
        return os.path.join(self.directory, "dist-init")

    @property
    def metrics_dir(self) -> str:
        return os.path.join(self.directory, "metrics")


def make_ipc_dir() -> IpcPaths:
    """A private (0700) directory for this node's sockets, short enough for unix socket paths:
    under $TMPDIR when that is short, else under /tmp."""
    directory = tempfile.mkdtemp(prefix="pagedllm-")
    if len(f"{directory}/{_LONGEST_NAME}") > MAX_SOCKET_PATH:
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix="pagedllm-", dir="/tmp")
    return IpcPaths(directory)


def _configure(sock: zmq.Socket) -> zmq.Socket:
    # Unlimited queues: a slow reader must never make a sender block or drop a message.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def pull(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = _configure(ctx.socket(zmq.PULL))
    sock.bind(address)
    return sock


def push(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = _configure(ctx.socket(zmq.PUSH))
    sock.connect(address)
    return sock


def send(sock: zmq.Socket, message: messages.Message) -> None:
    sock.send(messages.encode(message), copy=False)


def parse(data: bytes, where: str) -> messages.Message | None:
    """The message in ``data``, or None (logged) when it is malformed or unknown."""
    try:
        return messages.decode(data)
    except WireError as error:
        log.warning("%s: dropped a malformed message (%d bytes): %s", where, len(data), error)
        return None
