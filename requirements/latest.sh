#!/usr/bin/env bash
# make test-latest: the suite in a venv of its own (.venv-latest) with the newest release of every
# dependency, upper bounds ignored (requirements/latest.py lists the few kept, and why). It says
# which releases the bounds exclude, so that a new release that breaks us fails here, named, and
# not in a fresh clone. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-latest
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --require-hashes --no-deps -r requirements/bootstrap.txt
"$VENV/bin/pip" install -q packaging  # what latest.py reads the requirements with
"$VENV/bin/python" requirements/latest.py install
status=0
"$VENV/bin/pytest" -q "$@" || status=$?
"$VENV/bin/python" requirements/latest.py report
exit "$status"
