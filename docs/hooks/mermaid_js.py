"""The site's copy of mermaid.js, which draws its diagrams: installed, not committed. Installing is
a set-up step (``python docs/hooks/mermaid_js.py``, run by ``make test`` and ``make docs``
before anything builds the site): npm fetches the pinned package (``npm pack``, through whatever
registry npm is configured for), the tarball is checked against the pinned integrity hash, and
its ``dist/mermaid.min.js`` is kept in the cache directory. Building the site only reads that
copy, so the docs tests reach nothing beyond the machine. The theme would otherwise load mermaid
from a CDN, which an offline reader does not reach; the site loads nothing from the internet.
Its MIT licence is ``docs/javascripts/mermaid.LICENSE``, beside the copy in the built site."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

from pagedllm.cache import cache_root, cached_dir

PACKAGE = "mermaid"
VERSION = "11.12.0"
# npm's ``dist.integrity`` of mermaid 11.12.0 (the registry's, and the tarball's own sha512).
INTEGRITY = (
    "sha512-ZudVx73BwrMJfCFmSSJT84y6u5brEoV8DOItdHomNLz32uBjNrelm7mg95X7g+C6UoQH/W6mBLGDEDv73JdxBg"
    "=="
)
MEMBER = "package/dist/mermaid.min.js"
SITE_PATH = "javascripts/mermaid.min.js"  # where the pages load it from (mkdocs.yml)


def integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def fetch(folder: Path) -> Path:
    """The package's tarball, packed by npm into ``folder``."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            f"building the site needs npm, to install {PACKAGE} {VERSION} (its diagrams)"
        )
    packed = subprocess.run(
        [npm, "pack", f"{PACKAGE}@{VERSION}", "--json", "--pack-destination", str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if packed.returncode != 0:
        raise RuntimeError(f"npm pack {PACKAGE}@{VERSION} failed: {packed.stderr[-2000:]}")
    return folder / json.loads(packed.stdout)[0]["filename"]


def unpack(folder: Path) -> None:
    """``mermaid.min.js`` of the pinned package, checked, written into ``folder``."""
    tarball = fetch(folder)
    data = tarball.read_bytes()
    if integrity(data) != INTEGRITY:
        raise RuntimeError(
            f"{tarball.name}: integrity {integrity(data)}, not the pinned {INTEGRITY}"
        )
    with tarfile.open(tarball) as archive:
        member = archive.extractfile(MEMBER)
        assert member is not None, MEMBER
        (folder / "mermaid.min.js").write_bytes(member.read())
    tarball.unlink()


def target() -> Path:
    return cache_root() / "docs" / f"{PACKAGE}-{VERSION}"


def install() -> Path:
    """``mermaid.min.js`` of the pinned version, installed into the cache once."""
    return cached_dir(target(), unpack, marker="mermaid.min.js") / "mermaid.min.js"


def installed() -> Path:
    """The installed ``mermaid.min.js``; a clear error if the set-up step has not run."""
    path = target() / "mermaid.min.js"
    if not path.exists():
        raise RuntimeError(
            f"{PACKAGE} {VERSION} is not installed: run `python docs/hooks/mermaid_js.py` "
            "(make test and make docs do)"
        )
    return path


if __name__ == "__main__":
    print(install())
