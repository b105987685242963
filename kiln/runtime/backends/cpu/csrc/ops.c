/* The row-wise operations of a transformer layer. Each row is computed on its own, in one
 * fixed order, so threads (over rows, for long prefill chunks) change nothing. */
#include <math.h>

#include "pool.h"
#include "simd.h"

#define PAR_ROWS 64  /* below this many rows one thread is quicker than waking the team */

typedef struct {
    const float *x;
    int64_t x_tok, x_head, T, H, n;
    const float *w;
    float eps;
    float *out;
    int64_t o_tok, o_head;
} norm_args;

static void rms_norm_task(void *ctx, int tid, int nt) {
    const norm_args *a = ctx;
    const int64_t n = a->n;
    int64_t r0, r1;
    kiln_share(a->T * a->H, tid, nt, &r0, &r1);
    for (int64_t row = r0; row < r1; row++) {
        const int64_t t = row / a->H, h = row % a->H;
        const float *xr = a->x + t * a->x_tok + h * a->x_head;
        float *o = a->out + t * a->o_tok + h * a->o_head;
        vf acc = vf_zero();
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const vf v = vf_load(xr + i);
            acc = vf_fma(v, v, acc);
        }
        if (i < n) {
            const vf v = vf_load_n(xr + i, (int)(n - i));
            acc = vf_fma(v, v, acc);
        }
        const vf inv = vf_set1(1.0f / sqrtf(vf_sum(acc) / (float)n + a->eps));
        for (i = 0; i + 16 <= n; i += 16)
            vf_store(o + i, vf_mul(vf_mul(vf_load(xr + i), inv), vf_load(a->w + i)));
        if (i < n) {
            const int r = (int)(n - i);
            vf_store_n(o + i, vf_mul(vf_mul(vf_load_n(xr + i, r), inv), vf_load_n(a->w + i, r)), r);
        }
    }
}

/* x: rows (t, h) at x + t * x_tok + h * x_head, n values each -> out (same indexing, may be
 * x). y = x * (1 / sqrt(mean(x^2) + eps)) * w; the sum of squares in one fixed order. */
void kiln_rms_norm(const float *x, int64_t x_tok, int64_t x_head, int64_t T, int64_t H,
                   int64_t n, const float *w, float eps, float *out, int64_t o_tok,
                   int64_t o_head, int nthreads) {
    norm_args a = {x, x_tok, x_head, T, H, n, w, eps, out, o_tok, o_head};
    kiln_parallel(rms_norm_task, &a, T * H >= PAR_ROWS ? nthreads : 1);
}

typedef struct {
    float *x;
    int64_t x_tok, x_head, T, H, rot;
    const int64_t *positions;
    const float *cos_t, *sin_t;
} rope_args;

static void rope_task(void *ctx, int tid, int nt) {
    const rope_args *a = ctx;
    const int64_t half = a->rot / 2;
    int64_t t0, t1;
    kiln_share(a->T, tid, nt, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const float *c = a->cos_t + a->positions[t] * half, *s = a->sin_t + a->positions[t] * half;
        for (int64_t h = 0; h < a->H; h++) {
            float *x1 = a->x + t * a->x_tok + h * a->x_head, *x2 = x1 + half;
            int64_t i = 0;
            for (; i + 16 <= half; i += 16) {
                const vf u = vf_load(x1 + i), v = vf_load(x2 + i);
                const vf cv = vf_load(c + i), sv = vf_load(s + i);
                vf_store(x1 + i, vf_sub(vf_mul(u, cv), vf_mul(v, sv)));
                vf_store(x2 + i, vf_add(vf_mul(v, cv), vf_mul(u, sv)));
            }
            for (; i < half; i++) {
                const float u = x1[i], v = x2[i];
                x1[i] = u * c[i] - v * s[i];
                x2[i] = v * c[i] + u * s[i];
            }
        }
    }
}

/* NeoX rotation (rotate_half) of the first rot values of each head, in place:
 * x[t, h, :rot] with x1 its first half and x2 its second -> (x1 c - x2 s, x2 c + x1 s).
 * cos, sin: [max_position, rot / 2]; positions [T]. */
void kiln_rope(float *x, int64_t x_tok, int64_t x_head, int64_t T, int64_t H, int64_t rot,
               const int64_t *positions, const float *cos_t, const float *sin_t, int nthreads) {
    rope_args a = {x, x_tok, x_head, T, H, rot, positions, cos_t, sin_t};
    kiln_parallel(rope_task, &a, T >= PAR_ROWS ? nthreads : 1);
}

INLINE vf silu(vf g) { return vf_div(g, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), g)))); }

/* 0.5 g (1 + tanh(u)) written as g / (1 + exp(-2u)): the same function, without the
 * cancellation of 1 + tanh(u) where tanh is near -1 */
INLINE vf gelu_tanh(vf g) {
    const vf u = vf_mul(vf_set1(0.7978845608028654f),
                        vf_add(g, vf_mul(vf_set1(0.044715f), vf_mul(g, vf_mul(g, g)))));
    return vf_div(g, vf_add(vf_set1(1.0f), vf_exp(vf_mul(vf_set1(-2.0f), u))));
}

typedef struct {
    const float *gate_up;
    int64_t gu_tok, T, F;
    int kind;
    float *out;
    int64_t o_tok;
} act_args;

static void act_task(void *ctx, int tid, int nt) {
    const act_args *a = ctx;
    const int64_t F = a->F;
    int64_t t0, t1;
    kiln_share(a->T, tid, nt, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const float *g = a->gate_up + t * a->gu_tok, *u = g + F;
        float *o = a->out + t * a->o_tok;
        int64_t i = 0;
        for (; i + 16 <= F; i += 16) {
            const vf gv = vf_load(g + i);
            vf_store(o + i, vf_mul(a->kind ? gelu_tanh(gv) : silu(gv), vf_load(u + i)));
        }
        if (i < F) {
            const int r = (int)(F - i);
            const vf gv = vf_load_n(g + i, r);
            vf_store_n(o + i, vf_mul(a->kind ? gelu_tanh(gv) : silu(gv), vf_load_n(u + i, r)), r);
        }
    }
}

/* gate_up [T, 2F] (gate, then up) -> out [T, F] = act(gate) * up; kind 0 silu, 1 gelu_tanh */
void kiln_act_mul(const float *gate_up, int64_t gu_tok, int64_t T, int64_t F, int kind,
                  float *out, int64_t o_tok, int nthreads) {
    act_args a = {gate_up, gu_tok, T, F, kind, out, o_tok};
    kiln_parallel(act_task, &a, T >= PAR_ROWS / 4 ? nthreads : 1);
}
