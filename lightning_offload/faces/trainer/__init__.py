"""Lightning's Trainer: the strategies ``lsp_offload``, ``zero_offload``, ``meft_offload`` and the DDP forms, the
projector refit callback, and the Trainer-only helpers they use."""
