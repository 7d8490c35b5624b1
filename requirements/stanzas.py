"""Small pieces of `make lock` (requirements/lock.sh) that pip-compile does not do.

python requirements/stanzas.py LOCK NAME... [--header LINE]
    the pinned, hashed entries of NAME... copied out of LOCK (the bootstrap file)
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


def stanzas(lock: Path, names: list[str]) -> str:
    """Each ``name==version \\`` line with its ``--hash`` continuation lines."""
    wanted = {n.lower() for n in names}
    out, keep = [], False
    for line in lock.read_text().splitlines():
        if line and not line[0].isspace():  # a requirement or a comment starts a stanza
            keep = re.split(r"[=<>!~ ;#]", line, maxsplit=1)[0].lower() in wanted
            if keep:
                out.append(line)
        elif keep and line.lstrip().startswith("--hash"):
            out.append(line)
    found = {re.split(r"==", s, maxsplit=1)[0].lower() for s in out if not s[0].isspace()}
    if found != wanted:
        sys.exit(f"stanzas.py: {sorted(wanted - found)} not in {lock}")
    return "\n".join(out) + "\n"


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
    args = parser.parse_args()
    print("# Written by `make lock` (requirements/lock.sh): do not edit.")
    for line in args.header:
        print(line)
    if args.hash_of:
        sys.stdout.write(hashed(args.hash_of))
    else:
        sys.stdout.write(stanzas(args.lock, args.names))


if __name__ == "__main__":
    main()
