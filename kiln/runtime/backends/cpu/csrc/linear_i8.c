/* Products on 8-bit activations: y[M, N] = x[M, K] @ W[N, K]^T with W in its GGUF blocks and
 * x rounded to 8 bits per run of 16 k (d = max|x| / 127, q = round(x / d)): ggml's Q8_0
 * rounding on runs half as long, so closer to fp32 than llama.cpp's (bench/cpu_accuracy.py).
 *
 * Why: at one stream the fp32 products (linear.c) are bound by turning quants into fp32
 * (about eight instructions per 16 weights), not by reading them. Integer dot products take
 * 64 multiply-adds an instruction (VNNI's vpdpbusd), so a decode step reads its weights at
 * memory speed.
 *
 * Packed layout: linear.c's (the same super-block headers, the same bytes), but the quants
 * of each 32 k of a group are ordered for the integer products: a "quad" s (k = 4s .. 4s + 3)
 * is 64 bytes, byte 4r + j holding row r's k = 4s + j, so one vector holds 16 rows x 4 k.
 * 4-bit planes pack quads 2c (low nibbles) and 2c + 1 (high) in one 64-byte vector; fifth
 * bits are a 64-bit mask per quad (bit 4r + j), Q6_K's top two bits two masks per quad;
 * Q8_0's quants are quads of int8. packing.py writes it (layout "i8").
 *
 * The one order of the sums: for each run r of 16 k, an exact integer sum over its k, then
 * in fp32, for r ascending from acc = +0, then + bias:
 *   - weights w = (q - bias) * scale (Q4_0, Q5_0, Q6_K: bias 8, 16, 32; Q8_0: 0): the sum
 *     of (q_w - bias) * q_x, and  acc = fma(float(isum) * d_x, scale, acc);
 *   - w = q * scale + off (Q4_1, Q4_K, Q5_K: off a float): the sum of q_w * q_x, and
 *     acc = fma(float(isum) * d_x, scale, acc);  acc = fma(off, sum_x, acc)
 *     with sum_x d_x times the sum of q_x over the run (as ggml's Q8_1).
 * Either way the offsets see the same rounded x as the quants, so the rounding error is x's
 * error times w, not times the larger q * scale. Integer sums are exact, so a row's bits
 * depend neither on the batch, the tile, the thread nor the instruction set (VNNI,
 * AVX-512BW's or AVX2's maddubs give the same integers). */
#include <math.h>
#include <stdlib.h>

#include "blocks.h"
#include "pool.h"

/* x rounded to 8 bits per run of 16 k, per row: q [K], d [K / 16], the sums of the
 * rounded x over each run (d times an exact integer sum) and those integer sums */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *n;
    int64_t K;
} xq8;

static void quantize_row(const float *x, const xq8 *o, int64_t m) {
    const int64_t K = o->K, nr = K / 16;
    const vf lo = vf_set1(-127.0f), hi = vf_set1(127.0f);
    for (int64_t r = 0; r < nr; r++) {
        const vf xr = vf_load(x + 16 * r);
        /* the largest |x| (a maximum of non-negative values: the same in any order) */
        const float d = vf_hmax(vf_abs(xr)) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        /* rounded half to even, as nearbyintf; the sum of integers is exact in fp32 */
        const vf q = vf_min(vf_max(vf_round(vf_mul(xr, vf_set1(id))), lo), hi);
        vi_store_s8(o->q + m * K + 16 * r, vi_from_f(q));
        const float sum = vf_sum(q);
        o->d[m * nr + r] = d;
        o->s[m * nr + r] = d * sum;
        o->n[m * nr + r] = (int32_t)sum;
    }
}

/* Q8_0's quants are signed, and the integer dot products take one operand unsigned. With
 * VNNI (whose sums never saturate) they go in as q + 128 (a xor per weight vector) against x
 * as it is; without it, |q| against x with q's sign (two more operations per dot product,
 * per row). The same integers. */
#if defined(__AVX512VNNI__)
#define Q8_BIASED 1
#else
#define Q8_BIASED 0
#endif

/* What the quants carry beyond w / scale (the type's bias, Q8_0's 128 where it goes in
 * unsigned): each run's integer sum starts from minus it times sum(q_x), so it is the sum
 * of (q_w - bias) * q_x, exact, with no float term for the offset. */
INLINE int32_t carried(const int type) {
    return type == Q8_0 && Q8_BIASED ? 128 : quant_bias(type);
}

/* quads s and s + 1 (s even) of a group's 32 k starting at a span */
INLINE void quads(const int type, const span *sp, int s, vi *q0, vi *q1) {
    if (type == Q8_0) {
        *q0 = vi_load(sp->raw + 64 * s);
        *q1 = vi_load(sp->raw + 64 * s + 64);
        if (Q8_BIASED) { /* q + 128, unsigned */
            *q0 = vi_xor(*q0, vi_set1((int)0x80808080));
            *q1 = vi_xor(*q1, vi_set1((int)0x80808080));
        }
        return;
    }
    const vi v = vi_load(sp->planes + 32 * s), low4 = vi_set1(0x0F0F0F0F);
    *q0 = vi_and(v, low4);
    *q1 = vi_and(vi_srli(v, 4), low4);
    if (type == Q5_0 || type == Q5_K) {
        *q0 = vi_or(*q0, vi_bytes_where(sp->hi + 8 * s, 16));
        *q1 = vi_or(*q1, vi_bytes_where(sp->hi + 8 * s + 8, 16));
    } else if (type == Q6_K) {
        const uint8_t *hi = sp->hi + 16 * s; /* per quad: the masks of bit 4, then bit 5 */
        *q0 = vi_or(vi_or(*q0, vi_bytes_where(hi, 16)), vi_bytes_where(hi + 8, 32));
        *q1 = vi_or(vi_or(*q1, vi_bytes_where(hi + 16, 16)), vi_bytes_where(hi + 24, 32));
    }
}

INLINE vi dot(const int type, vi acc, vi q, vi x) {
    return type == Q8_0 && !Q8_BIASED ? vi_dot_u8s8(acc, vi_abs8(q), vi_sign8(x, q))
                                      : vi_dot_u8s8(acc, q, x);
}

/* Without VNNI the quads' 16-bit pair sums add up before one madd widens them: all four of
 * a run's where the quants are at most 31 (4 x 31 x 127 x 2 < 32768), each pair of quads
 * for Q6_K's (2 x 63 x 127 x 2), none for Q8_0's (the maddubs of one already nears the
 * limit). The integer sums are the same, so are the bits. */
#if defined(__AVX512VNNI__)
#define WIDE_QUADS(type) 0
#else
#define WIDE_QUADS(type) ((type) == Q8_0 ? 0 : (type) == Q6_K ? 2 : 4)
#endif

/* Groups of a tile. Where a tile reads its weights from memory once (up to 3 rows of x, or
 * a part no cache holds and fewer than 32 rows), one group at a time: a thread then reads one
 * stream, where a tile of several groups read as many, a group's bytes apart (the LM head at
 * one row: 33 against 20 GB/s, bench/README.md). Otherwise several groups, whose loads the
 * rows' dot products share. Which tile computes an output never changes its bits. */
#define BIG_PART (8 << 20) /* bytes: more than the L3 share a core of ours gets */
#if defined(__AVX512F__)
#define MR8 4 /* rows of a tile */
#define NG8 3 /* the most groups of a tile */
#else
#define MR8 1
#define NG8 2
#endif
INLINE int groups_for(int64_t M, int64_t part_bytes) {
    return M <= 3 || (M < 32 && part_bytes >= BIG_PART) ? 1 : NG8;
}

/* y[i][16 ng] for the mr rows of x from i0 and ng whole groups of w: the integer and fp32
 * accumulators of the tile stay in registers */
INLINE void tile_t(const int type, const xq8 *x, int64_t i0, const uint8_t *w, int64_t gb,
                   float *y, int64_t ldy, const int mr, const int ng, int nlast,
                   int64_t prefetch_groups) {
    const int64_t K = x->K, nr = K / 16, sbl = sb_len(type), sbb = sb_bytes(type);
    const int affine = type == Q4_1 || type == Q4_K || type == Q5_K;
    vf acc[MR8][NG8];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) acc[i][j] = vf_zero();
    for (int64_t k = 0; k < K; k += 32) {
        span sp[NG8];
        for (int j = 0; j < ng; j++) span_of(type, w + j * gb, k, &sp[j]);
        const int64_t at = k / sbl * sbb + (k % sbl) * sbb / sbl;
        for (int64_t j = 0; j < prefetch_groups; j++)
            for (int64_t off = 0; off < sbb * 32 / sbl; off += 64)
                __builtin_prefetch(w + (2 * ng + j) * gb + at + off);
        for (int h = 0; h < 2; h++) {
            vi isum[MR8][NG8], p16[MR8][NG8];
            for (int i = 0; i < mr; i++) {
                const int64_t run = (i0 + i) * nr + k / 16 + h;
                const vi start = vi_set1(-carried(type) * x->n[run]);
                for (int j = 0; j < ng; j++) isum[i][j] = start, p16[i][j] = vi_set1(0);
            }
            for (int s = 4 * h; s < 4 * h + 4; s += 2) {
                vi x0[MR8], x1[MR8];
                for (int i = 0; i < mr; i++) {
                    int32_t a, c;
                    memcpy(&a, x->q + (i0 + i) * K + k + 4 * s, 4);
                    memcpy(&c, x->q + (i0 + i) * K + k + 4 * s + 4, 4);
                    x0[i] = vi_set1(a), x1[i] = vi_set1(c);
                }
                for (int j = 0; j < ng; j++) {
                    vi q0, q1;
                    quads(type, &sp[j], s, &q0, &q1);
                    for (int i = 0; i < mr; i++) {
                        if (!WIDE_QUADS(type)) {
                            isum[i][j] = dot(type, dot(type, isum[i][j], q0, x0[i]), q1, x1[i]);
                            continue;
                        }
                        p16[i][j] = vi_add16(vi_add16(p16[i][j], vi_pairs16_u8s8(q0, x0[i])),
                                             vi_pairs16_u8s8(q1, x1[i]));
                        if (WIDE_QUADS(type) == 2) {
                            isum[i][j] = vi_widen16(isum[i][j], p16[i][j]);
                            p16[i][j] = vi_set1(0);
                        }
                    }
                }
            }
            if (WIDE_QUADS(type) == 4)
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < ng; j++) isum[i][j] = vi_widen16(isum[i][j], p16[i][j]);
            for (int j = 0; j < ng; j++) {
                const vf scale = sp[j].scale[type == Q6_K ? h : 0];
                for (int i = 0; i < mr; i++) {
                    const int64_t run = (i0 + i) * nr + k / 16 + h;
                    acc[i][j] = vf_fma(vf_mul(vf_from_i(isum[i][j]), vf_set1(x->d[run])), scale,
                                       acc[i][j]);
                    if (affine) acc[i][j] = vf_fma(sp[j].off, vf_set1(x->s[run]), acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) {
            if (j < ng - 1 || nlast == 16) vf_store(y + i * ldy + 16 * j, acc[i][j]);
            else vf_store_n(y + i * ldy + 16 * j, acc[i][j], nlast);
        }
}

#define I8_TYPES(X) X(Q4_0) X(Q4_1) X(Q5_0) X(Q8_0) X(Q4_K) X(Q5_K) X(Q6_K)

/* the tile specialised for its type and shape */
static void tile_any(int type, const xq8 *x, int64_t i0, const uint8_t *w, int64_t gb, float *y,
                     int64_t ldy, int mr, int ng, int nlast, int64_t prefetch_groups) {
#define S(t, m, g) \
    case (t) * 64 + (m) * 8 + (g) - 9: \
        tile_t(t, x, i0, w, gb, y, ldy, m, g, nlast, prefetch_groups); \
        return;
#if MR8 == 4
#define X(t) S(t, 1, 3) S(t, 2, 3) S(t, 3, 3) S(t, 4, 3) S(t, 1, 1) S(t, 2, 1) S(t, 3, 1) S(t, 4, 1)
#else
#define X(t) S(t, 1, NG8) S(t, 1, 1)
#endif
    switch (type * 64 + mr * 8 + ng - 9) {
    I8_TYPES(X)
    }
#undef X
#undef S
}

typedef struct {
    const float *x;
    int64_t ldx;
    xq8 xq;
    int64_t M;
    const kiln_part *parts;
    int64_t nparts;
    const float *bias;
    float *y;
    int64_t ldy;
} i8_args;

static void quantize_task(void *ctx, int tid, int nt) {
    const i8_args *a = ctx;
    int64_t m0, m1;
    kiln_share(a->M, tid, nt, &m0, &m1);
    for (int64_t m = m0; m < m1; m++) quantize_row(a->x + m * a->ldx, &a->xq, m);
}

#define MC8 128 /* rows of x per pass over a range of groups */

/* groups [g0, g1) of one part: its columns of y */
static void part_range(const void *ctx, const kiln_part *part, int64_t g0, int64_t g1) {
    const i8_args *a = ctx;
    const int type = (int)part->type;
    const int64_t M = a->M, N = part->rows, ldy = a->ldy;
    const int64_t gb = kiln_group_bytes(type, a->xq.K);
    const int full = groups_for(M, gb * ((N + 15) / 16));
    float *y = a->y + part->col0;
    for (int64_t m0 = 0; m0 < M; m0 += MC8) {
        const int64_t m1 = m0 + MC8 < M ? m0 + MC8 : M;
        for (int64_t g = g0; g < g1;) {
            const int ng = g1 - g >= full ? full : 1;
            const int64_t ncols = N - g * 16 < ng * 16 ? N - g * 16 : ng * 16;
            const int64_t ahead = g1 - (g + 2 * ng);
            for (int64_t m = m0; m < m1; m += MR8)
                tile_any(type, &a->xq, m, part->blocks + g * gb, gb, y + m * ldy + 16 * g, ldy,
                         (int)(m1 - m < MR8 ? m1 - m : MR8), ng, (int)(ncols - (ng - 1) * 16),
                         m == m0 ? (ahead < 0 ? 0 : ahead < ng ? ahead : ng) : 0);
            if (a->bias) {
                const float *bias = a->bias + part->col0;
                for (int64_t m = m0; m < m1; m++)
                    for (int64_t n = 16 * g; n < 16 * g + ncols; n++) y[m * ldy + n] += bias[n];
            }
            g += ng;
        }
    }
}

static void product_task(void *ctx, int tid, int nt) {
    const i8_args *a = ctx;
    share_groups(a->parts, a->nparts, tid, nt, part_range, a);
}

/* Whether the 8-bit products take a GGUF type (the float types stay on linear.c's). */
int kiln_i8_type(int type) {
    switch (type) {
#define X(t) case t: return 1;
    I8_TYPES(X)
#undef X
    }
    return 0;
}

/* x [M, K] (row stride ldx, K a multiple of 32) -> y [M, N] (row stride ldy), N the parts'
 * rows together, each part packed in the "i8" layout; bias [N] or NULL. Returns -1 where
 * the scratch cannot be allocated. */
int kiln_linear_i8(const float *x, int64_t M, int64_t K, int64_t ldx, const kiln_part *parts,
                   int64_t nparts, const float *bias, float *y, int64_t ldy, int nthreads) {
    if (M == 0) return 0;
    const int64_t nr = K / 16;
    char *scratch = malloc(M * K + sizeof(float) * M * nr * 3);
    if (!scratch) return -1;
    float *f = (float *)(scratch + M * K);
    i8_args a = {x, ldx, {(int8_t *)scratch, f, f + M * nr, (int32_t *)(f + 2 * M * nr), K},
                 M, parts, nparts, bias, y, ldy};
    kiln_parallel(quantize_task, &a, M > 16 ? nthreads : 1);
    kiln_parallel(product_task, &a, nthreads);
    free(scratch);
    return 0;
}
