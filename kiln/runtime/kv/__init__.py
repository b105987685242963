"""The paged KV cache: the block pool with its prefix cache, per-request block tables, and
the attention metadata a step hands the kernels."""
