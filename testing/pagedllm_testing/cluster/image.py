"""What stands in for the project's image on the process kubelet's nodes: the host's files (the
virtual environment running this, where the image has `pagedllm`, first on PATH) and the ENV
lines of manifests/Dockerfile, its CPU kernels built once on this machine and shared by every
pod, as the image's build step builds them once."""

from __future__ import annotations

import sys
from pathlib import Path

BIN_DIR = Path(sys.executable).parent
IMAGE_ENV = {"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def image_env() -> dict[str, str]:
    """The image's ENV, with the folder of the CPU kernels (built now if they are not)."""
    from pagedllm.kernels import cpu_extension  # torch: only where pods are to run

    if not cpu_extension.load():
        raise RuntimeError("the CPU kernels did not build")
    return {**IMAGE_ENV, cpu_extension.KERNEL_DIR_ENV: str(cpu_extension.build_dir().parent)}
