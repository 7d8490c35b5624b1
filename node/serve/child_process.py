"""What every process the supervisor starts does first."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
LOG_FORMAT = "%(asctime)s %(levelname)s [{name} pid %(process)d] %(name)s: %(message)s"


def setup_child(name: str, log_level: str, supervisor_pid: int) -> None:
    """Logging tagged with the process's role; die with the supervisor; leave Ctrl-C to it.

    A terminal's Ctrl-C signals the whole process group; the supervisor turns it into a
    drain, so children ignore it. SIGTERM (the supervisor's stop) ends a child. If the
    supervisor is killed outright, the kernel kills the children too (Linux), so that no
    orphan keeps the port or the accelerator.
    """
    logging.basicConfig(
        level=log_level.upper(),
        format=LOG_FORMAT.format(name=name),
        stream=sys.stderr,
        force=True,
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:
        os.kill(supervisor_pid, 0)
    except ProcessLookupError:
        # The supervisor died before the death signal was armed.
        os._exit(1)
