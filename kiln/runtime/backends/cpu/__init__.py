"""kiln's own CPU kernels (csrc/) and the backend built on them."""
