"""The host-optimizer seam: which user optimizers the engine takes over and how it steps their tensors
(:mod:`~lightning_offload.engine.rules.host_rule`). Every other module of this package is one rule, registered when
the package is imported: Adam/AdamW (:mod:`~lightning_offload.engine.rules.adam`) and Lion
(:mod:`~lightning_offload.engine.rules.lion`). A new host optimizer is a new module here."""

import importlib
import pkgutil

# Each rule registers itself when imported; the seam's own module is imported by the rules themselves.
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "host_rule":
        importlib.import_module(f"{__name__}.{_module.name}")
