"""MEFT: wide sparse adapters beside each FFN whose weights and Adam state live on the host."""
