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
 * Work: threads share out the groups; each dequantizes KC k of NG groups into a buffer in
 * L1 (once for all rows of an M block) and runs the MR x NG tile over it. */
#include <omp.h>
#include <stdlib.h>
#include "simd.h"

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, BF16 = 30 };

/* k a super-block spans, and its bytes for a group of 16 rows (see packing.py) */
static int64_t sb_len(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 1;
    }
}
static int64_t sb_bytes(int type) {
    switch (type) {
    case Q4_0: return 288;   /* d[16] f16 | 16 pairs of 4-bit planes */
    case Q4_1: return 320;   /* d | m | planes */
    case Q5_0: return 352;   /* d | fifth bits, 32 x u16 | planes */
    case Q8_0: return 544;   /* d | 32 x 16 int8 */
    case Q4_K: return 2368;  /* d | dmin | 8 x 16 u8 scales | 8 x 16 u8 mins | 128 planes */
    case Q5_K: return 2880;  /* Q4_K's | fifth bits, 256 x u16 */
    case Q6_K: return 3360;  /* d | 16 x 16 int8 scales | 128 planes | top bits, 256 x u32 */
    case F16: case BF16: return 32;
    case F32: return 64;
    default: return 0;
    }
}

int64_t kiln_group_bytes(int type, int64_t K) {
    const int64_t sb = sb_len(type), b = sb_bytes(type);
    if (!b || K % sb) return -1;
    return K / sb * b;
}

INLINE vf vf_f16x16(const uint8_t *p) { return vf_load_f16((const uint16_t *)p); }

/* Two k from a byte plane (k0 in the low nibbles, k1 in the high), plus their top bits, ->
 * o[0..15] and o[os..os + 15]. Affine types: q * scale + off (one rounding, as numpy's
 * d * q + m); the others (q - bias) * scale, as the gguf package computes them, zero signs
 * included. */
INLINE void put_pair(const uint8_t *lo, vi hi0, vi hi1, vf scale, vf off, int bias, float *o,
                     int64_t os) {
    const vi v = vi_load_u8(lo);
    const vi q0 = vi_or(vi_and(v, vi_set1(15)), hi0), q1 = vi_or(vi_srli(v, 4), hi1);
    if (bias) {
        vf_store(o, vf_mul(vf_from_i(vi_add(q0, vi_set1(-bias))), scale));
        vf_store(o + os, vf_mul(vf_from_i(vi_add(q1, vi_set1(-bias))), scale));
    } else {
        vf_store(o, vf_fma(vf_from_i(q0), scale, off));
        vf_store(o + os, vf_fma(vf_from_i(q1), scale, off));
    }
}

/* bit r of a 16-bit word (Q5's fifth bits) -> 16 in lane r */
INLINE vi hi1_bits(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return vi_slli(vi_and(vi_srlv(vi_set1(h), vi_lanes()), vi_set1(1)), 4);
}
/* bits 2r, 2r + 1 of a 32-bit word (Q6_K's top two) -> lane r, as bits 4 and 5 */
INLINE vi hi2_bits(const uint8_t *p) {
    uint32_t h;
    memcpy(&h, p, 4);
    const vi shift = vi_add(vi_lanes(), vi_lanes());
    return vi_slli(vi_and(vi_srlv(vi_set1((int)h), shift), vi_set1(3)), 4);
}

/* One group's weights for k in [k0, k1) (on 32-boundaries for quantized types) into
 * o[(k - k0) * os + lane]: the gguf package's values, bit for bit. */
static void dequant(int type, const uint8_t *g, int64_t k0, int64_t k1, float *o, int64_t os) {
    const int64_t sbl = sb_len(type), sbb = sb_bytes(type);
    const vi zero = vi_set1(0);
    for (int64_t k = k0; k < k1;) {
        const uint8_t *sb = g + (k / sbl) * sbb;
        const int64_t in = k % sbl;  /* k's place in its super-block */
        switch (type) {
        case F32:
            vf_store(o, vf_load((const float *)sb));
            k++, o += os;
            break;
        case F16:
            vf_store(o, vf_f16x16(sb));
            k++, o += os;
            break;
        case BF16:
            vf_store(o, vf_cast_i(vi_slli(vi_load_u16((const uint16_t *)sb), 16)));
            k++, o += os;
            break;
        case Q8_0: {
            const vf d = vf_f16x16(sb);
            for (int j = 0; j < 32; j++, o += os)
                vf_store(o, vf_mul(vf_from_i(vi_load_s8((const int8_t *)sb + 32 + 16 * j)), d));
            k += 32;
            break;
        }
        case Q4_0: case Q4_1: case Q5_0: {
            const vf d = vf_f16x16(sb);
            const vf off = type == Q4_1 ? vf_f16x16(sb + 32) : vf_zero();
            const int bias = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
            const uint8_t *planes = sb + (type == Q4_0 ? 32 : type == Q4_1 ? 64 : 96);
            for (int p = 0; p < 16; p++, o += 2 * os) {
                vi h0 = zero, h1 = zero;
                if (type == Q5_0) h0 = hi1_bits(sb + 32 + 4 * p), h1 = hi1_bits(sb + 34 + 4 * p);
                put_pair(planes + 16 * p, h0, h1, d, off, bias, o, os);
            }
            k += 32;
            break;
        }
        case Q4_K: case Q5_K: {
            const int j = (int)(in / 32);
            const vf d = vf_f16x16(sb), dmin = vf_f16x16(sb + 32);
            const vf scale = vf_mul(d, vf_from_i(vi_load_u8(sb + 64 + 16 * j)));
            const vf off = vf_sub(vf_zero(), vf_mul(dmin, vf_from_i(vi_load_u8(sb + 192 + 16 * j))));
            const uint8_t *planes = sb + 320 + in / 2 * 16;
            for (int p = 0; p < 16; p++, o += 2 * os) {
                vi h0 = zero, h1 = zero;
                if (type == Q5_K) {
                    const uint8_t *hb = sb + 2368 + (in + 2 * p) * 2;
                    h0 = hi1_bits(hb), h1 = hi1_bits(hb + 2);
                }
                put_pair(planes + 16 * p, h0, h1, scale, off, 0, o, os);
            }
            k += 32;
            break;
        }
        case Q6_K: {
            const vf d = vf_f16x16(sb);
            for (int half = 0; half < 2; half++) {
                const int64_t kk = in + 16 * half;
                const vf scale = vf_mul(d, vf_from_i(vi_load_s8((const int8_t *)sb + 32 + kk)));
                for (int p = 0; p < 8; p++, o += 2 * os) {
                    const int64_t kp = kk + 2 * p;
                    const uint8_t *hb = sb + 2336 + kp * 4;
                    put_pair(sb + 288 + kp / 2 * 16, hi2_bits(hb), hi2_bits(hb + 4), scale,
                             vf_zero(), 32, o, os);
                }
            }
            k += 32;
            break;
        }
        default:
            return;
        }
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

/* Rows ids[0..T) of W (an embedding table) -> out [T, K] */
void kiln_embed(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t T,
                float *out, int nthreads) {
    const int64_t gb = kiln_group_bytes(type, K), KC = 256;
#pragma omp parallel for num_threads(nthreads) if (T > 32) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float buf[256 * 16] __attribute__((aligned(64)));
        const int64_t g = ids[t] / 16, r = ids[t] % 16;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t k1 = k0 + KC < K ? k0 + KC : K;
            dequant(type, w + g * gb, k0, k1, buf, 16);
            for (int64_t k = k0; k < k1; k++) out[t * K + k] = buf[(k - k0) * 16 + r];
        }
    }
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

/* x [M, K] (row stride ldx) -> y [M, N] (row stride ldy); bias [N] or NULL */
void kiln_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                 int type, int64_t N, const float *bias, float *y, int64_t ldy, int nthreads) {
    const int64_t G = (N + 15) / 16, gb = kiln_group_bytes(type, K);
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t g0 = G * tid / nt, g1 = G * (tid + 1) / nt;
        float buf[KC * NG * 16] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t m1 = m0 + MC < M ? m0 + MC : M;
            for (int64_t g = g0; g < g1; g += NG) {
                const int ng = (int)(g1 - g < NG ? g1 - g : NG);
                const int64_t ncols = N - g * 16 < ng * 16 ? N - g * 16 : ng * 16;
                const int nlast = (int)(ncols - (ng - 1) * 16);
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t kc = K - k0 < KC ? K - k0 : KC;
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
}
