"""Lightning strategies around the offload engine: ``lsp_offload`` and ``zero_offload`` on one device, their DDP forms,
and where each strategy trains embeddings and the output head."""
