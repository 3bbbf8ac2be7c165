"""The product around the strategies: ``lightning-offload-train`` (Hydra), the offload policies and comparison methods
it sweeps, and the benchmark harness built on the same ``train(cfg)``."""
