"""Every kernel variant kiln launches compiles for sm_90 and sm_80 on this CPU (Triton ships
ptxas), and a model's steps launch no variant the load-time warm-up did not compile.

Both run in a subprocess without TRITON_INTERPRET (the interpreter replaces the JIT this
drives), the two archs side by side.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python(args: list[str], **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, said out loud (no warning)
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def test_every_variant_compiles_for_sm90_and_sm80():
    procs = {arch: python(["-m", "kiln.kernels.aot", "--arch", str(arch)]) for arch in (90, 80)}
    for arch, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        print(out)  # the per-variant report: registers, shared memory, spills
        assert proc.returncode == 0, out[-3000:]
        summary = [line for line in out.splitlines() if line.startswith(f"sm_{arch}:")]
        # 4 models x 3 dtypes: attention, KV store, split reduction; sampler 4 per dtype.
        assert summary and int(summary[-1].split()[1]) >= 40, summary
        # Attention's K/V tiles double-buffered: the next tile's block ids are loaded a
        # tile ahead, so no K/V load waits on a load of its own iteration (with them
        # gathered in the loop the pipeliner kept one buffer and waited on it every tile).
        attention = [line for line in out.splitlines()
                     if line.startswith(f"sm_{arch} _paged_attention_kernel ")]
        depths = {int(line.split("buffers ")[1].split()[0]) for line in attention}
        assert attention and min(depths) >= 2, depths


CHECK = textwrap.dedent("""
    import torch
    from kiln.kernels.aot import SHAPES, Recorder
    from kiln.kernels.attention import paged_attention
    from kiln.kernels.activation import act_mul
    from kiln.kernels.kv_cache import rope_store_kvcache
    from kiln.kernels.matmul import matmul
    from kiln.kernels.rms_norm import add_rms_norm, rms_norm
    from kiln.kernels.sampling import sample
    from kiln.kernels.sampling_metadata import SamplingMetadata
    from kiln.kernels.warmup import warmup_launches

    shapes = SHAPES["gemma3:270m"]  # two windows: the most attention variants
    H, KVH, D, V = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.vocab_size
    dt = torch.bfloat16
    with Recorder(90, compile=False) as rec:
        rec.run("warm-up", warmup_launches(shapes, dt, dt, "cpu"))
        warmed = set(rec.keys)
        # Steps of other shapes: batch sizes 1, 3, 16, 17, 64; prefill and decode; contexts
        # short and split; any window width and top-N.
        for num_seqs, query_len, context in [(1, 1, 0), (3, 1, 700), (16, 1, 40),
                                              (17, 5, 1500), (64, 1, 3000), (1, 33, 0)]:
            seq_len = context + query_len
            blocks = -(-seq_len // 16)
            cache = torch.zeros((num_seqs * blocks, 16, KVH, D), dtype=dt)
            T = num_seqs * query_len
            qkv = torch.zeros((T, (H + 2 * KVH) * D), dtype=dt)
            q = qkv[:, :H * D].view(T, H, D)
            k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
            v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
            tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
            lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
            qsl = torch.arange(0, T + 1, query_len, dtype=torch.int32)
            h = torch.zeros((T, shapes.hidden_size), dtype=dt)
            w = torch.ones(shapes.hidden_size)
            rms_norm(h, w, 1e-6)
            add_rms_norm(h, h.clone(), w, 1e-6, w)
            act_mul(torch.zeros((T, 2 * shapes.intermediate_size), dtype=dt), "gelu_tanh")
            # the products at any row count: the gate and up projections, the LM head
            for outputs in (2 * shapes.intermediate_size, V):
                matmul(torch.zeros((T, shapes.hidden_size), dtype=dt),
                       torch.empty((outputs, shapes.hidden_size), dtype=dt))
            angles = torch.zeros((2, D // 2))
            for window in shapes.sliding_windows:
                rope_store_kvcache(q, k, v, cache, cache, torch.zeros(T, dtype=torch.int64),
                                   torch.zeros(T, dtype=torch.int64), angles, angles,
                                   (torch.ones(D), torch.ones(D), 1e-6))
                paged_attention(q, cache, cache, tables, lens, qsl, 0.0625,
                                sliding_window=window, max_seq_len=seq_len,
                                max_query_len=query_len)
        for B, width, top in [(1, 1, 0), (3, 7, 1), (16, 64, 5), (17, 200, 20), (64, 0, 2)]:
            f32 = lambda x: torch.full((B,), x, dtype=torch.float32)
            for grammar in (False, True):
                md = SamplingMetadata(
                    f32(0.8), torch.full((B,), 3, dtype=torch.int32), f32(0.9), f32(0.05),
                    f32(1.2), f32(0.0), f32(0.0),
                    torch.zeros((B, width), dtype=torch.int64) if width else None,
                    torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                    torch.full((B, -(-V // 32)), -1, dtype=torch.int32) if grammar else None,
                    num_top_logprobs=top, flags=(True, True, True, False))
                sample(torch.zeros((B, V), dtype=dt), md)
        new = rec.keys - warmed
    assert not new, f"variants the warm-up missed: {sorted(k[0] for k in new)}"
    print(f"ok: {len(warmed)} variants")
""")


def test_steps_of_any_batch_launch_only_warmed_variants():
    proc = python(["-c", CHECK])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "ok:" in out, out[-3000:]


def test_aot_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "kiln.kernels.aot"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr
