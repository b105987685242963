"""Shared fixtures. Without CUDA, Triton kernels run in the interpreter on CPU tensors."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined (i.e. before kernels/ is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# As `kiln serve` runs on the CPU: the kernels bring their own threads, torch keeps one.
torch.set_num_threads(1)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path to the default model's GGUF, pulled into the model cache on first use."""
    from kiln.runtime.store.pull import ensure_model

    return str(ensure_model("smollm2:135m"))


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """The default model, loaded once per test session (as `kiln serve` loads it on a CPU)."""
    from kiln.runtime.models.loader import load_model

    return load_model("smollm2:135m")


@pytest.fixture
def make_engine(smollm2):
    """Build an LLMEngine on the shared model with a given KV budget and batch size."""
    from kiln.runtime.engine.config import EngineConfig
    from kiln.runtime.engine.llm_engine import LLMEngine

    def build(kv_cache_tokens: int = 16384, max_num_seqs: int = 64, ctx_len: int | None = None,
              prefill_chunk_len: int | None = None, model=None):
        m = model or smollm2
        cfg = EngineConfig.build(m.ctx_len, m.max_prefill_len, ctx_len=ctx_len,
                                 prefill_chunk_len=prefill_chunk_len,
                                 kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs)
        return LLMEngine(m, cfg)

    return build


def run_to_completion(engine, requests):
    """Add the requests, step until all finish; returns {request_id: [token ids]}."""
    for r in requests:
        engine.add_request(r)
    out = {r.request_id: [] for r in requests}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        steps += 1
        assert steps < 100000
    return out


def run_with_logprobs(engine, requests) -> dict[str, list[tuple[int, float]]]:
    """Step until the requests (which ask for logprobs) finish: {request_id: [(token id,
    its logprob), ...]}."""
    for r in requests:
        engine.add_request(r)
    out = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += [(lp.token_id, lp.logprob) for lp in o.new_logprobs]
    return out


def make_request(engine, request_id: str, prompt, sampling, *, grammar=None,
                 grammar_prefix: str = "", prefill_leader: str | None = None, **options):
    """engine.make_request with the request's options as keywords (max_tokens=8, ...)."""
    from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions

    return engine.make_request(request_id, EngineRequest(
        prompt, sampling, RequestOptions(**options), grammar=grammar,
        grammar_prefix=grammar_prefix, prefill_leader=prefill_leader))


@pytest.fixture(params=["default", 1, 4])
def rows_per_program(request, monkeypatch):
    """For the layer kernels' tests: the launchers' own rows (or tokens) a program (one on a
    GPU, many in the interpreter), one (what a GPU runs, here in the interpreter) and four
    (tiles the rows only part fill)."""
    from kiln.kernels import activation as activation_module
    from kiln.kernels import kv_cache as kv_cache_module
    from kiln.kernels import rms_norm as rms_norm_module

    if request.param != "default":
        monkeypatch.setattr(rms_norm_module, "ROWS_PER_PROGRAM", request.param)
        monkeypatch.setattr(kv_cache_module, "TOKENS_PER_PROGRAM", request.param)
        monkeypatch.setattr(activation_module, "TOKENS_PER_PROGRAM", request.param)
