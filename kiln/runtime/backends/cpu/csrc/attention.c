/* Paged attention over kiln's CPU KV cache, for a batch that mixes prefill chunks and decode
 * rows, and the store of this step's keys and values into that cache.
 *
 * CPU cache layout (one pair per layer), chosen for the two products below:
 *   key_cache   [num_blocks, num_kv_heads, head_dim, block_size]  (K transposed per block)
 *   value_cache [num_blocks, num_kv_heads, block_size, head_dim]
 * so a block's 16 keys at one dimension d are one vector (scores: lanes over keys, a chain of
 * fmas over d) and a key's values are contiguous (output: lanes over d, a chain over keys).
 *
 * Batch invariance by construction: a query row (one position, one head) is computed on its
 * own whatever else is in the batch, whether it is read in a prefill chunk or a decode step.
 * It visits its sequence's keys in tiles of TK positions aligned to absolute position 0, in
 * increasing order, with an online softmax whose update for a tile is always the same
 * sequence of operations; a tile that hides every key from a row leaves that row's state
 * exactly as it was (alpha = 1, p = 0). Rows are tiled together only to share loads.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "pool.h"
#include "simd.h"

#define BS 16           /* KV block size: one vector of keys */
#define TB 4            /* blocks per key tile */
#define TK (TB * BS)    /* keys per tile, the online softmax's step */
#define QT 16           /* query positions per work unit of a prefill chunk */
/* Register tiles, by the registers there are: 32 zmm hold 16 vectors of 16 floats, AVX2's 16
 * ymm hold 8 (simd.h's vectors are ymm pairs there). Spilled accumulators made AVX2's
 * attention about twice as slow. The tiles only share loads: each score and each output
 * lane is the same chain of operations whatever tile computes it, so the bits do not move. */
#if defined(__AVX512F__)
#define RQ 6            /* rows of a score tile: RQ x UB accumulators */
#define UB TB           /* blocks of a score tile */
#define VT 16           /* vectors of a values tile (rows x vectors of the head) */
#define VR 4            /* its most rows */
#define VC 16           /* its most vectors of the head */
#else
#define RQ 6
#define UB 1
#define VT 6
#define VR 3
#define VC 2
#endif

INLINE float exp1(float x) {
    float o[16];
    vf_store(o, vf_exp(vf_set1(x)));
    return o[0];
}

typedef struct {
    const float *q;
    int64_t q_tok, q_head; /* q[t * q_tok + h * q_head + d] */
    float *out;
    int64_t o_tok, o_head;
    const char *kc, *vc; /* fp32, or fp16 where half */
    int64_t kvh_n, D, G;
    float scale;
    int64_t window;
    int half;
} attn_args;

/* 16 cached values as fp32: fp16 ones convert exactly */
INLINE vf kv_load(const char *p, int64_t i, const int half) {
    return half ? vf_load_f16((const uint16_t *)p + i) : vf_load((const float *)p + i);
}

/* s[i][0..TK) = q_i . k over d = 0, 1, ..., D - 1, for rq rows and the tile's blocks, UB
 * blocks at a time */
INLINE void scores(const float *const *qr, const char *const *kt, int64_t D, float *s,
                   const int rq, const int half) {
    for (int u0 = 0; u0 < TB; u0 += UB) {
        vf acc[RQ][UB];
        for (int i = 0; i < rq; i++)
            for (int u = 0; u < UB; u++) acc[i][u] = vf_zero();
        for (int64_t d = 0; d < D; d++) {
            vf kv[UB];
            for (int u = 0; u < UB; u++) kv[u] = kv_load(kt[u0 + u], d * BS, half);
            for (int i = 0; i < rq; i++) {
                const vf qb = vf_set1(qr[i][d]);
                for (int u = 0; u < UB; u++) acc[i][u] = vf_fma(qb, kv[u], acc[i][u]);
            }
        }
        for (int i = 0; i < rq; i++)
            for (int u = 0; u < UB; u++) vf_store(s + i * TK + (u0 + u) * BS, acc[i][u]);
    }
}

/* o_i[c0 .. c0 + cv) = alpha_i * o_i + sum over the tile's keys j, in order, of p_i[j] v_j */
INLINE void values(float *o, int64_t D, const float *p, const float *alpha,
                   const char *const *vb, int64_t c0, const int rp, const int cv, const int half) {
    vf acc[VR][VT];
    for (int i = 0; i < rp; i++) {
        const vf a = vf_set1(alpha[i]);
        for (int c = 0; c < cv; c++) acc[i][c] = vf_mul(vf_load(o + i * D + (c0 + c) * 16), a);
    }
    for (int j = 0; j < TK; j++) {
        const int64_t at = (j % BS) * D + c0 * 16;
        for (int c = 0; c < cv; c++) {
            const vf v = kv_load(vb[j / BS], at + c * 16, half);
            for (int i = 0; i < rp; i++) acc[i][c] = vf_fma(vf_set1(p[i * TK + j]), v, acc[i][c]);
        }
    }
    for (int i = 0; i < rp; i++)
        for (int c = 0; c < cv; c++) vf_store(o + i * D + (c0 + c) * 16, acc[i][c]);
}

static void scores_any(const float *const *qr, const char *const *kt, int64_t D, float *s,
                       int rq, int half) {
    switch (rq * 2 + half) {
#define S(r) case 2 * r: scores(qr, kt, D, s, r, 0); break; \
             case 2 * r + 1: scores(qr, kt, D, s, r, 1); break;
    S(1) S(2) S(3) S(4) S(5) S(6)
#undef S
    }
}

/* rows [r0, r0 + n) of the unit through `values`, in register tiles of up to VT vectors */
static void values_rows(float *acc, int64_t D, const float *ps, const float *alpha,
                        const char *const *vb, int64_t r0, int64_t n, int half) {
    const int64_t nv = D / 16;
    const int cv = nv < VC ? (int)nv : VC;
    const int rp = VT / cv < VR ? VT / cv : VR;
    for (int64_t r = r0; r < r0 + n; r += rp) {
        const int k = (int)(r0 + n - r < rp ? r0 + n - r : rp);
        for (int64_t c0 = 0; c0 < nv; c0 += cv) {
            float *o = acc + r * D;
            const float *p = ps + r * TK, *a = alpha + r;
            const int cw = (int)(nv - c0 < cv ? nv - c0 : cv); /* the last may be narrower */
#define V(rp_, cv_) if (k == rp_ && cw == cv_) { \
                if (half) values(o, D, p, a, vb, c0, rp_, cv_, 1); \
                else values(o, D, p, a, vb, c0, rp_, cv_, 0); \
                continue; \
            }
#if VT == 16
            V(4, 4) V(3, 4) V(2, 4) V(1, 4) V(2, 8) V(1, 8) V(1, 16)
#else
            V(3, 2) V(2, 2) V(1, 2)
#endif
#undef V
            for (int i = 0; i < k; i++)  /* other head sizes: one vector at a time */
                for (int64_t c = c0; c < nv && c < c0 + cv; c++)
                    values(o + i * D, D, p + i * TK, a + i, vb, c, 1, 1, half);
        }
    }
}

/* Key tile t (its blocks' keys kt and values vb, one kv head's) for rows [r0, r0 + n) of a
 * unit, whose row r0 + i is position p0 + i / G: scores, the online softmax's step, values */
INLINE void attend_tile(const attn_args *a, int64_t t, const char *const *kt,
                        const char *const *vb, const float **qr, int64_t r0, int64_t n,
                        int64_t p0, float *acc, float *m, float *l, float *alpha, float *s) {
    const vf lane = vf_from_i(vi_lanes());
    for (int64_t r = r0; r < r0 + n; r += RQ)
        scores_any(qr + r, kt, a->D, s + r * TK, (int)(r0 + n - r < RQ ? r0 + n - r : RQ),
                   a->half);
    for (int64_t r = r0; r < r0 + n; r++) {
        const int64_t pos = p0 + (r - r0) / a->G;
        const vf lo_v = vf_set1(a->window > 0 ? (float)(pos - a->window) : -1.0f);
        const vf hi_v = vf_set1((float)pos), scale = vf_set1(a->scale);
        float *sr = s + r * TK;
        vf z[TB];
        for (int u = 0; u < TB; u++)  /* the keys this row sees: pos - window < k <= pos */
            z[u] = vf_keep_in(vf_mul(vf_load(sr + u * BS), scale),
                              vf_add(lane, vf_set1((float)(t * TK + u * BS))), lo_v, hi_v);
        const float m_new = fmaxf(m[r], vf_hmax(vf_max(vf_max(z[0], z[1]), vf_max(z[2], z[3]))));
        if (m_new == -INFINITY) {  /* nothing visible yet: p = 0, alpha = 1 change nothing */
            alpha[r] = 1.0f;
            for (int u = 0; u < TB; u++) vf_store(sr + u * BS, vf_zero());
            continue;
        }
        alpha[r] = exp1(m[r] - m_new);
        vf p[TB];
        for (int u = 0; u < TB; u++) {
            p[u] = vf_exp(vf_sub(z[u], vf_set1(m_new)));
            vf_store(sr + u * BS, p[u]);
        }
        l[r] = l[r] * alpha[r] + vf_sum(vf_add(vf_add(p[0], p[1]), vf_add(p[2], p[3])));
        m[r] = m_new;
    }
    values_rows(acc, a->D, s, alpha, vb, r0, n, a->half);
}

/* One work unit: kv heads [h0, h0 + nh) of one sequence (its block table `bt`, `L` keys),
 * query positions [p0, p1) (rows: kv head x position x the G heads of its group) whose first
 * is token tok0 of q and out. A tile's keys are read for each kv head in turn: a cache
 * block's heads lie side by side, so a unit of all of them reads each block in one run.
 * Scratch: acc [rows, D], m, l, alpha [rows], s [rows, TK], qr [rows]. */
static void unit(const attn_args *a, const int32_t *bt, int64_t L, int64_t h0, int64_t nh,
                 int64_t p0, int64_t p1, int64_t tok0, float *acc, float *m, float *l,
                 float *alpha, float *s, const float **qr) {
    const int64_t D = a->D, G = a->G, Rh = (p1 - p0) * G, R = nh * Rh, nv = D / 16;
    const int64_t nblocks = (L + BS - 1) / BS, esz = a->half ? 2 : 4;
    for (int64_t r = 0; r < R; r++) {
        m[r] = -INFINITY, l[r] = 0.0f;
        qr[r] = a->q + (tok0 + r % Rh / G) * a->q_tok + ((h0 + r / Rh) * G + r % G) * a->q_head;
    }
    for (int64_t i = 0; i < R * D; i++) acc[i] = 0.0f;
    const int64_t lo = a->window > 0 && p0 + 1 - a->window > 0 ? p0 + 1 - a->window : 0;
    for (int64_t t = lo / TK; t <= (p1 - 1) / TK; t++) {
        if (t < (p1 - 1) / TK)  /* the next tile's blocks: paged, so no stride to follow */
            for (int u = 0; u < TB; u++) {
                const int64_t b = (t + 1) * TB + u, id = bt[b < nblocks ? b : 0];
                const char *kn = a->kc + (id * a->kvh_n + h0) * D * BS * esz;
                const char *vn = a->vc + (id * a->kvh_n + h0) * BS * D * esz;
                for (int64_t off = 0; off < nh * esz * D * BS; off += 64) {
                    __builtin_prefetch(kn + off);
                    __builtin_prefetch(vn + off);
                }
            }
        for (int64_t kvh = h0; kvh < h0 + nh; kvh++) {
            const char *kt[TB], *vb[TB];
            for (int u = 0; u < TB; u++) {
                /* a block past the sequence's end holds no key any row sees: any will do */
                const int64_t b = t * TB + u, id = bt[b < nblocks ? b : 0];
                kt[u] = a->kc + (id * a->kvh_n + kvh) * D * BS * esz;
                vb[u] = a->vc + (id * a->kvh_n + kvh) * BS * D * esz;
            }
            attend_tile(a, t, kt, vb, qr, (kvh - h0) * Rh, Rh, p0, acc, m, l, alpha, s);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *dst = a->out + (tok0 + r % Rh / G) * a->o_tok +
                     ((h0 + r / Rh) * G + r % G) * a->o_head;
        const vf lv = vf_set1(l[r]);
        for (int64_t c = 0; c < nv; c++)
            vf_store(dst + c * 16, vf_div(vf_load(acc + r * D + c * 16), lv));
    }
}

typedef struct {
    attn_args a;
    const int32_t *block_tables, *seq_lens, *query_start_loc;
    int64_t bt_stride, num_seqs, total;
    int whole; /* sequences of one position tile take all their kv heads in one unit */
    const int64_t *first; /* first[i]: sequence i's first unit */
    _Atomic int64_t next; /* the next unit to take */
} attn_batch;

static void attention_task(void *ctx, int tid, int nt) {
    (void)tid, (void)nt;
    attn_batch *b = ctx;
    const attn_args *a = &b->a;
    const int64_t R = QT * a->G * a->kvh_n, D = a->D;
    /* qr [R] pointers, then acc [R, D], s [R, TK], m, l, alpha [R] floats, 64-byte aligned */
    const size_t ptrs = (sizeof(float *) * R + 63) / 64 * 64;
    const size_t bytes = (ptrs + sizeof(float) * (R * D + R * TK + 3 * R) + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, bytes);
    const float **qr = (const float **)scratch;
    float *acc = (float *)(scratch + ptrs), *s = acc + R * D, *m = s + R * TK, *l = m + R;
    float *alpha = l + R;
    int64_t seq = 0;
    for (int64_t u; (u = atomic_fetch_add(&b->next, 1)) < b->total;) {
        while (b->first[seq + 1] <= u) seq++;
        const int64_t qs = b->query_start_loc[seq], ql = b->query_start_loc[seq + 1] - qs;
        const int64_t nh = b->whole && ql <= QT ? a->kvh_n : 1, per_tile = a->kvh_n / nh;
        const int64_t k = u - b->first[seq], tile = k / per_tile, h0 = k % per_tile;
        const int64_t L = b->seq_lens[seq], ctx_len = L - ql;
        const int64_t p0 = ctx_len + tile * QT, p1 = p0 + QT < L ? p0 + QT : L;
        unit(a, b->block_tables + seq * b->bt_stride, L, h0, nh, p0, p1, qs + tile * QT, acc, m,
             l, alpha, s, qr);
    }
    free(scratch);
}

/* key_cache, value_cache: fp32, or fp16 where half (the caches' layout is the same) */
void kiln_attention(const float *q, int64_t q_tok, int64_t q_head, const void *key_cache,
                    const void *value_cache, const int32_t *block_tables, int64_t bt_stride,
                    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                    int64_t window, float *out, int64_t o_tok, int64_t o_head, int half,
                    int nthreads) {
    /* units: per sequence, ceil(query_len / QT) position tiles x kv heads, taken in order;
     * where sequences are many, one of a single position tile (a decode row, a few drafted
     * tokens) takes all its kv heads in one unit. A row is computed alone either way. */
    const int whole = num_seqs >= 4 * (int64_t)nthreads;
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1));
    int64_t total = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        first[i] = total;
        const int64_t ql = query_start_loc[i + 1] - query_start_loc[i];
        total += whole && ql <= QT ? ql > 0 : (ql + QT - 1) / QT * num_kv_heads;
    }
    first[num_seqs] = total;
    attn_batch b = {{q, q_tok, q_head, out, o_tok, o_head, key_cache, value_cache, num_kv_heads,
                     head_dim, num_heads / num_kv_heads, scale, window, half},
                    block_tables, seq_lens, query_start_loc, bt_stride, num_seqs, total, whole,
                    first, 0};
    kiln_parallel(attention_task, &b, total > 1 ? nthreads : 1);
    free(first);
}

/* key, value [T, KVH, D] (token strides k_tok, v_tok) -> their slots; slot -1: skipped.
 * An fp16 cache (half) takes each value rounded to nearest (even). */
void kiln_store_kv(const float *key, int64_t k_tok, const float *value, int64_t v_tok,
                   const int64_t *slot_mapping, int64_t T, int64_t kvh_n, int64_t D,
                   void *key_cache, void *value_cache, int half) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const int64_t b = slot / BS, off = slot % BS;
        for (int64_t h = 0; h < kvh_n; h++) {
            const float *k = key + t * k_tok + h * D, *v = value + t * v_tok + h * D;
            const int64_t kt = (b * kvh_n + h) * D * BS + off, vr = ((b * kvh_n + h) * BS + off) * D;
            if (half) {
                uint16_t *kc = key_cache, *vc = value_cache;
                for (int64_t d = 0; d < D; d++) {
                    kc[kt + d * BS] = _cvtss_sh(k[d], _MM_FROUND_TO_NEAREST_INT);
                    vc[vr + d] = _cvtss_sh(v[d], _MM_FROUND_TO_NEAREST_INT);
                }
            } else {
                float *kc = key_cache, *vc = value_cache;
                for (int64_t d = 0; d < D; d++) kc[kt + d * BS] = k[d];
                memcpy(vc + vr, v, sizeof(float) * D);
            }
        }
    }
}
