"""What every process the supervisor starts does first."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import sys
from types import FrameType

_PR_SET_PDEATHSIG = 1
LOG_FORMAT = "%(asctime)s %(levelname)s [{name} pid %(process)d] %(name)s: %(message)s"


# The signal the kernel sends a child when the supervisor dies (Linux): distinct from the
# supervisor's own SIGTERM, so that the child knows nobody is left to clean up after it.
SUPERVISOR_GONE = signal.SIGHUP


def setup_child(name: str, log_level: str, supervisor_pid: int, ipc_dir: str) -> None:
    """Logging tagged with the process's role; die with the supervisor; leave Ctrl-C to it.

    A terminal's Ctrl-C signals the whole process group; the supervisor turns it into a
    drain, so children ignore it. SIGTERM (the supervisor's stop) ends a child. If the
    supervisor is killed outright, the kernel signals the children (Linux), which remove the
    node's private directory (sockets, metrics files) that the supervisor would have removed
    and exit at once, so that no orphan keeps the port or the accelerator and nothing of the
    node is left behind.
    """
    logging.basicConfig(
        level=log_level.upper(),
        format=LOG_FORMAT.format(name=name),
        stream=sys.stderr,
        force=True,
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def supervisor_gone(signum: int, frame: FrameType | None) -> None:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        os._exit(1)

    signal.signal(SUPERVISOR_GONE, supervisor_gone)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, SUPERVISOR_GONE, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:
        os.kill(supervisor_pid, 0)
    except ProcessLookupError:
        # The supervisor died before the death signal was armed.
        supervisor_gone(SUPERVISOR_GONE, None)


def forbid_torch() -> None:
    """Keep torch out of this process, which computes nothing: its libraries alone are some
    170 MiB of resident memory.

    transformers imports torch whenever it is installed, though a tokenizer asked for lists
    never needs it; marked absent, torch is neither loaded by transformers nor by any stray
    import (which fails at once instead).
    """
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers' notice that it found no torch, which is on purpose here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
