"""LightningModules for the tasks the CLI trains: causal language modelling (and closed-book QA) and sequence
classification."""
