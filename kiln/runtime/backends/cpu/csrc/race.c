/* The sampler's draw on the CPU: the exponential race of kernels/sampling.py over a row's
 * surviving tokens, token = argmax_j p_j / E_j with E_j = -log U_j, ties to the lowest id.
 * In torch (sample_ref) it took most of a sampled step once the survivors are many (with
 * top_p 1, the whole vocabulary): a Philox stream, gathers and two scatters per token.
 *
 * U_j is Philox4x32-10 word 0 for counter (token, step, 0, 0) and key seed, mapped to [0, 1)
 * as Triton's tl.rand maps it: bit for bit the kernel's `_uniform` and `philox_uniform_ref`
 * (integer arithmetic, then one int -> float conversion and product). The score is sample_ref's
 * expression, exp((x - m) / t) / -log(u), in the same order; expf and logf may round apart
 * from torch's by an ulp, which could only change a draw whose two best scores are that
 * close. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"
#include "simd.h"

static inline float philox_uniform(uint64_t seed, uint64_t step, uint64_t token) {
    uint32_t c0 = (uint32_t)token, c1 = (uint32_t)step, c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        const uint64_t pb = (uint64_t)c2 * 0xCD9E8D57u, pa = (uint64_t)c0 * 0xD2511F53u;
        c0 = (uint32_t)(pb >> 32) ^ c1 ^ k0;
        c2 = (uint32_t)(pa >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)pb;
        c3 = (uint32_t)pa;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    int32_t x = (int32_t)c0;
    if (x < 0) x = -x - 1; /* ~x, as tl.rand folds the sign */
    return (float)x * 4.6566127342e-10f;
}

typedef struct {
    const int64_t *seeds, *steps, *tokens;
    float *out;
    int64_t n;
} philox_args;

static void philox_task(void *ctx, int tid, int nt) {
    const philox_args *a = ctx;
    int64_t i0, i1;
    kiln_share(a->n, tid, nt, &i0, &i1);
    for (int64_t i = i0; i < i1; i++)
        a->out[i] = philox_uniform((uint64_t)a->seeds[i], (uint64_t)a->steps[i],
                                   (uint64_t)a->tokens[i]);
}

/* out[i] = U[0, 1) for (seeds[i], steps[i], tokens[i]), i < n: int64 arrays, fp32 out (the
 * stream alone, for its test) */
void kiln_philox_uniform(const int64_t *seeds, const int64_t *steps, const int64_t *tokens,
                         int64_t n, float *out, int nthreads) {
    philox_args a = {seeds, steps, tokens, out, n};
    kiln_parallel(philox_task, &a, n >= 16384 ? nthreads : 1);
}

typedef struct {
    const float *x;
    int64_t ldx, V;
    const float *m, *thr, *temp, *min_p;
    const int64_t *seeds, *steps;
    int64_t R, stride;
    float *best;    /* [R, stride]: each thread's best score in its share of each row */
    int64_t *token; /* [R, stride]: and its token (-1: none, or a thread that did not run) */
} race_args;

#define RACE_CHUNK 1024 /* tokens whose uniforms are made at once (a loop that vectorises) */

/* Every row's tokens are shared out over the threads (one row at one stream is most of the
 * work); each keeps its best in its share, merged after: the winner is the same whatever the
 * split, the comparisons being exact. */
static void race_task(void *ctx, int tid, int nt) {
    const race_args *a = ctx;
    int64_t j0, j1;
    kiln_share(a->V, tid, nt, &j0, &j1);
    float u[RACE_CHUNK];
    for (int64_t r = 0; r < a->R; r++) {
        const float *x = a->x + r * a->ldx;
        const float m = a->m[r], thr = a->thr[r], t = a->temp[r];
        const float min_p = a->min_p ? a->min_p[r] : 0.0f;
        const uint64_t seed = (uint64_t)a->seeds[r], step = (uint64_t)a->steps[r];
        float best = -1.0f;
        int64_t token = -1;
        for (int64_t c = j0; c < j1; c += RACE_CHUNK) {
            const int64_t n = j1 - c < RACE_CHUNK ? j1 - c : RACE_CHUNK;
            for (int64_t i = 0; i < n; i++) u[i] = philox_uniform(seed, step, (uint64_t)(c + i));
            for (int64_t i = 0; i < n; i++) {
                const float v = x[c + i];
                if (!(v >= thr) || v == -INFINITY) continue;
                if (a->min_p && !(expf(v - m) >= min_p)) continue;
                const float score = expf((v - m) / t) / -logf(u[i]);
                if (score > best) { /* strictly: a tie keeps the lower id */
                    best = score;
                    token = c + i;
                }
            }
        }
        a->best[r * a->stride + tid] = best;
        a->token[r * a->stride + tid] = token;
    }
}

/* tokens[r] = the race's winner over row r of x [R, V] (row stride ldx): tokens with
 * x >= thr[r] (and exp(x - m[r]) >= min_p[r] where min_p is given), scores
 * exp((x - m[r]) / temp[r]) / -log(U(seeds[r], steps[r], token)); 0 where none survives.
 * Returns -1 where the scratch cannot be allocated. */
int kiln_race(const float *x, int64_t ldx, int64_t R, int64_t V, const float *m,
              const float *thr, const float *temp, const float *min_p, const int64_t *seeds,
              const int64_t *steps, int64_t *tokens, int nthreads) {
    const int nt = nthreads < 1 ? 1 : nthreads > 64 ? 64 : nthreads;
    float *best = malloc(sizeof(float) * R * nt);
    int64_t *token = malloc(sizeof(int64_t) * R * nt);
    if (!best || !token) {
        free(best);
        free(token);
        return -1;
    }
    for (int64_t i = 0; i < R * nt; i++) token[i] = -1;
    race_args a = {x, ldx, V, m, thr, temp, min_p, seeds, steps, R, nt, best, token};
    kiln_parallel(race_task, &a, nt);
    for (int64_t r = 0; r < R; r++) {
        float b = -1.0f;
        int64_t tok = 0; /* no survivor: token 0, as the kernel */
        for (int i = 0; i < nt; i++) /* shares in token order: ties keep the lower id */
            if (token[r * nt + i] >= 0 && best[r * nt + i] > b) {
                b = best[r * nt + i];
                tok = token[r * nt + i];
            }
        tokens[r] = tok;
    }
    free(best);
    free(token);
    return 0;
}

/* fp32 -> int32 with the same order (-0.0 folded into +0.0), as the kernel's _ordered_key */
static inline int32_t ordered_key(float v) {
    union { float f; int32_t i; } u = {v == 0.0f ? 0.0f : v};
    return u.i < 0 ? u.i ^ 0x7FFFFFFF : u.i;
}

/* the inverse of ordered_key: key 0 gives +0.0, key -1 gives -0.0, which compares equal */
static inline float key_value(int32_t k) {
    union { int32_t i; float f; } u = {k < 0 ? k ^ 0x7FFFFFFF : k};
    return u.f;
}

/* sum of e[j] over j with x[j] >= t: 16 running sums, then vf_sum's fixed order, so the value
 * depends on the row alone (the same bits on AVX2 and AVX-512). Written in simd.h's vectors,
 * not left to the vectoriser: gcc 12 with -march=sapphirerapids turned the scalar loop's
 * `key >= k ? e : 0` into masked loads, the second half of each 16 read under the first
 * half's mask, and the Intel host's thresholds came out wrong. */
static float mass_from(const float *e, const float *x, int64_t V, float t) {
    const vf vt = vf_set1(t);
    vf acc = vf_zero();
    int64_t j = 0;
    for (; j + 16 <= V; j += 16)
        acc = vf_add(acc, vf_zero_where_lt(vf_load(e + j), vf_load(x + j), vt));
    if (j < V) { /* the tail's missing lanes load e = 0 */
        const int n = (int)(V - j);
        acc = vf_add(acc, vf_zero_where_lt(vf_load_n(e + j, n), vf_load_n(x + j, n), vt));
    }
    return vf_sum(acc);
}

typedef struct {
    const float *x;
    int64_t ldx, V;
    const float *m, *top_p;
    float *thr;
    float *e; /* [nt, V] scratch */
    int64_t R;
} top_p_args;

static void top_p_task(void *ctx, int tid, int nt) {
    const top_p_args *a = ctx;
    int64_t r0, r1;
    kiln_share(a->R, tid, nt, &r0, &r1);
    float *e = a->e + tid * a->V;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = a->x + r * a->ldx;
        if (!(a->top_p[r] < 1.0f)) {
            a->thr[r] = -INFINITY; /* keeps every finite token */
            continue;
        }
        const float m = a->m[r];
        int32_t lo = INT32_MAX, hi = INT32_MIN;
        for (int64_t j = 0; j < a->V; j++) {
            e[j] = x[j] == -INFINITY ? 0.0f : expf(x[j] - m);
            if (x[j] != -INFINITY) {
                const int32_t key = ordered_key(x[j]);
                lo = key < lo ? key : lo;
                hi = key > hi ? key : hi;
            }
        }
        const float target = a->top_p[r] * mass_from(e, x, a->V, -INFINITY);
        /* the largest key k with mass(key >= k) >= target: lo qualifies (everything), hi + 1
         * does not (nothing); k is then some token's key, the crossing token's */
        int64_t l = lo, h = (int64_t)hi + 1;
        while (h - l > 1) {
            const int64_t mid = l + (h - l) / 2;
            if (mass_from(e, x, a->V, key_value((int32_t)mid)) >= target) l = mid;
            else h = mid;
        }
        a->thr[r] = key_value((int32_t)l);
    }
}

/* thr[r] = top_p's threshold of row r of x [R, V] (row stride ldx): the largest value t with
 * sum(exp(x - m[r]) over x >= t) >= top_p[r] times the sum over every token, so the tokens
 * kept are those at or above the one whose running mass, in descending order, reaches it
 * (and its equals); -inf where top_p[r] >= 1. Returns -1 where the scratch cannot be had. */
int kiln_top_p_threshold(const float *x, int64_t ldx, int64_t R, int64_t V, const float *m,
                         const float *top_p, float *thr, int nthreads) {
    const int nt = nthreads < 1 ? 1 : nthreads > 64 ? 64 : nthreads;
    float *e = malloc(sizeof(float) * nt * V);
    if (!e) return -1;
    top_p_args a = {x, ldx, V, m, top_p, thr, e, R};
    kiln_parallel(top_p_task, &a, R > 1 ? nt : 1);
    free(e);
    return 0;
}

typedef struct {
    const float *x;
    int64_t ldx, V, R;
    float *max, *log_sum;
    int64_t *argmax;
} stats_args;

static void stats_task(void *ctx, int tid, int nt) {
    const stats_args *a = ctx;
    int64_t r0, r1;
    kiln_share(a->R, tid, nt, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float *x = a->x + r * a->ldx;
        float m = -INFINITY;
        int64_t at = 0;
        for (int64_t j = 0; j < a->V; j++)
            if (x[j] > m) { /* strictly: the first of equals */
                m = x[j];
                at = j;
            }
        /* sum(exp(x - m)) in 16 lanes (vf_exp: the same bits on AVX2 and AVX-512), the
         * lanes then the tail added in one fixed order */
        float s = 0.0f;
        if (m != -INFINITY) {
            const vf vm = vf_set1(m);
            vf acc = vf_zero();
            int64_t j = 0;
            for (; j + 16 <= a->V; j += 16) acc = vf_add(acc, vf_exp(vf_sub(vf_load(x + j), vm)));
            s = vf_sum(acc);
            if (j < a->V) {
                float tail[16];
                vf_store(tail, vf_exp(vf_sub(vf_load_n(x + j, (int)(a->V - j)), vm)));
                for (int l = 0; l < a->V - j; l++) s += tail[l];
            }
        }
        a->max[r] = m;
        a->argmax[r] = at;
        a->log_sum[r] = logf(s);
    }
}

/* Per row r of x [R, V] (row stride ldx): its max, the first index of it, and
 * log(sum(exp(x - max))), so that a token's logprob is (x - max) - log_sum: what a greedy row
 * needs of log_softmax, without writing [R, V]. */
void kiln_row_stats(const float *x, int64_t ldx, int64_t R, int64_t V, float *max,
                    int64_t *argmax, float *log_sum, int nthreads) {
    stats_args a = {x, ldx, V, R, max, log_sum, argmax};
    kiln_parallel(stats_task, &a, R > 1 ? nthreads : 1);
}
