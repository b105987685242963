"""How the engine runs one model: context, chunking, KV budget, batching."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.runtime.drafting.config import SpeculativeConfig

# Running requests past which greedy requests stop drafting on the CPU, where a step of many
# rows is bound by compute: drafting editing prompts gained 1.34x at 4 streams, 1.20x at 8,
# 1.00x at 16, where free writing lost 11 % (bench/results/20261207-spec-engine-rounds.txt)
CPU_DRAFT_BATCH_LIMIT = 8


def round_up_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs one model: context, chunking, KV budget, batching."""

    ctx_len: int
    prefill_chunk_len: int
    kv_cache_tokens: int
    block_size: int = 16
    max_num_seqs: int = 64
    # The most tokens one step computes (vLLM's --max-num-batched-tokens), never less than a
    # prefill chunk beside a token for every running request; 0: just that.
    max_num_batched_tokens: int = 0
    device: str = "cpu"
    use_triton: bool = False  # CUDA: True; on CPU only under TRITON_INTERPRET (tests)
    cuda_graphs: bool = False  # CUDA graphs: decode, pieces (CUDA, unless --enforce-eager)
    kv_bytes_per_token: int = 0  # the KV cache's memory per token (0: not told)
    speculative: SpeculativeConfig | None = None  # drafting (--speculative); None: off
    # Launch step n + 1 before reading step n's tokens where its rows allow (vLLM's
    # --async-scheduling): hides the host's part of a step behind the device's
    async_scheduling: bool = False
    # What decides a reply's bits besides the weights: the backend's `numerics` (device,
    # dtype, kernel variant), named by every reply's system_fingerprint ("": not told)
    numerics: str = ""

    @staticmethod
    def build(model_ctx: int, model_max_prefill: int, *, ctx_len: int | None = None,
              prefill_chunk_len: int | None = None, kv_cache_tokens: int | None = None,
              **kw) -> EngineConfig:
        """Apply the contract's rules: --ctx-len is raised to 512 and capped at the model's;
        --prefill-chunk-len is raised to 512 and rounded up to a power of two."""
        ctx = min(max(ctx_len or model_ctx, 512), model_ctx)
        chunk = round_up_pow2(max(prefill_chunk_len, 512)) if prefill_chunk_len else \
            model_max_prefill
        kv = kv_cache_tokens or max(4 * ctx, 16384)
        return EngineConfig(ctx_len=ctx, prefill_chunk_len=chunk, kv_cache_tokens=kv, **kw)

    @property
    def num_blocks(self) -> int:
        return -(-self.kv_cache_tokens // self.block_size)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"--max-num-batched-tokens {self.max_num_batched_tokens} must be "
                             "positive")

    @property
    def draft_batch_limit(self) -> int:
        """Running requests past which those whose replies drafting cannot change do not
        draft (0: no limit): --speculative-disable-by-batch-size, or the device's (the CPU's
        from its measurement; none on CUDA, where nothing has measured one)."""
        spec = self.speculative
        if spec is None:
            return 0
        if spec.disable_by_batch_size is not None:
            return spec.disable_by_batch_size
        return CPU_DRAFT_BATCH_LIMIT if self.device == "cpu" else 0

    @property
    def token_budget(self) -> int:
        """A chunk always fits beside the decode rows, so no prompt waits on them forever."""
        return max(self.max_num_batched_tokens, self.prefill_chunk_len + self.max_num_seqs)
