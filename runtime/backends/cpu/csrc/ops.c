/* The row-wise operations of a transformer layer. Each row is computed on its own, in one
 * fixed order, so threads (over rows, for long prefill chunks) change nothing. */
#include <math.h>
#include "simd.h"

#define PAR_ROWS 64  /* below this many rows one thread is quicker than waking the team */

/* x: rows (t, h) at x + t * x_tok + h * x_head, n values each -> out (same indexing, may be
 * x). y = x * (1 / sqrt(mean(x^2) + eps)) * w; the sum of squares in one fixed order. */
void kiln_rms_norm(const float *x, int64_t x_tok, int64_t x_head, int64_t T, int64_t H,
                   int64_t n, const float *w, float eps, float *out, int64_t o_tok,
                   int64_t o_head, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (T * H >= PAR_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + t * x_tok + h * x_head;
            float *o = out + t * o_tok + h * o_head;
            vf acc = vf_zero();
            int64_t i = 0;
            for (; i + 16 <= n; i += 16) { vf v = vf_load(xr + i); acc = vf_fma(v, v, acc); }
            if (i < n) { vf v = vf_load_n(xr + i, (int)(n - i)); acc = vf_fma(v, v, acc); }
            const float inv = 1.0f / sqrtf(vf_sum(acc) / (float)n + eps);
            const vf iv = vf_set1(inv);
            for (i = 0; i + 16 <= n; i += 16)
                vf_store(o + i, vf_mul(vf_mul(vf_load(xr + i), iv), vf_load(w + i)));
            if (i < n) {
                const int r = (int)(n - i);
                vf_store_n(o + i, vf_mul(vf_mul(vf_load_n(xr + i, r), iv), vf_load_n(w + i, r)), r);
            }
        }
}

/* NeoX rotation (rotate_half) of the first rot_dim values of each head, in place:
 * x[t, h, :rot] with x1 = first half, x2 = second: (x1 c - x2 s, x2 c + x1 s).
 * cos, sin: [max_position, rot / 2]; positions [T]. */
void kiln_rope(float *x, int64_t x_tok, int64_t x_head, int64_t T, int64_t H, int64_t rot,
               const int64_t *positions, const float *cos_t, const float *sin_t, int nthreads) {
    const int64_t half = rot / 2;
#pragma omp parallel for num_threads(nthreads) if (T >= PAR_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;
        for (int64_t h = 0; h < H; h++) {
            float *a = x + t * x_tok + h * x_head, *b = a + half;
            int64_t i = 0;
            for (; i + 16 <= half; i += 16) {
                vf x1 = vf_load(a + i), x2 = vf_load(b + i), cv = vf_load(c + i), sv = vf_load(s + i);
                vf_store(a + i, vf_sub(vf_mul(x1, cv), vf_mul(x2, sv)));
                vf_store(b + i, vf_add(vf_mul(x2, cv), vf_mul(x1, sv)));
            }
            for (; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* gate_up [T, 2F] (gate, then up) -> out [T, F] = act(gate) * up */
INLINE vf silu(vf g) { return vf_div(g, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), g)))); }
/* 0.5 g (1 + tanh(u)) written as g / (1 + exp(-2u)): the same function, without the
 * cancellation of 1 + tanh(u) where tanh is near -1 */
INLINE vf gelu_tanh(vf g) {
    const vf u = vf_mul(vf_set1(0.7978845608028654f),
                        vf_add(g, vf_mul(vf_set1(0.044715f), vf_mul(g, vf_mul(g, g)))));
    return vf_div(g, vf_add(vf_set1(1.0f), vf_exp(vf_mul(vf_set1(-2.0f), u))));
}

void kiln_act_mul(const float *gate_up, int64_t gu_tok, int64_t T, int64_t F, int kind,
                  float *out, int64_t o_tok, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (T >= PAR_ROWS / 4) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * gu_tok, *u = g + F;
        float *o = out + t * o_tok;
        int64_t i = 0;
        for (; i + 16 <= F; i += 16) {
            const vf gv = vf_load(g + i);
            vf_store(o + i, vf_mul(kind ? gelu_tanh(gv) : silu(gv), vf_load(u + i)));
        }
        if (i < F) {
            const int r = (int)(F - i);
            const vf gv = vf_load_n(g + i, r);
            vf_store_n(o + i, vf_mul(kind ? gelu_tanh(gv) : silu(gv), vf_load_n(u + i, r)), r);
        }
    }
}
