#!/usr/bin/env bash
# The README's test command: install, then run the whole test suite (CPU: about 16 minutes on 2 cores after installing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
