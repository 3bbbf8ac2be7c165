#!/usr/bin/env bash
# The README's test command: install, then run the whole test suite (CPU: about 12 minutes on a 2-core AVX-512 CPU after
# installing; more where torch has only AVX2 kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
