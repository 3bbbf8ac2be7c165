"""What a run leaves behind: its record (history, summary, log) and the figures drawn from a sweep's records."""
