"""Rows stepped on the host: the one row Adam (:mod:`.block_row_adam`), how it drives torch's fused kernel and its
native one, the decay idle rows owe, and MEFT's row gradients landing during backward."""
