"""`python scripts/train.py [overrides]`: the same command as `lightning-offload-train` (see the README)."""

from lightning_offload.cli.train import main

if __name__ == "__main__":
    main()
