"""The set-up every face shares, with no Lightning in it: the settings, the projection plan, where embeddings and the
head train, building the engine, the engine driven by a loop that steps it, and the report port the run's reporting
reads. The faces (:mod:`lightning_offload.faces`) are the ways a user's loop reaches it."""
