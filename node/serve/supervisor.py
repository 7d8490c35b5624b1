"""`pagedllm serve`: start the node's processes, watch them, drain on SIGTERM.

Start-up: the supervisor checks the model and its tokenizer before anything starts, then
forks the workers and the scheduler, which inherit torch instead of each importing it again.
It forks before it starts any thread (ZeroMQ's included), so the children begin clean; should
CUDA already be initialized in the supervisor, they are spawned instead. The API servers,
which never need torch, start as fresh interpreters
(``python -m pagedllm.serve.api_server_process``), so that they hold none of it. Each child
reports ready on the supervisor's inbox; when all have, the API servers admit requests (until
then /health answers 503).

If any process dies, the node cannot go on (a missing rank stalls every step; a missing
scheduler answers nothing): the API servers are told to fail their in-flight requests with a
clear error, the rest is stopped, and the supervisor exits non-zero within seconds so that
Kubernetes restarts the pod.

SIGTERM (or Ctrl-C): the API servers stop admitting (/health turns 503, so the pod leaves the
Service) and finish what is in flight, for at most --shutdown-timeout. At that deadline every
request still in flight ends with an error saying so (streams with an error event and [DONE],
whole responses with a 503), and within a second the processes are stopped and the supervisor
exits 0: a shutdown that was asked for, as vLLM's is on SIGTERM. A second signal stops at once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch
import zmq

from pagedllm.ipc import sockets
from pagedllm.ipc.messages import (
    ApiServerIdle,
    Drain,
    DrainDeadline,
    NodeFailed,
    NodeReady,
    ProcessReady,
)
from pagedllm.models import ModelLoadError
from pagedllm.models.tokenizer import load_tokenizer
from pagedllm.runtime.child_process import LOG_FORMAT
from pagedllm.runtime.metrics import use_multiprocess_dir
from pagedllm.serve.api_server_process import ApiServerSpec, encode_spec
from pagedllm.serve.args import ServeArgs
from pagedllm.serve.scheduler_process import SchedulerSpec, run_scheduler
from pagedllm.serve.worker_process import WorkerSpec, run_worker

log = logging.getLogger(__name__)

# After a failure: time the API servers get to answer their clients with the error.
FAILURE_FLUSH_S = 0.5
# Time a process gets to exit after SIGTERM before it is killed.
TERMINATE_GRACE_S = 2.0
# Past --shutdown-timeout: time the API servers get to send their clients the error, then
# time each process gets to exit; together within the second the deadline promises.
DEADLINE_FLUSH_S = 0.5
DEADLINE_TERMINATE_GRACE_S = 0.3
POLL_MS = 100


class ChildProcess(Protocol):
    """What the supervisor needs of a child: multiprocessing's Process has it all."""

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class ApiServerProcess:
    """``python -m pagedllm.serve.api_server_process``, its spec written to its stdin, watched
    as a Process."""

    def __init__(self, spec: ApiServerSpec) -> None:
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.serve.api_server_process"],
            stdin=subprocess.PIPE,
            # Not the working directory first on sys.path: a folder there must not shadow a
            # module (Python 3.11+).
            env={**os.environ, "PYTHONSAFEPATH": "1"},
        )
        assert self._popen.stdin is not None
        try:
            with self._popen.stdin as stdin:
                stdin.write(encode_spec(spec))
        except BrokenPipeError:
            pass  # it died at once; the watch reports how
        # Readable once the process has exited, like a Process's sentinel.
        self.sentinel = os.pidfd_open(self._popen.pid)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; the exit status, or minus the signal that killed it."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def terminate(self) -> None:
        self._popen.terminate()

    def kill(self) -> None:
        self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Child:
    kind: str
    index: int
    process: ChildProcess

    @property
    def name(self) -> str:
        return f"{self.kind.replace('_', ' ')} {self.index}"


class NodeFailure(Exception):
    pass


class Supervisor:
    def __init__(self, args: ServeArgs) -> None:
        self.args = args
        self.paths = sockets.make_ipc_dir()
        use_multiprocess_dir(self.paths.metrics_dir)
        self.children: list[Child] = []
        self.signals = 0
        self.signalled_at = 0.0
        self.terminate_grace_s = TERMINATE_GRACE_S

    # ----- lifecycle -----------------------------------------------------------------------

    def run(self) -> int:
        try:
            self._start_children()
            self.ctx = zmq.Context()
            self.inbox = sockets.pull(self.ctx, self.paths.control)
            self.api_servers = [
                sockets.push(self.ctx, self.paths.api(i)) for i in range(self.args.api_server_count)
            ]
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
            if not self._wait_until_ready():
                return 0
            self._broadcast(NodeReady())
            log.info(
                "serving %s on http://%s:%d",
                self.args.model_names[0],
                self.args.host,
                self.args.port,
            )
            self._watch()
            self._drain()
            return 0
        except NodeFailure as failure:
            log.error("%s; stopping the node", failure)
            self._broadcast(NodeFailed(str(failure)))
            time.sleep(FAILURE_FLUSH_S)
            return 1
        finally:
            self._stop_children()
            if hasattr(self, "ctx"):
                self.ctx.destroy(linger=0)
            shutil.rmtree(self.paths.directory, ignore_errors=True)

    def _on_signal(self, signum: int, _: Any) -> None:
        self.signals += 1
        if self.signals == 1:
            self.signalled_at = time.monotonic()
            log.info(
                "%s: draining (up to %ss)", signal.Signals(signum).name, self.args.shutdown_timeout
            )
        else:
            log.info("%s again: stopping now", signal.Signals(signum).name)

    def _start_children(self) -> None:
        """The forked ones first: a fork must come before any thread, Popen needs not."""
        args, paths, pid = self.args, self.paths, os.getpid()
        plans: list[tuple[str, int, Any, Any]] = []
        for rank in range(args.engine.tensor_parallel_size):
            plans.append(
                (
                    "worker",
                    rank,
                    run_worker,
                    WorkerSpec(
                        args.engine,
                        args.model_dir,
                        rank,
                        paths,
                        args.log_level,
                        pid,
                        args.tokenizer_dir,
                    ),
                )
            )
        plans.append(
            (
                "scheduler",
                0,
                run_scheduler,
                SchedulerSpec(
                    args.engine,
                    args.eos_token_ids,
                    paths,
                    args.api_server_count,
                    args.max_waiting,
                    args.model_names[0],
                    args.log_level,
                    pid,
                    args.async_scheduling,
                    args.step_timeout,
                    args.tokenizer_dir,
                    args.lora_modules,
                    args.lora_shapes,
                    tuple(args.model_names),
                ),
            )
        )
        context = multiprocessing.get_context(_start_method())
        for kind, index, target, spec in plans:
            process = context.Process(target=target, args=(spec,), name=f"pagedllm-{kind}-{index}")
            process.start()
            self.children.append(Child(kind, index, process))
        for index in range(args.api_server_count):
            spec = ApiServerSpec(
                index,
                paths,
                args.model_dir,
                args.model_names,
                args.max_model_len,
                args.vocab_size,
                args.api_key,
                args.host,
                args.port,
                args.log_level,
                pid,
                args.api_server_nice,
                args.request_limits,
                tokenizer_dir=args.tokenizer_dir,
                chat=args.chat,
                otlp_traces_endpoint=args.otlp_traces_endpoint,
                lora_modules=args.lora_modules,
                runtime_lora_updates=args.runtime_lora_updates,
                # One API server watches the file: each change is one update of the scheduler.
                lora_modules_file=args.lora_modules_file if index == 0 else None,
            )
            self.children.append(Child("api_server", index, ApiServerProcess(spec)))

    def _wait_until_ready(self) -> bool:
        """True once every process reported ready; False if a signal came first."""
        waiting = {(c.kind, c.index) for c in self.children}
        while waiting:
            if self.signals:
                return False
            for message in self._poll():
                if isinstance(message, ProcessReady):
                    waiting.discard((message.kind, message.index))
        return True

    def _watch(self) -> None:
        while not self.signals:
            self._poll()

    def _drain(self) -> None:
        self._broadcast(Drain())
        busy = set(range(self.args.api_server_count))
        self._wait_until_idle(busy, self.signalled_at + self.args.shutdown_timeout)
        if not busy or self.signals >= 2:
            log.info("drained" if not busy else "stopping with requests in flight")
            return
        log.warning(
            "shutdown timeout: %d API servers still had requests in flight; ending them",
            len(busy),
        )
        self._broadcast(DrainDeadline(self.args.shutdown_timeout))
        self._wait_until_idle(busy, time.monotonic() + DEADLINE_FLUSH_S)
        self.terminate_grace_s = DEADLINE_TERMINATE_GRACE_S

    def _wait_until_idle(self, busy: set[int], until: float) -> None:
        """Until every API server in ``busy`` reported idle (each is removed as it does),
        ``until`` passed or a second signal came."""
        while busy and self.signals < 2 and time.monotonic() < until:
            for message in self._poll():
                if isinstance(message, ApiServerIdle):
                    busy.discard(message.index)

    # ----- watching ------------------------------------------------------------------------

    def _poll(self) -> list[Any]:
        """Messages that arrived within one poll interval; raises NodeFailure when a process
        has died or reported that the node cannot make progress."""
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        for child in self.children:
            poller.register(child.process.sentinel, zmq.POLLIN)
        try:
            poller.poll(POLL_MS)
        except zmq.ZMQError:
            pass  # interrupted by a signal
        received = []
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = sockets.parse(data, "supervisor")
            if isinstance(message, NodeFailed):  # a child says the node cannot go on
                raise NodeFailure(message.reason)
            if message is not None:
                received.append(message)
        dead = [c for c in self.children if c.process.exitcode is not None]
        if dead:
            raise NodeFailure("; ".join(_death(c) for c in dead))
        return received

    def _broadcast(self, message: Any) -> None:
        for sock in getattr(self, "api_servers", []):
            sockets.send(sock, message)

    def _stop_children(self) -> None:
        """API servers first (they finish their responses), then the engine processes."""
        for kinds in (("api_server",), ("scheduler", "worker")):
            group = [c for c in self.children if c.kind in kinds and c.process.is_alive()]
            for child in group:
                child.process.terminate()
            deadline = time.monotonic() + self.terminate_grace_s
            for child in group:
                child.process.join(max(0.0, deadline - time.monotonic()))
                if child.process.is_alive():
                    log.warning("%s did not stop; killing it", child.name)
                    child.process.kill()
                    child.process.join()


def _start_method() -> str:
    """Fork, unless CUDA is already initialized here (it does not survive a fork): then the
    children start afresh and re-import everything."""
    return "spawn" if torch.cuda.is_initialized() else "fork"


def _death(child: Child) -> str:
    code = child.process.exitcode or 0
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"{child.name} (pid {child.process.pid}) {how}"


def serve(args: ServeArgs) -> NoReturn:
    """Run the node until it stops, then exit the process with its status."""
    code = _serve(args)
    logging.shutdown()
    sys.stdout.flush()
    # Without the interpreter's teardown, which takes seconds of CPU over torch's modules and
    # has nothing left to close (the children are stopped, the IPC directory is gone): the node
    # exits as soon as it is done.
    os._exit(code)


def _serve(args: ServeArgs) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format=LOG_FORMAT.format(name="supervisor"), stream=sys.stderr
    )
    try:
        # Checked here, so that a model without a usable tokenizer stops the node at once;
        # each API server loads its own.
        load_tokenizer(args.tokenizer_dir)
    except ModelLoadError as error:
        log.error("%s", error)
        return 2
    return Supervisor(args).run()
