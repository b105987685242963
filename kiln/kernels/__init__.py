"""Triton kernels, each beside its launcher and its plain-torch reference.

The paged KV layout shared by every kernel and by runtime/:

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], one pair per layer
    block_tables:           [num_seqs, max_blocks_per_seq] int32, physical block ids, -1 padded
    slot_mapping:           [num_tokens] int64, block_id * block_size + offset, -1 = do not store

On CUDA tensors the runtime calls the Triton kernel; on CPU tensors the reference.
"""

import os

BLOCK_SIZE = 16

# Triton's interpreter (CPU tensors, the tests): launchers pick what suits numpy there; what
# they pick otherwise is what a GPU runs (and what kernels/aot.py compiles, on CPU tensors).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
