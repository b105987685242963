/* kiln's CPU kernels compute on a logical vector of 16 fp32 lanes, on AVX-512 (one register)
 * or AVX2 (two).
 *
 * Every kernel computes with these and never with the machine's native width, so an output
 * is the same sequence of IEEE operations (fma, add, mul, exactly rounded each) on either
 * instruction set: its bits do not depend on which one the library was built for. The
 * library is compiled with -ffp-contract=off, so the compiler fuses nothing on its own. */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#if !defined(__AVX512BW__)
#error "kiln's AVX-512 kernels need AVX-512BW (every AVX-512 CPU since Skylake-SP has it)"
#endif
typedef __m512 vf;
typedef __m512i vi;
INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
INLINE vf vf_set1(float a) { return _mm512_set1_ps(a); }
INLINE vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
INLINE void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
INLINE vf vf_load_n(const float *p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
INLINE void vf_store_n(float *p, vf a, int n) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a);
}
INLINE vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INLINE vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
INLINE vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
INLINE vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
INLINE vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* lanes where a < b get 0, the others keep v */
INLINE vf vf_zero_where_lt(vf v, vf a, vf b) {
    return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), v);
}
INLINE vf vf_from_i(vi a) { return _mm512_cvtepi32_ps(a); }
INLINE vf vf_cast_i(vi a) { return _mm512_castsi512_ps(a); }
INLINE vi vi_set1(int a) { return _mm512_set1_epi32(a); }
INLINE vi vi_from_f(vf a) { return _mm512_cvtps_epi32(a); }
INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
INLINE vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
INLINE vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
INLINE vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
INLINE vi vi_srli(vi a, int n) { return _mm512_srli_epi32(a, n); }
INLINE vi vi_slli(vi a, int n) { return _mm512_slli_epi32(a, n); }
INLINE vi vi_srlv(vi a, vi n) { return _mm512_srlv_epi32(a, n); }
INLINE vi vi_lanes(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
/* 16 bytes -> 16 lanes */
INLINE vi vi_load_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
INLINE vi vi_load_s8(const int8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
INLINE vi vi_load_u16(const uint16_t *p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vf vf_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* (l + l+8), then + 4, + 2, + 1: the one order in which 16 lanes are summed */
INLINE float vf_sum(vf a) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
INLINE float vf_hmax(vf a) { return _mm512_reduce_max_ps(a); }
INLINE vf vf_abs(vf a) { return _mm512_abs_ps(a); }
/* lanes holding integers in [-128, 127] as 16 bytes */
INLINE void vi_store_s8(int8_t *p, vi a) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(a)); }
/* z where lo < k <= hi, -inf elsewhere */
INLINE vf vf_keep_in(vf z, vf k, vf lo, vf hi) {
    const __mmask16 in = _mm512_cmp_ps_mask(k, hi, _CMP_LE_OQ) & _mm512_cmp_ps_mask(k, lo, _CMP_GT_OQ);
    return _mm512_mask_mov_ps(_mm512_set1_ps(-__builtin_inff()), in, z);
}
/* The 8-bit products' vectors: 64 bytes as 16 lanes of four, lane r holding row r's four
 * k (linear_i8.c). */
INLINE vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
/* byte b = v where bit b of the 64-bit word at p is set, else 0 */
INLINE vi vi_bytes_where(const uint8_t *p, int v) {
    uint64_t m;
    memcpy(&m, p, 8);
    return _mm512_maskz_mov_epi8((__mmask64)m, _mm512_set1_epi8((char)v));
}
/* acc + the sum of each lane's four u8 x s8 products. Exact: VNNI does not saturate, and
 * maddubs's 16-bit pair sums cannot for the operands used here (u <= 128, |s| <= 127). */
INLINE vi vi_dot_u8s8(vi acc, vi u, vi s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
/* Without VNNI, a dot product is three instructions (maddubs, madd, add); these let a caller
 * add several quads' 16-bit pair sums before the one madd that widens them, where the
 * operands bound the sums (pairs16 of u <= 63 and |s| <= 127 is at most 16002 a lane). */
INLINE vi vi_pairs16_u8s8(vi u, vi s) { return _mm512_maddubs_epi16(u, s); }
INLINE vi vi_add16(vi a, vi b) { return _mm512_add_epi16(a, b); }
INLINE vi vi_widen16(vi acc, vi p) { return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1))); }
/* |w| bytewise, and s negated where w < 0: a signed x signed product as u8 x s8 */
INLINE vi vi_abs8(vi w) { return _mm512_abs_epi8(w); }
INLINE vi vi_sign8(vi s, vi w) {
    return _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(w), _mm512_setzero_si512(), s);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
typedef struct { __m256 lo, hi; } vf;
typedef struct { __m256i lo, hi; } vi;
#define VF2(expr_lo, expr_hi) ((vf){expr_lo, expr_hi})
#define VI2(expr_lo, expr_hi) ((vi){expr_lo, expr_hi})
INLINE vf vf_zero(void) { return VF2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
INLINE vf vf_set1(float a) { return VF2(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
INLINE vf vf_load(const float *p) { return VF2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
INLINE void vf_store(float *p, vf a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
INLINE __m256i mask8_(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
INLINE vf vf_load_n(const float *p, int n) {
    return VF2(_mm256_maskload_ps(p, mask8_(n)), _mm256_maskload_ps(p + 8, mask8_(n - 8)));
}
INLINE void vf_store_n(float *p, vf a, int n) {
    _mm256_maskstore_ps(p, mask8_(n), a.lo);
    _mm256_maskstore_ps(p + 8, mask8_(n - 8), a.hi);
}
INLINE vf vf_fma(vf a, vf b, vf c) { return VF2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
INLINE vf vf_mul(vf a, vf b) { return VF2(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
INLINE vf vf_add(vf a, vf b) { return VF2(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
INLINE vf vf_sub(vf a, vf b) { return VF2(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
INLINE vf vf_div(vf a, vf b) { return VF2(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
INLINE vf vf_max(vf a, vf b) { return VF2(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
INLINE vf vf_min(vf a, vf b) { return VF2(_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)); }
INLINE vf vf_round(vf a) {
    const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return VF2(_mm256_round_ps(a.lo, r), _mm256_round_ps(a.hi, r));
}
INLINE vf vf_zero_where_lt(vf v, vf a, vf b) {
    return VF2(_mm256_andnot_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), v.lo),
               _mm256_andnot_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ), v.hi));
}
INLINE vf vf_from_i(vi a) { return VF2(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
INLINE vf vf_cast_i(vi a) { return VF2(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)); }
INLINE vi vi_set1(int a) { return VI2(_mm256_set1_epi32(a), _mm256_set1_epi32(a)); }
INLINE vi vi_from_f(vf a) { return VI2(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)); }
INLINE vi vi_add(vi a, vi b) { return VI2(_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)); }
INLINE vi vi_and(vi a, vi b) { return VI2(_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)); }
INLINE vi vi_or(vi a, vi b) { return VI2(_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)); }
INLINE vi vi_xor(vi a, vi b) { return VI2(_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)); }
INLINE vi vi_srli(vi a, int n) { return VI2(_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)); }
INLINE vi vi_slli(vi a, int n) { return VI2(_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)); }
INLINE vi vi_srlv(vi a, vi n) { return VI2(_mm256_srlv_epi32(a.lo, n.lo), _mm256_srlv_epi32(a.hi, n.hi)); }
INLINE vi vi_lanes(void) {
    return VI2(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15));
}
INLINE vi vi_load_u8(const uint8_t *p) {
    return VI2(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
               _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}
INLINE vi vi_load_s8(const int8_t *p) {
    return VI2(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)),
               _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}
INLINE vi vi_load_u16(const uint16_t *p) {
    return VI2(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)),
               _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8))));
}
INLINE vf vf_load_f16(const uint16_t *p) {
    return VF2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
               _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}
INLINE float vf_sum(vf a) {
    __m256 s8 = _mm256_add_ps(a.lo, a.hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
INLINE float vf_hmax(vf a) {
    __m256 m8 = _mm256_max_ps(a.lo, a.hi);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}
INLINE vf vf_abs(vf a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return VF2(_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi));
}
INLINE void vi_store_s8(int8_t *p, vi a) {
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm_packs_epi16(_mm256_castsi256_si128(w),
                                                   _mm256_extracti128_si256(w, 1)));
}
INLINE vf vf_keep_in(vf z, vf k, vf lo, vf hi) {
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    const __m256 in_lo = _mm256_and_ps(_mm256_cmp_ps(k.lo, hi.lo, _CMP_LE_OQ), _mm256_cmp_ps(k.lo, lo.lo, _CMP_GT_OQ));
    const __m256 in_hi = _mm256_and_ps(_mm256_cmp_ps(k.hi, hi.hi, _CMP_LE_OQ), _mm256_cmp_ps(k.hi, lo.hi, _CMP_GT_OQ));
    return VF2(_mm256_blendv_ps(ninf, z.lo, in_lo), _mm256_blendv_ps(ninf, z.hi, in_hi));
}
INLINE vi vi_load(const void *p) {
    return VI2(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
/* byte b = 0xff where bit b of x is set */
INLINE __m256i bits32_(uint32_t x) {
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                             0x0101010101010101, 0);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread);
    return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                             _mm256_set1_epi64x(-1));
}
INLINE vi vi_bytes_where(const uint8_t *p, int v) {
    uint32_t a, b;
    memcpy(&a, p, 4);
    memcpy(&b, p + 4, 4);
    const __m256i val = _mm256_set1_epi8((char)v);
    return VI2(_mm256_and_si256(bits32_(a), val), _mm256_and_si256(bits32_(b), val));
}
INLINE vi vi_dot_u8s8(vi acc, vi u, vi s) {
    const __m256i one = _mm256_set1_epi16(1);
    return VI2(_mm256_add_epi32(acc.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(u.lo, s.lo), one)),
               _mm256_add_epi32(acc.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(u.hi, s.hi), one)));
}
INLINE vi vi_pairs16_u8s8(vi u, vi s) { return VI2(_mm256_maddubs_epi16(u.lo, s.lo), _mm256_maddubs_epi16(u.hi, s.hi)); }
INLINE vi vi_add16(vi a, vi b) { return VI2(_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)); }
INLINE vi vi_widen16(vi acc, vi p) {
    const __m256i one = _mm256_set1_epi16(1);
    return VI2(_mm256_add_epi32(acc.lo, _mm256_madd_epi16(p.lo, one)),
               _mm256_add_epi32(acc.hi, _mm256_madd_epi16(p.hi, one)));
}
INLINE vi vi_abs8(vi w) { return VI2(_mm256_abs_epi8(w.lo), _mm256_abs_epi8(w.hi)); }
INLINE vi vi_sign8(vi s, vi w) { return VI2(_mm256_sign_epi8(s.lo, w.lo), _mm256_sign_epi8(s.hi, w.hi)); }
#else
#error "kiln's CPU kernels need AVX2, FMA and F16C (or AVX-512)"
#endif

INLINE float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

/* exp(x), the same bits on either instruction set: Cephes' expf (about 1 ulp) with 2^n built
 * from its exponent bits; exp(x) = 0 below -87.33 (where 2^n would leave the normal range). */
INLINE vf vf_exp(vf x) {
    const vf lo = vf_set1(-87.3365447504f);
    vf xc = vf_min(vf_max(x, lo), vf_set1(88.0f));
    vf n = vf_round(vf_mul(xc, vf_set1(1.44269504088896341f)));
    vf r = vf_fma(n, vf_set1(-0.693359375f), xc);
    r = vf_fma(n, vf_set1(2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500E-4f);
    p = vf_fma(p, r, vf_set1(1.3981999507E-3f));
    p = vf_fma(p, r, vf_set1(8.3334519073E-3f));
    p = vf_fma(p, r, vf_set1(4.1665795894E-2f));
    p = vf_fma(p, r, vf_set1(1.6666665459E-1f));
    p = vf_fma(p, r, vf_set1(5.0000001201E-1f));
    p = vf_add(vf_fma(p, vf_mul(r, r), r), vf_set1(1.0f));
    vf pow2n = vf_cast_i(vi_slli(vi_add(vi_from_f(n), vi_set1(127)), 23));
    return vf_zero_where_lt(vf_mul(p, pow2n), x, lo);
}
