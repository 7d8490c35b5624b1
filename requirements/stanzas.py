"""Small pieces of `make lock` (requirements/lock.sh) that pip-compile does not do.

python requirements/stanzas.py LOCK NAME... [--header LINE]
    the pinned, hashed entries of NAME... copied out of LOCK (the bootstrap file)
python requirements/stanzas.py --without-cuda LOCK
    LOCK less torch and the CUDA libraries and Triton that PyPI's torch brings (the CPU image's
    set, which takes torch's CPU build from PyTorch's index)
python requirements/stanzas.py --hash-of REQUIREMENT
    REQUIREMENT==VERSION downloaded without its dependencies, as a hashed entry
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def _blocks(lock: Path) -> list[tuple[str, list[str], set[str]]]:
    """Each stanza of a pip-compile output: (name, its requirement and hash lines, the names
    it is required by: its ``# via`` lines, constraint files left out)."""
    blocks: list[tuple[str, list[str], set[str]]] = []
    for line in lock.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            blocks.append((re.split(r"[=<>!~ ;]", line, maxsplit=1)[0].lower(), [line], set()))
        elif blocks and line.lstrip().startswith("--hash"):
            blocks[-1][1].append(line)
        elif blocks and line.startswith("    #   ") and not line.lstrip("# ").startswith("-"):
            blocks[-1][2].add(re.split(r"[ \[(]", line.lstrip("# "), maxsplit=1)[0].lower())
    return blocks


def stanzas(lock: Path, names: list[str]) -> str:
    """Each ``name==version \\`` line with its ``--hash`` continuation lines."""
    wanted = {n.lower() for n in names}
    kept = [(name, lines) for name, lines, _ in _blocks(lock) if name in wanted]
    missing = wanted - {name for name, _ in kept}
    if missing:
        sys.exit(f"stanzas.py: {sorted(missing)} not in {lock}")
    return "".join("\n".join(lines) + "\n" for _, lines in kept)


def without_cuda(lock: Path) -> str:
    """``lock`` less torch and the CUDA libraries (``nvidia-*``, ``cuda-*``) that only torch or
    another of them requires: what PyPI's torch brings and its CPU build does without. The
    rest of torch's requirements (sympy, networkx, ...) stay: the CPU build needs them too."""
    blocks = _blocks(lock)
    dropped = {"torch"}
    while True:
        more = {
            n
            for n, _, via in blocks
            if n.startswith(("nvidia-", "cuda-")) and n not in dropped and via <= dropped
        }
        if not more:
            break
        dropped |= more
    return "".join("\n".join(lines) + "\n" for name, lines, _ in blocks if name not in dropped)


def hashed(requirement: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, requirement],
            check=True,
            cwd=tmp,  # -m puts the working directory first: the root's operator/ would shadow
        )
        (wheel,) = Path(tmp).iterdir()
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return f"{requirement} \\\n    --hash=sha256:{digest}\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lock", nargs="?", type=Path)
    parser.add_argument("names", nargs="*")
    parser.add_argument("--header", action="append", default=[])
    parser.add_argument("--hash-of")
    parser.add_argument("--without-cuda", action="store_true")
    args = parser.parse_args()
    print("# Written by `make lock` (requirements/lock.sh): do not edit.")
    for line in args.header:
        print(line)
    if args.hash_of:
        sys.stdout.write(hashed(args.hash_of))
    elif args.without_cuda:
        sys.stdout.write(without_cuda(args.lock))
    else:
        sys.stdout.write(stanzas(args.lock, args.names))


if __name__ == "__main__":
    main()
