"""Where lightning_offload keeps what it makes once and reuses: converted models, tokenised data, built kernels.

At the bottom of the package's layers, since every layer keeps something there: the projection and row Adam kernels
built for this machine (lsp/, engine/), the planner's calibration, the models and tokenised data.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable that overrides the cache root for models, tokenised data and built kernels.
CACHE_ENV_VAR = "LIGHTNING_OFFLOAD_CACHE"


def cache_root() -> Path:
    """Returns the root directory for cached models, tokenised data and built kernels.

    ``$LIGHTNING_OFFLOAD_CACHE`` when set, else ``~/.cache/lightning_offload``. The directory is not
    created here.
    """
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_offload"
