"""Projector fits in any loop: one fit or refit check (:class:`~.projector_fitting.ProjectorFit`) and the gradient
passes over batches a caller hands in."""
