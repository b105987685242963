/* Matrix products on weights kept in their GGUF quantization: y[M, N] = x[M, K] @ W[N, K]^T.
 *
 * Packed layout (runtime/cpu/packing.py writes it): W's rows in groups of 16; a group is its
 * K / SB super-blocks one after the other, and a super-block holds, for the 16 rows, the
 * type's scales (fp16 and 6/8-bit integers, as the GGUF stores them) and the quants of each k
 * as one 16-lane vector (4-bit planes two k to 16 bytes, plus planes of the fifth or the fifth
 * and sixth bits). Dequantizing a k gives the 16 rows' weights as one vector, so a product
 * needs no transpose: the same bits as the gguf package's dequantization, at about the
 * file's own bytes per weight.
 *
 * The one order of the sums: every y[i][n] is a chain of fmas over k = 0, 1, ..., K - 1,
 * started from +0, then + bias. A tile of rows and groups only shares the loads of x and of
 * the dequantized weights; the M, the tile a row falls in, the thread that computes it and
 * the instruction set never change that chain, so a row's output is the same bits alone or
 * in any batch. K is never split.
 *
 * Work: threads (pool.h) share out the groups; each dequantizes KC k of NG groups into a
 * buffer in L1 (once for all rows of an M block) and runs the MR x NG tile over it. */
#include <stdlib.h>

#include "blocks.h"
#include "pool.h"

int64_t kiln_group_bytes(int type, int64_t K) {
    const int64_t sb = sb_len(type), b = sb_bytes(type);
    if (!b || K % sb) return -1;
    return K / sb * b;
}

/* the weights of k = 2p and 2p + 1 of a span: the gguf package's values, bit for bit
 * (affine: one rounding, as numpy's d * q + m; the others exact, zero signs included) */
INLINE void span_pair(const int type, const span *s, int p, vf *w0, vf *w1) {
    switch (type) {
    case F32:
        *w0 = vf_load((const float *)s->raw + 32 * p);
        *w1 = vf_load((const float *)s->raw + 32 * p + 16);
        return;
    case F16:
        *w0 = vf_f16x16(s->raw + 64 * p);
        *w1 = vf_f16x16(s->raw + 64 * p + 32);
        return;
    case BF16:
        *w0 = vf_cast_i(vi_slli(vi_load_u16((const uint16_t *)(s->raw + 64 * p)), 16));
        *w1 = vf_cast_i(vi_slli(vi_load_u16((const uint16_t *)(s->raw + 64 * p + 32)), 16));
        return;
    case Q8_0:
        *w0 = vf_mul(vf_from_i(vi_load_s8((const int8_t *)s->raw + 32 * p)), s->scale[0]);
        *w1 = vf_mul(vf_from_i(vi_load_s8((const int8_t *)s->raw + 32 * p + 16)), s->scale[0]);
        return;
    }
    const vi v = vi_load_u8(s->planes + 16 * p);
    vi q0 = vi_and(v, vi_set1(15)), q1 = vi_srli(v, 4);
    if (type == Q5_0 || type == Q5_K) {
        q0 = vi_or(q0, hi1_bits(s->hi + 4 * p));
        q1 = vi_or(q1, hi1_bits(s->hi + 4 * p + 2));
    } else if (type == Q6_K) {
        q0 = vi_or(q0, hi2_bits(s->hi + 8 * p));
        q1 = vi_or(q1, hi2_bits(s->hi + 8 * p + 4));
    }
    const vf scale = type == Q6_K ? s->scale[p >= 8] : s->scale[0];
    if (type == Q4_1 || type == Q4_K || type == Q5_K) {
        *w0 = vf_fma(vf_from_i(q0), scale, s->off);
        *w1 = vf_fma(vf_from_i(q1), scale, s->off);
    } else {
        *w0 = vf_mul(vf_from_i(vi_add(q0, vi_set1(-quant_bias(type)))), scale);
        *w1 = vf_mul(vf_from_i(vi_add(q1, vi_set1(-quant_bias(type)))), scale);
    }
}

INLINE void dequant_t(const int type, const uint8_t *g, int64_t k0, int64_t k1, float *o,
                      int64_t os) {
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
        span s;
        span_of(type, g, k, &s);
        for (int p = 0; p < 16; p++, o += 2 * os) {
            vf w0, w1;
            span_pair(type, &s, p, &w0, &w1);
            vf_store(o, w0);
            vf_store(o + os, w1);
        }
    }
    for (; k < k1; k++, o += os) {  /* float types: K need not be a multiple of 32 */
        if (type == F32) vf_store(o, vf_load((const float *)(g + k * 64)));
        else if (type == F16) vf_store(o, vf_f16x16(g + k * 32));
        else vf_store(o, vf_cast_i(vi_slli(vi_load_u16((const uint16_t *)(g + k * 32)), 16)));
    }
}

#define FOR_TYPES(X) X(F32) X(F16) X(BF16) X(Q4_0) X(Q4_1) X(Q5_0) X(Q8_0) X(Q4_K) X(Q5_K) X(Q6_K)

/* One group's weights for k in [k0, k1) (on 32-boundaries for quantized types) into
 * o[(k - k0) * os + lane]. */
static void dequant(int type, const uint8_t *g, int64_t k0, int64_t k1, float *o, int64_t os) {
    switch (type) {
#define X(t) case t: dequant_t(t, g, k0, k1, o, os); return;
    FOR_TYPES(X)
#undef X
    }
}

/* W's rows [N, K] in fp32 (tests compare them with the gguf package's) */
void kiln_dequant(int type, const uint8_t *w, int64_t N, int64_t K, float *out) {
    const int64_t gb = kiln_group_bytes(type, K);
    float *buf = aligned_alloc(64, sizeof(float) * 16 * K);
    for (int64_t g = 0; g * 16 < N; g++) {
        dequant(type, w + g * gb, 0, K, buf, 16);
        for (int64_t r = 0; r < 16 && g * 16 + r < N; r++)
            for (int64_t k = 0; k < K; k++) out[(g * 16 + r) * K + k] = buf[k * 16 + r];
    }
    free(buf);
}

typedef struct {
    int type;
    const uint8_t *w;
    int64_t K;
    const int64_t *ids;
    int64_t T;
    float *out;
} embed_args;

static void embed_task(void *ctx, int tid, int nt) {
    const embed_args *a = ctx;
    const int64_t gb = kiln_group_bytes(a->type, a->K), KC = 256;
    float buf[256 * 16] __attribute__((aligned(64)));
    int64_t t0, t1;
    kiln_share(a->T, tid, nt, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t g = a->ids[t] / 16, r = a->ids[t] % 16;
        for (int64_t k0 = 0; k0 < a->K; k0 += KC) {
            const int64_t k1 = k0 + KC < a->K ? k0 + KC : a->K;
            dequant(a->type, a->w + g * gb, k0, k1, buf, 16);
            for (int64_t k = k0; k < k1; k++) a->out[t * a->K + k] = buf[(k - k0) * 16 + r];
        }
    }
}

/* Rows ids[0..T) of W (an embedding table) -> out [T, K] */
void kiln_embed(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t T,
                float *out, int nthreads) {
    embed_args a = {type, w, K, ids, T, out};
    kiln_parallel(embed_task, &a, T > 32 ? nthreads : 1);
}

#if defined(__AVX512F__)
#define MR 6   /* rows of a tile */
#define NG 4   /* groups of a tile: 24 accumulators */
#else
#define MR 2
#define NG 2
#endif
#define KC 128   /* k dequantized at a time: NG x KC x 16 floats (32 KB) stay in L1 */
#define MC 240   /* rows of x read per pass over a group's dequantized weights */
#define PF_GROUPS (3 * NG) /* prefetch the groups three tiles ahead (measured best at 2-4) */

/* y[0..mr)[16 ng] over k in [0, kc), the accumulators starting at 0 or from y */
INLINE void tile(const float *x, int64_t ldx, const float *buf, int64_t kc, float *y,
                 int64_t ldy, const int mr, const int ng, int first, int nlast) {
    vf acc[MR][NG];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) {
            const int n = j == ng - 1 ? nlast : 16;
            acc[i][j] = first ? vf_zero()
                        : n == 16 ? vf_load(y + i * ldy + 16 * j) : vf_load_n(y + i * ldy + 16 * j, n);
        }
    for (int64_t k = 0; k < kc; k++) {
        vf w[NG];
        for (int j = 0; j < ng; j++) w[j] = vf_load(buf + (k * ng + j) * 16);
        for (int i = 0; i < mr; i++) {
            const vf xb = vf_set1(x[i * ldx + k]);
            for (int j = 0; j < ng; j++) acc[i][j] = vf_fma(xb, w[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) {
            const int n = j == ng - 1 ? nlast : 16;
            if (n == 16) vf_store(y + i * ldy + 16 * j, acc[i][j]);
            else vf_store_n(y + i * ldy + 16 * j, acc[i][j], n);
        }
}

#define TILE(mr_, ng_) \
    case (mr_) * 8 + (ng_): tile(x, ldx, buf, kc, y, ldy, mr_, ng_, first, nlast); break;

/* the tile specialised for its shape (the accumulators stay in registers) */
static void tile_any(const float *x, int64_t ldx, const float *buf, int64_t kc, float *y,
                     int64_t ldy, int mr, int ng, int first, int nlast) {
    switch (mr * 8 + ng) {
#if MR == 6
    TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4) TILE(2, 1) TILE(2, 2) TILE(2, 3) TILE(2, 4)
    TILE(3, 1) TILE(3, 2) TILE(3, 3) TILE(3, 4) TILE(4, 1) TILE(4, 2) TILE(4, 3) TILE(4, 4)
    TILE(5, 1) TILE(5, 2) TILE(5, 3) TILE(5, 4) TILE(6, 1) TILE(6, 2) TILE(6, 3) TILE(6, 4)
#else
    TILE(1, 1) TILE(1, 2) TILE(2, 1) TILE(2, 2)
#endif
    }
}

/* Decode steps (M <= FUSED_ROWS: one token a sequence, or a few with the drafts a step checks):
 * the weights go from their blocks straight into the fmas, ngd groups at a time (ngd chains of
 * fmas per row; fewer groups for more rows, so the accumulators stay in registers). Each
 * y[i][n] is the same chain of fmas in k as in the tiles above, over the same dequantized
 * values: the same bits. */
#if defined(__AVX512F__)
#define FUSED_ROWS 6
#else
#define FUSED_ROWS 2
#endif
#define NGD 8 /* the most groups at a time */
#define PFD (2 * NGD) /* the fused path prefetches the groups two tiles ahead */
INLINE int fused_groups(int64_t M) { return M <= 2 ? 8 : M <= 4 ? 4 : 2; }

INLINE void fused_t(const int type, const float *x, int64_t ldx, const uint8_t *w, int64_t gb,
                    int64_t K, float *y, int64_t ldy, const int mr, const int ngd,
                    int64_t prefetch_groups) {
    const int64_t sbl = sb_len(type), sbb = sb_bytes(type);
    const int64_t span_bytes = sbl == 1 ? 32 * sbb : sbb * 32 / sbl;
    vf acc[FUSED_ROWS][NGD];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ngd; j++) acc[i][j] = vf_zero();
    for (int64_t k = 0; k < K; k += 32) {
        span sp[NGD];
        for (int j = 0; j < ngd; j++) span_of(type, w + j * gb, k, &sp[j]);
        const int64_t at = sbl == 1 ? k * sbb : k / sbl * sbb + (k % sbl) * sbb / sbl;
        for (int64_t j = 0; j < prefetch_groups; j++)
            for (int64_t off = 0; off < span_bytes; off += 64)
                __builtin_prefetch(w + (PFD + j) * gb + at + off);
        for (int p = 0; p < 16; p++) {
            vf x0[FUSED_ROWS], x1[FUSED_ROWS];
            for (int i = 0; i < mr; i++)
                x0[i] = vf_set1(x[i * ldx + k + 2 * p]), x1[i] = vf_set1(x[i * ldx + k + 2 * p + 1]);
            for (int j = 0; j < ngd; j++) {
                vf w0, w1;
                span_pair(type, &sp[j], p, &w0, &w1);
                for (int i = 0; i < mr; i++) {
                    acc[i][j] = vf_fma(x0[i], w0, acc[i][j]);
                    acc[i][j] = vf_fma(x1[i], w1, acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ngd; j++) vf_store(y + i * ldy + 16 * j, acc[i][j]);
}

/* fused_groups(mr) whole groups from w (16 of y's columns each) for M = mr rows */
static void fused(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t gb, int64_t K,
                  float *y, int64_t ldy, int mr, int64_t prefetch_groups) {
    switch (type * 8 + mr - 1) {
#define F(t, m) \
    case t * 8 + m - 1: fused_t(t, x, ldx, w, gb, K, y, ldy, m, fused_groups(m), prefetch_groups); return;
#if FUSED_ROWS == 6
#define X(t) F(t, 1) F(t, 2) F(t, 3) F(t, 4) F(t, 5) F(t, 6)
#else
#define X(t) F(t, 1) F(t, 2)
#endif
    FOR_TYPES(X)
#undef X
#undef F
    }
}

typedef struct {
    const float *x;
    int64_t M, K, ldx;
    const kiln_part *parts;
    int64_t nparts;
    const float *bias;
    float *y;
    int64_t ldy;
} linear_args;

/* groups [g0, g1) of one part: its columns of y */
static void part_range(const void *ctx, const kiln_part *part, int64_t g0, int64_t g1) {
    const linear_args *a = ctx;
    const float *x = a->x;
    const int type = (int)part->type;
    const int64_t M = a->M, K = a->K, N = part->rows, ldx = a->ldx, ldy = a->ldy;
    const int64_t gb = kiln_group_bytes(type, K);
    const uint8_t *w = part->blocks;
    float *y = a->y + part->col0;
    const float *bias = a->bias ? a->bias + part->col0 : NULL;
    float buf[KC * NG * 16] __attribute__((aligned(64)));
    if (M <= FUSED_ROWS && K % 32 == 0) {  /* whole tiles of ngd groups fused; the rest below */
        const int ngd = fused_groups(M);
        for (; g0 + ngd <= g1 && (g0 + ngd) * 16 <= N; g0 += ngd) {
            const int64_t ahead = g1 - (g0 + PFD);
            fused(type, x, ldx, w + g0 * gb, gb, K, y + 16 * g0, ldy, (int)M,
                  ahead < 0 ? 0 : ahead < ngd ? ahead : ngd);
            if (bias)
                for (int64_t m = 0; m < M; m++)
                    for (int64_t n = 16 * g0; n < 16 * (g0 + ngd); n++) y[m * ldy + n] += bias[n];
        }
    }
    const int64_t sbl = sb_len(type), sbb = sb_bytes(type);
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t m1 = m0 + MC < M ? m0 + MC : M;
        for (int64_t g = g0; g < g1; g += NG) {
            const int ng = (int)(g1 - g < NG ? g1 - g : NG);
            const int64_t ncols = N - g * 16 < ng * 16 ? N - g * 16 : ng * 16;
            const int nlast = (int)(ncols - (ng - 1) * 16);
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = K - k0 < KC ? K - k0 : KC, cb = (kc + sbl - 1) / sbl * sbb;
                /* the same k of groups PF_GROUPS ahead, while these are dequantized: a
                 * decode step's products are bound by reading the weights */
                for (int64_t j = g + PF_GROUPS; j < g + PF_GROUPS + NG && j < g1; j++) {
                    const uint8_t *p = w + j * gb + k0 / sbl * sbb;
                    for (int64_t off = 0; off < cb; off += 64) __builtin_prefetch(p + off);
                }
                for (int j = 0; j < ng; j++)
                    dequant(type, w + (g + j) * gb, k0, k0 + kc, buf + 16 * j, 16 * ng);
                for (int64_t m = m0; m < m1; m += MR)
                    tile_any(x + m * ldx + k0, ldx, buf, kc, y + m * ldy + 16 * g, ldy,
                             (int)(m1 - m < MR ? m1 - m : MR), ng, k0 == 0, nlast);
            }
            if (bias)
                for (int64_t m = m0; m < m1; m++)
                    for (int64_t n = 16 * g; n < 16 * g + ncols; n++) y[m * ldy + n] += bias[n];
        }
    }
}

/* The threads share out the groups of all parts together: groups [g0, g1) of the whole. */
static void linear_task(void *ctx, int tid, int nt) {
    const linear_args *a = ctx;
    share_groups(a->parts, a->nparts, tid, nt, part_range, a);
}

/* x [M, K] (row stride ldx) -> y [M, N] (row stride ldy), N the parts' rows together;
 * bias [N] or NULL */
void kiln_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const kiln_part *parts,
                 int64_t nparts, const float *bias, float *y, int64_t ldy, int nthreads) {
    linear_args a = {x, M, K, ldx, parts, nparts, bias, y, ldy};
    kiln_parallel(linear_task, &a, nthreads);
}
