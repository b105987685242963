"""How many kernels one decode step launches on the GPU path, counted without a GPU: the
dense backend's forward on CPU tensors with the Triton kernels (in the interpreter), torch's
ops seen through its dispatcher (views and allocations launch nothing), plus the Triton
launches. At ~2.5 us a dependent kernel, the count is the batch-1 step's floor.

Per layer is measured, not assumed: a model of three layers against the same model of two.
The step is the CUDA graphs' one for a long context (kernels/attention.py's split-KV over the
whole context, so attention is two kernels: partitions, then their merge); where every row
fits one partition the graphs have a capture with attention in one kernel."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from tiny_gguf import llama_metadata, llama_tensors, write_gguf
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import interpreter

from kiln.kernels import BLOCK_SIZE, INTERPRET
from kiln.runtime.backends.dense import DenseBackend
from kiln.runtime.engine.piecewise_graphs import PiecewiseGraphs
from kiln.runtime.kv.attention_metadata import AttentionMetadata
from kiln.runtime.models.loader import ARCHITECTURES
from kiln.runtime.store.gguf_file import open_gguf

pytestmark = pytest.mark.skipif(not INTERPRET, reason="counts Triton's interpreted launches")

MAX_PER_LAYER = 12
MAX_FIXED = 6  # embedding (and Gemma's scale), the first norm, the LM head
CTX = 4096


class KernelCount(TorchDispatchMode):
    """The kernels a block of code launches: torch ops that are not views or allocations,
    and Triton launches (whose own argument copies in the interpreter are not counted)."""

    NOT_KERNELS = {"empty", "empty_like", "empty_strided", "lift_fresh", "detach", "detach_",
                   "alias"}

    def __init__(self):
        super().__init__()
        self.launches: collections.Counter = collections.Counter()
        self._in_triton = self._quiet = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (self._in_triton or self._quiet or func.is_view or name in self.NOT_KERNELS):
            self.launches[f"torch {name}"] += 1
        return func(*args, **(kwargs or {}))

    def as_one_launch(self, fn, name: str):
        """fn counted as one launch, whatever it runs: a CUDA graph's replay."""
        def replay(*args, **kwargs):
            self.launches[name] += 1
            self._quiet += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._quiet -= 1
        return replay

    def __enter__(self):
        run = self._run = interpreter.GridExecutor.__call__
        count = self

        def counted(executor, *args, **kwargs):
            if not count._quiet:
                count.launches[f"triton {executor.fn.__name__}"] += 1
            count._in_triton += 1
            try:
                return run(executor, *args, **kwargs)
            finally:
                count._in_triton -= 1

        interpreter.GridExecutor.__call__ = counted
        return super().__enter__()

    def __exit__(self, *exc):
        interpreter.GridExecutor.__call__ = self._run
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.launches.values())


def _tiny(arch: str, layers: int, vocab: int) -> tuple[str, dict, dict]:
    """(GGUF arch, metadata, tensors) of a tiny model with the family's features."""
    head_dim = 64  # hidden 128 over 2 heads: the smallest head attention takes
    meta = llama_metadata(layers=layers, heads=2, kv_heads=1, head_dim=head_dim)
    t = llama_tensors(vocab, layers=layers, heads=2, kv_heads=1, head_dim=head_dim)
    rng = np.random.default_rng(0)
    for i in range(layers):
        p = f"blk.{i}."
        if arch == "qwen2":
            for x, rows in (("q", 2), ("k", 1), ("v", 1)):
                t[p + f"attn_{x}.bias"] = rng.standard_normal(rows * head_dim, dtype=np.float32)
        if arch in ("qwen3", "gemma3"):
            for x in "qk":
                t[p + f"attn_{x}_norm.weight"] = np.ones(head_dim, dtype=np.float32)
        if arch == "gemma3":
            t[p + "post_attention_norm.weight"] = np.ones(128, dtype=np.float32)
            t[p + "post_ffw_norm.weight"] = np.ones(128, dtype=np.float32)
        if arch == "phi3":
            t[p + "attn_qkv.weight"] = np.concatenate([t.pop(p + f"attn_{x}.weight")
                                                       for x in "qkv"])
            t[p + "ffn_up.weight"] = np.concatenate([t.pop(p + "ffn_gate.weight"),
                                                     t[p + "ffn_up.weight"]])
    meta["vocab_size"] = vocab  # no tokenizer in the file
    if arch in ("qwen3", "gemma3"):
        meta["attention.key_length"] = meta["attention.value_length"] = head_dim
    if arch == "gemma3":
        meta["attention.sliding_window"] = 512
    return arch, meta, t


def _model_and_cache(path):
    gf = open_gguf(path)
    family = ARCHITECTURES[gf.arch]
    # the products as kiln serve runs them on CUDA by default: the batch-invariant matmul
    model = family.build(family.read_config(gf), gf,
                         DenseBackend("cpu", use_triton=True, batch_invariant=True))
    cfg = model.cfg
    num_blocks = 2 * CTX // BLOCK_SIZE
    return model, [model.backend.kv_cache(num_blocks, BLOCK_SIZE, cfg.num_kv_heads,
                                          cfg.head_dim) for _ in range(cfg.num_layers)]


def decode_step_kernels(path, max_seq_len: int = CTX) -> KernelCount:
    """The kernels of one decode step of two sequences (forward and LM head), as the graph
    captured for contexts up to max_seq_len runs it."""
    model, kv = _model_and_cache(path)
    num_blocks = 2 * CTX // BLOCK_SIZE
    seq_lens = torch.tensor([5, 40], dtype=torch.int32)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(2, -1)
    meta = AttentionMetadata(torch.tensor([0, 1, 2], dtype=torch.int32), seq_lens, tables,
                             torch.tensor([4, CTX + 39]), 1, max_seq_len)
    ids, positions = torch.tensor([11, 12]), torch.tensor([4, 39])
    with torch.inference_mode(), KernelCount() as count:
        model.compute_logits(model.forward(ids, positions, meta, kv))
    return count


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma3"])
def test_a_decode_step_launches_at_most_12_kernels_a_layer(arch, tmp_path):
    counts = []
    for layers in (2, 3):
        gguf_arch, meta, t = _tiny(arch, layers, 512)
        path = write_gguf(tmp_path / f"{arch}-{layers}.gguf", gguf_arch, meta, t,
                          tokenizer_from=None)
        counts.append(decode_step_kernels(path))
    two, three = counts
    per_layer = three.launches - two.launches
    layer_total = sum(per_layer.values())
    fixed = two.total - 2 * layer_total
    what = f"{arch}: {layer_total} a layer {dict(per_layer)}, {fixed} more {dict(two.launches)}"
    print(what)
    assert layer_total <= MAX_PER_LAYER, what
    assert 0 <= fixed <= MAX_FIXED, what
    # what the layer is made of: the four products, the fused kernels, attention
    assert per_layer["triton _rope_store_kernel"] == 1, what
    assert per_layer["triton _rms_norm_kernel"] == 2, what
    assert per_layer["triton _act_mul_kernel"] == 1, what


def test_steps_within_one_partition_skip_the_merge(tmp_path):
    """The graphs' capture for contexts within one partition: a kernel less a layer."""
    from kiln.kernels.attention import PARTITION_SIZE
    counts = []
    for layers in (2, 3):
        gguf_arch, meta, t = _tiny("llama", layers, 512)
        path = write_gguf(tmp_path / f"llama-{layers}.gguf", gguf_arch, meta, t,
                          tokenizer_from=None)
        counts.append((decode_step_kernels(path), decode_step_kernels(path, PARTITION_SIZE)))
    (long2, short2), (long3, short3) = counts
    assert (short3.total - short2.total) == (long3.total - long2.total) - 1
    assert "triton _reduce_partitions_kernel" not in short3.launches


def mixed_step_launches(path, piecewise: bool) -> KernelCount:
    """What the host launches for a step of a 20-token prompt chunk beside a decode row
    (forward and the two rows' logits; the inputs' copy is not counted): eagerly, or
    through the piecewise graphs, each piece's replay one launch."""
    model, kv = _model_and_cache(path)
    num_blocks = 2 * CTX // BLOCK_SIZE
    arrays = (np.arange(11, 32), np.concatenate([[39], np.arange(20)]),  # ids, positions
              np.concatenate([[39], CTX + np.arange(20)]),  # slots
              np.array([0, 1, 21], dtype=np.int32), np.array([40, 20], dtype=np.int32),
              np.arange(num_blocks, dtype=np.int32).reshape(2, -1), np.array([0, 20]))
    forward = model.forward
    if piecewise:
        pieces = PiecewiseGraphs(model, kv, 8, CTX, BLOCK_SIZE, torch.device("cpu"),
                                 max_tokens=64)
        forward, sent = pieces.forward, pieces.stage(*arrays)
    else:
        sent = [torch.from_numpy(a) for a in arrays]
    ids, positions, slots, starts, lens, tables, rows = sent
    meta = AttentionMetadata(starts, lens, tables, slots, 20, 40)
    with torch.inference_mode(), KernelCount() as count:
        if piecewise:
            pieces._piece = count.as_one_launch(pieces._piece, "graph replay")
        model.compute_logits(forward(ids, positions, meta, kv)[rows])
    return count


def test_a_mixed_step_through_the_pieces_launches_a_replay_and_attention_a_layer(tmp_path):
    """A step with a prompt chunk (no decode graph takes it) through the piecewise graphs:
    a layer's token-wise work (the KV store with RoPE too) is one replay, beside attention's
    launch, where the eager step launches them all."""
    eager, pieces = [], []
    for layers in (2, 3):
        gguf_arch, meta, t = _tiny("llama", layers, 512)
        path = write_gguf(tmp_path / f"llama-{layers}.gguf", gguf_arch, meta, t,
                          tokenizer_from=None)
        eager.append(mixed_step_launches(path, False))
        pieces.append(mixed_step_launches(path, True))
    per_layer = pieces[1].launches - pieces[0].launches
    what = f"{dict(per_layer)} a layer through the pieces, " \
        f"{dict(eager[1].launches - eager[0].launches)} eagerly"
    print(what)
    assert per_layer == {"graph replay": 1, "triton _paged_attention_kernel": 1}, what
    assert eager[1].total - eager[0].total >= 4 * sum(per_layer.values()), what
    # the fixed part: the first piece's replay, the LM head's launches
    assert pieces[0].total - 2 * sum(per_layer.values()) <= MAX_FIXED, what
