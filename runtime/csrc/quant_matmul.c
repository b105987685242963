/* y[M, N] = x[M, K] @ W[N, K]^T with W kept in the GGUF's own 32-weight blocks.
 *
 * Each block is dequantized in registers exactly as the gguf package dequantizes it
 * (Q4_1: d * q + m, Q8_0: d * q; d * q is exact in fp32, so fma(q, d, m) rounds once, as
 * numpy's d * q + m does), then multiplied with fp32 activations: the same weights as the
 * fp32 path, with 4.5 / 8.5 bits read per weight instead of 32. Only the order of the
 * additions differs from a BLAS product.
 *
 * Built on first use by runtime/quant_linear.py (cc -O3 -march=native -fopenmp) for AVX-512
 * (16 lanes) or AVX2 (8 lanes); without AVX2 it does not build and kiln keeps fp32 products.
 * Every output element is summed in the same order whatever M and the thread count.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define QK 32   /* weights per block */

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vbcast(float a) { return _mm512_set1_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vhsum(vf v) { return _mm512_reduce_add_ps(v); }
/* VL bytes -> VL ints */
static inline __m512i u8_to_i32(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline __m512i s8_to_i32(const int8_t *p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline vf nibble_lo(__m512i q) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
}
static inline vf nibble_hi(__m512i q) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)); }
static inline vf i32_to_f(__m512i q) { return _mm512_cvtepi32_ps(q); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VL 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vbcast(float a) { return _mm256_set1_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vhsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m256i u8_to_i32(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline __m256i s8_to_i32(const int8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline vf nibble_lo(__m256i q) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15)));
}
static inline vf nibble_hi(__m256i q) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)); }
static inline vf i32_to_f(__m256i q) { return _mm256_cvtepi32_ps(q); }
#else
#error "kiln's block products need AVX2, FMA and F16C (or AVX-512)"
#endif

#if VL == 16
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
#else
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
#endif

#define NV (QK / VL) /* vectors per block */
#define MT 4         /* activation rows per pass over a weight row */
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead */
#endif
#define INLINE static inline __attribute__((always_inline))

/* One block as NV vectors, w[j] holding weights j*VL .. j*VL + VL - 1. */
INLINE void q4_1_block(const uint8_t *qs, float d, float m, vf *w) {
    const vf db = vbcast(d), mb = vbcast(m);
    for (int c = 0; c < NV / 2; c++) {  /* byte j holds weight j (low) and j + 16 (high) */
        const __typeof__(u8_to_i32(qs)) q = u8_to_i32(qs + c * VL);
        w[c] = vfma(nibble_lo(q), db, mb);
        w[NV / 2 + c] = vfma(nibble_hi(q), db, mb);
    }
}

INLINE void q8_0_block(const int8_t *qs, float d, vf *w) {
    const vf db = vbcast(d);
    for (int c = 0; c < NV; c++) w[c] = vmul(i32_to_f(s8_to_i32(qs + c * VL)), db);
}

/* Blocks as the GGUF stores them: Q4_0 is 18 bytes (d as fp16, then 16 bytes of nibbles:
 * byte j holds weight j in its low half and weight j + 16 in its high half; w = d * (q - 8)),
 * Q4_1 is 20 (d and m as fp16, the nibbles; w = d * q + m) and Q8_0 is 34 (d as fp16, 32
 * int8 weights; w = d * q). */
enum kind { Q4_0, Q4_1, Q8_0 };
static const int64_t block_bytes[] = {18, 20, 34};

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

INLINE void block(const enum kind kind, const uint8_t *blk, vf *w) {
    if (kind == Q8_0) {
        q8_0_block((const int8_t *)(blk + 2), fp16(blk), w);
    } else if (kind == Q4_1) {
        q4_1_block(blk + 4, fp16(blk), fp16(blk + 2), w);
    } else {  /* d * (q - 8) = d * q - 8 * d, both sides exact in fp32 */
        const float d = fp16(blk);
        q4_1_block(blk + 2, d, -8.0f * d, w);
    }
}

/* mt (a constant after inlining: 1, 2 or 4) activation rows against one weight row. The
 * accumulators stay in registers: one per vector of a block and per parity of the block
 * index, so a row's sum is 2 * NV independent chains of FMAs (one chain stalls on the FMA's
 * latency). The order of the sums is the same for every mt. */
INLINE void dot_rows(const enum kind kind, const float *x, int64_t K, const uint8_t *row,
                     float *y, int64_t ldy, const int mt) {
    vf acc[2][MT][NV];
    for (int u = 0; u < 2; u++)
        for (int i = 0; i < mt; i++)
            for (int c = 0; c < NV; c++) acc[u][i][c] = vzero();
    const int64_t nb = K / QK, bytes = block_bytes[kind];
    for (int64_t off = 0; off < nb * bytes; off += 64) __builtin_prefetch(row + PREFETCH + off);
    for (int64_t b = 0; b < nb; b += 2) {
        for (int u = 0; u < 2 && b + u < nb; u++) {
            vf w[NV];
            block(kind, row + (b + u) * bytes, w);
            for (int i = 0; i < mt; i++) {
                const float *xr = x + i * K + (b + u) * QK;
                for (int c = 0; c < NV; c++)
                    acc[u][i][c] = vfma(vload(xr + c * VL), w[c], acc[u][i][c]);
            }
        }
    }
    for (int i = 0; i < mt; i++) {
        vf s = vzero();
        for (int c = 0; c < NV; c++) s = s + acc[0][i][c] + acc[1][i][c];
        y[i * ldy] = vhsum(s);
    }
}

INLINE void matmul_row(const enum kind kind, const float *x, int64_t M, int64_t K,
                       const uint8_t *row, float *y, int64_t ldy) {
    int64_t i = 0;
    for (; i + 4 <= M; i += 4) dot_rows(kind, x + i * K, K, row, y + i * ldy, ldy, 4);
    for (; i + 2 <= M; i += 2) dot_rows(kind, x + i * K, K, row, y + i * ldy, ldy, 2);
    for (; i < M; i++) dot_rows(kind, x + i * K, K, row, y + i * ldy, ldy, 1);
}

/* x [M, K] fp32 (rows contiguous), w [N, K / 32 blocks] as in the GGUF, y [M, N]. Rows of
 * W are shared out between the threads; each output is one thread's sum in block order. */
#define MATMUL(name, kind)                                                                   \
    void name(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,   \
              int nthreads) {                                                                \
        const int64_t row_bytes = K / QK * block_bytes[kind];                                \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                   \
        for (int64_t n = 0; n < N; n++) matmul_row(kind, x, M, K, w + n * row_bytes, y + n, N); \
    }

MATMUL(q4_0_matmul, Q4_0)
MATMUL(q4_1_matmul, Q4_1)
MATMUL(q8_0_matmul, Q8_0)
