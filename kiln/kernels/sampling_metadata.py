"""What the fused sampler (kernels/sampling.py) and its torch reference (kernels/sampling_ref.py)
take and give: one step's per-row settings, validated where they are built, and the output."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingMetadata:
    """Per-step sampling settings, one row per sequence; tensors on the logits' device."""

    temperature: torch.Tensor                # [B] float32; 0 = greedy
    top_k: torch.Tensor                      # [B] int32; 0 (or >= vocab) = off; 1 = greedy
    top_p: torch.Tensor                      # [B] float32 in (0, 1]; 1.0 = off
    min_p: torch.Tensor                      # [B] float32 in [0, 1]; 0.0 = off
    repetition_penalty: torch.Tensor         # [B] float32 > 0; 1.0 = off
    frequency_penalty: torch.Tensor          # [B] float32
    presence_penalty: torch.Tensor           # [B] float32
    window_token_ids: torch.Tensor | None    # [B, W] int64, -1 padded; None = no penalties
    seeds: torch.Tensor                      # [B] int64: the row's random stream
    offsets: torch.Tensor                    # [B] int64: the row's step within it (< 2**32)
    grammar_bitmask: torch.Tensor | None     # [B, ceil(V / 32)] int32; None = no grammar
    num_top_logprobs: int = 0                # 0..20
    bias_token_ids: torch.Tensor | None = None   # [B, L] int64, -1 padded; None = no bias
    bias_values: torch.Tensor | None = None      # [B, L] float32 added to those logits
    # Batch-wide flags: has_top_k, has_top_p, has_min_p, all_greedy (the torch reference
    # skips what no row uses). The runtime knows them from the host-side settings and passes
    # them; left None they are read off the tensors (validated too), at one device sync.
    flags: tuple[bool, bool, bool, bool] | None = None
    # The kernel's constexprs: a batch without penalties or grammar pays nothing for them.
    has_penalties: bool = field(init=False)
    has_grammar: bool = field(init=False)
    has_top_k: bool = field(init=False)
    has_top_p: bool = field(init=False)
    has_min_p: bool = field(init=False)
    all_greedy: bool = field(init=False)

    def __post_init__(self):
        if not 0 <= self.num_top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"num_top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, "
                             f"got {self.num_top_logprobs}")
        if (self.bias_token_ids is None) != (self.bias_values is None):
            raise ValueError("bias_token_ids and bias_values come together")
        # logit_bias rides on the penalty step: same scratch row, same constexpr.
        self.has_penalties = self.window_token_ids is not None or self.bias_token_ids is not None
        self.has_grammar = self.grammar_bitmask is not None
        if self.flags is not None:
            self.has_top_k, self.has_top_p, self.has_min_p, self.all_greedy = self.flags
            return
        sampled = (self.temperature > 0) & (self.top_k != 1)
        valid = ((self.temperature >= 0) & (self.top_k >= 0) & (self.top_p > 0)
                 & (self.top_p <= 1) & (self.min_p >= 0) & (self.min_p <= 1)
                 & (self.repetition_penalty > 0))
        flags = torch.stack([  # one host sync for all flags
            valid.all(), (sampled & (self.top_k > 1)).any(), (sampled & (self.top_p < 1)).any(),
            (sampled & (self.min_p > 0)).any(), ~sampled.any(),
        ]).tolist()
        if not flags[0]:
            raise ValueError("sampling settings out of range: need temperature >= 0, top_k >= 0, "
                             "0 < top_p <= 1, 0 <= min_p <= 1, repetition_penalty > 0")
        self.has_top_k, self.has_top_p, self.has_min_p, self.all_greedy = flags[1:]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor       # [B] int64
    logprobs: torch.Tensor        # [B] float32: raw log_softmax(logits)[token]
    top_token_ids: torch.Tensor   # [B, N] int64, descending logprob
    top_logprobs: torch.Tensor    # [B, N] float32 raw log_softmax values
    # [B, V] float32, return_processed=True only (tests): what the draw saw. Sampled rows: the
    # filtered logits / temperature (-inf = cut); greedy rows: the penalised, masked logits.
    processed_logits: torch.Tensor | None = None


def check_inputs(logits: torch.Tensor, md: SamplingMetadata) -> None:
    assert logits.ndim == 2 and logits.stride(1) == 1, "logits must be [B, V], unit column stride"
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16), logits.dtype
    B, V = logits.shape
    for name, dtype in [("temperature", torch.float32), ("top_k", torch.int32),
                        ("top_p", torch.float32), ("min_p", torch.float32),
                        ("repetition_penalty", torch.float32), ("frequency_penalty", torch.float32),
                        ("presence_penalty", torch.float32), ("seeds", torch.int64),
                        ("offsets", torch.int64)]:
        t = getattr(md, name)
        assert t.shape == (B,) and t.dtype == dtype and t.is_contiguous(), (name, t.shape, t.dtype)
        assert t.device == logits.device, (name, t.device)
    if md.window_token_ids is not None:
        w = md.window_token_ids
        assert w.ndim == 2 and w.shape[0] == B and w.dtype == torch.int64 and w.stride(1) == 1
    if md.bias_token_ids is not None:
        ids, vals = md.bias_token_ids, md.bias_values
        assert ids.ndim == 2 and ids.shape[0] == B and ids.dtype == torch.int64
        assert vals.shape == ids.shape and vals.dtype == torch.float32
        assert ids.stride() == vals.stride() and ids.stride(1) == 1
    if md.grammar_bitmask is not None:
        g = md.grammar_bitmask
        assert g.shape == (B, triton.cdiv(V, 32)) and g.dtype == torch.int32 and g.stride(1) == 1
