"""One step of the engine: the orchestrator over the slots, the hooks that route gradients, the global norm and
clipping, every host job (speculative or not), the device↔host pipeline and the reductions between ranks."""
