"""kiln's runtime: model loading, the paged KV cache, the scheduler and the engine."""
