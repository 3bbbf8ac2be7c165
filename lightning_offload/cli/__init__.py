"""The product around the strategies: ``lightning-offload-train`` (Hydra), and the offload policies and comparison
methods it sweeps. The benchmark scripts run through the same ``train(cfg)`` (``scripts/benchmark_run.py``)."""
