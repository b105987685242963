/* The GGUF block types the CPU kernels read, and what the packed layout (packing.py) keeps
 * per super-block of a group of 16 rows: shared by the fp32 products (linear.c) and the
 * 8-bit ones (linear_i8.c), which differ only in how the quants of a span are ordered. */
#pragma once
#include "pool.h"
#include "simd.h"

/* One GGUF tensor of a layer's weight (Q, K and V, say, stacked along the outputs, may each
 * have their own type): its rows are outputs [col0, col0 + rows) of the product. */
typedef struct {
    int64_t type, rows, col0;
    const uint8_t *blocks;
} kiln_part;

/* bytes of one group of 16 rows over K (-1 where K is not whole super-blocks) */
int64_t kiln_group_bytes(int type, int64_t K);

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, BF16 = 30 };

/* k a super-block spans, and its bytes for a group of 16 rows (see packing.py) */
static inline int64_t sb_len(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 1;
    }
}
static inline int64_t sb_bytes(int type) {
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

INLINE vf vf_f16x16(const uint8_t *p) { return vf_load_f16((const uint16_t *)p); }

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

/* What the weights of one group's 32 k starting at a multiple of 32 need: their scales and
 * where their quants are. */
typedef struct {
    vf scale[2];          /* Q6_K's second 16 k have a scale of their own */
    vf off;               /* affine types: w = q * scale + off */
    const uint8_t *planes; /* pair p of k in 16 bytes at planes + 16 p */
    const uint8_t *hi;    /* the fifth bits (u16 per k) or Q6_K's top two (u32 per k) */
    const uint8_t *raw;   /* float types and Q8_0: 16 values per k */
} span;

/* The constant the other quantized types' quants carry: w = (q - bias) * scale */
INLINE int quant_bias(const int type) {
    return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q6_K ? 32 : 0;
}

INLINE void span_of(const int type, const uint8_t *g, int64_t k, span *s) {
    const int64_t sbl = sb_len(type);
    const uint8_t *sb = g + (k / sbl) * sb_bytes(type);
    const int64_t in = k % sbl; /* k's place in its super-block */
    s->off = vf_zero();
    s->hi = NULL;
    switch (type) {
    case F32: s->raw = g + k * 64; break;
    case F16: case BF16: s->raw = g + k * 32; break;
    case Q8_0:
        s->scale[0] = vf_f16x16(sb);
        s->raw = sb + 32;
        break;
    case Q4_0: case Q4_1: case Q5_0:
        s->scale[0] = vf_f16x16(sb);
        if (type == Q4_1) s->off = vf_f16x16(sb + 32);
        s->planes = sb + (type == Q4_0 ? 32 : type == Q4_1 ? 64 : 96);
        if (type == Q5_0) s->hi = sb + 32;
        break;
    case Q4_K: case Q5_K: {
        const int j = (int)(in / 32);
        s->scale[0] = vf_mul(vf_f16x16(sb), vf_from_i(vi_load_u8(sb + 64 + 16 * j)));
        s->off = vf_sub(vf_zero(), vf_mul(vf_f16x16(sb + 32), vf_from_i(vi_load_u8(sb + 192 + 16 * j))));
        s->planes = sb + 320 + in / 2 * 16;
        if (type == Q5_K) s->hi = sb + 2368 + in * 2;
        break;
    }
    case Q6_K: {
        const vf d = vf_f16x16(sb);
        for (int h = 0; h < 2; h++)
            s->scale[h] = vf_mul(d, vf_from_i(vi_load_s8((const int8_t *)sb + 32 + in + 16 * h)));
        s->planes = sb + 288 + in / 2 * 16;
        s->hi = sb + 2336 + in * 4;
        break;
    }
    }
}


/* Thread tid of nt's share of a product's output groups (16 rows of W each), counted over all
 * parts together: range(ctx, part, g0, g1) for each part's groups [g0, g1) in the share. */
typedef void (*part_range_fn)(const void *ctx, const kiln_part *part, int64_t g0, int64_t g1);
static inline void share_groups(const kiln_part *parts, int64_t nparts, int tid, int nt,
                                part_range_fn range, const void *ctx) {
    int64_t total = 0;
    for (int64_t p = 0; p < nparts; p++) total += (parts[p].rows + 15) / 16;
    int64_t g0, g1, first = 0;
    kiln_share(total, tid, nt, &g0, &g1);
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t n = (parts[p].rows + 15) / 16;
        const int64_t lo = g0 > first ? g0 - first : 0, hi = g1 - first < n ? g1 - first : n;
        if (lo < hi) range(ctx, &parts[p], lo, hi);
        first += n;
    }
}
