#!/usr/bin/env bash
# One-shot check of the Triton kernels on a CUDA machine where nothing can be installed:
# the kernel tests compiled for the GPU, the ahead-of-time compile table (registers, spills,
# shared memory of every kernel configuration for sm_80/86/89/90, bench/kernels_aot.py) with
# this machine's Triton, then the bandwidth benchmark. Needs a Python with
# torch (CUDA) and triton; pytest is optional (without it only the benchmark runs, and it
# still checks the kernel's output against SDPA). pagedllm need not be installed: without it
# the checkout is put on PYTHONPATH as a tree of links laid out as the wheel lays it out.
#
#   bash bench/gpu_check.sh            # everything lands in gpu-out/ at the repository root
#   OUT=/some/dir bash bench/gpu_check.sh
#
# Exit status: 0 when the tests, the compile table and the benchmark all pass, else 1.
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)" || exit 1
OUT="${OUT:-$REPO/gpu-out}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)" || exit 1
cd "$REPO" || exit 1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

say() { echo "$*" | tee -a "$SUMMARY"; }

# The first python whose torch sees a GPU; else the first with torch and triton at all, so
# that the environment report below says what is missing.
PYTHON=""
for candidate in .venv/bin/python python3 python; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c "import sys, torch, triton; sys.exit(not torch.cuda.is_available())" \
        >/dev/null 2>&1; then
        PYTHON="$candidate"
        break
    fi
    if [[ -z "$PYTHON" ]] && "$candidate" -c "import torch, triton" >/dev/null 2>&1; then
        PYTHON="$candidate"
    fi
done
if [[ -z "$PYTHON" ]]; then
    say "no python with torch and triton found (tried .venv/bin/python, python3, python)"
    exit 1
fi

# The point is to compile the kernels for the GPU, not to interpret them.
unset TRITON_INTERPRET

# pagedllm from this checkout when the python has none installed: node/ is the package,
# kernels/ and operator/ its subpackages (pyproject's package-dir). Never the repository root
# itself: its operator/ would shadow the standard library's operator at start-up.
if ! "$PYTHON" -c "import pagedllm" >/dev/null 2>&1; then
    STAGE="$(mktemp -d)" && mkdir "$STAGE/pagedllm" || exit 1
    ln -s "$REPO"/node/* "$STAGE/pagedllm/" && ln -s "$REPO/kernels" "$REPO/operator" "$STAGE/pagedllm/"
    export PYTHONPATH="$STAGE${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    echo "python: $(command -v "$PYTHON")"
    "$PYTHON" - <<'EOF'
import sys

import torch
import triton

print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)
print("cuda available:", torch.cuda.is_available(), "torch cuda:", torch.version.cuda)
if torch.cuda.is_available():
    properties = torch.cuda.get_device_properties(0)
    print("device:", properties.name, "SMs:", properties.multi_processor_count,
          "memory GiB:", round(properties.total_memory / 2**30, 1))
EOF
    nvidia-smi 2>&1 || true
} >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "torch sees no CUDA device: nothing to check"
    exit 1
fi

status=0

if "$PYTHON" -c "import pytest" >/dev/null 2>&1; then
    # PYTHONSAFEPATH: -m must not put the repository root first on sys.path, where kernels/
    # would shadow Hugging Face's kernels distribution.
    PYTHONSAFEPATH=1 timeout 300 "$PYTHON" -m pytest tests/kernels/test_kernels.py -q -rfE \
        -p no:cacheprovider --junitxml="$OUT/test_kernels.xml" 2>&1 | tee "$OUT/test_kernels.log"
    tests=${PIPESTATUS[0]}
    if [[ $tests -eq 0 ]]; then
        say "tests: passed ($(tail -n 1 "$OUT/test_kernels.log"))"
    else
        say "tests: FAILED with status $tests ($(tail -n 1 "$OUT/test_kernels.log"))"
        status=1
    fi
else
    say "tests: skipped, this python has no pytest (the benchmark still checks outputs)"
fi

timeout 600 "$PYTHON" bench/kernels_aot.py --json "$OUT/kernels_aot.json" 2>&1 \
    | tee "$OUT/kernels_aot.txt"
aot=${PIPESTATUS[0]}
if [[ $aot -eq 0 ]]; then
    say "aot compile table: no compile errors, spills or shared-memory overruns ($(tail -n 1 "$OUT/kernels_aot.txt"))"
else
    say "aot compile table: FAILED with status $aot ($(tail -n 1 "$OUT/kernels_aot.txt"))"
    status=1
fi

timeout 240 "$PYTHON" bench/kernel_timings.py --output "$OUT/kernels.json" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
if [[ $bench -eq 0 ]]; then
    say "benchmark: ran, outputs agree with SDPA"
else
    say "benchmark: FAILED with status $bench (see bench.log)"
    status=1
fi
grep '^target' "$OUT/bench.log" >>"$SUMMARY" || true

echo "---- summary ($SUMMARY)"
cat "$SUMMARY"
exit "$status"
