"""A model's architecture hyper-parameters, read from its GGUF by the family's `read_config`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture hyper-parameters, read from the GGUF's metadata."""

    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int  # the context length the model was trained for
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_dim: int = 0  # the head values RoPE rotates (the first rope_dim); 0 = all of them
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU)
    embedding_scale: float = 1.0  # the token embedding is multiplied by it (Gemma: sqrt(hidden))
    # Gemma 3
    rope_local_theta: float = 10000.0
    sliding_window: int = 0
    sliding_window_pattern: int = 0  # every N-th layer is global; 0 = all global
    final_logit_softcap: float = 0.0
    query_pre_attn_scalar: float = 0.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_is_local(self, layer: int) -> bool:
        """Gemma 3's local layers (all but every sliding_window_pattern-th): RoPE base
        rope_local_theta, and attention over the last sliding_window positions if set."""
        return bool(self.sliding_window_pattern) and (layer + 1) % self.sliding_window_pattern != 0

    def layer_sliding_window(self, layer: int) -> int:
        return self.sliding_window if self.layer_is_local(layer) else 0
