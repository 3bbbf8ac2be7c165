"""What the engine reports: per-step telemetry, each step's timeline and figures, the phase clock of benchmarks, and
the record of a projector fit."""
