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
 * own whatever else is in the batch, whether it is read in a prefill chunk or a decode step:
 * it visits its sequence's KV blocks in increasing order, one block (16 positions aligned to
 * absolute position 0) at a time, with an online softmax whose update for a block is always
 * the same sequence of operations; a block that hides every key from a row leaves that row's
 * state untouched. Rows are grouped into tiles only to share loads. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include "simd.h"

#define BS 16      /* KV block size: one vector of keys */
#define QT 16      /* query positions per work unit of a prefill chunk */
#define RT 8       /* rows of a score tile: 8 chains of fmas */

INLINE float exp1(float x) { float o[16]; vf_store(o, vf_exp(vf_set1(x))); return o[0]; }

typedef struct {
    const float *q; int64_t q_tok, q_head;        /* q[t * q_tok + h * q_head + d] */
    float *out; int64_t o_tok, o_head;
    const float *kc, *vc;
    int64_t kvh_n, D, G;
    float scale;
    int64_t window;
} attn_args;

/* One work unit: kv head `kvh` of one sequence, query positions [p0, p1) (rows: position x
 * the G heads of the group), the sequence's block table `bt`, and the token index of
 * position p0 in q/out. Scratch: acc [rows, D], m, l [rows], s [rows, 16]. */
static void unit(const attn_args *a, const int32_t *bt, int64_t kvh, int64_t p0,
                 int64_t p1, int64_t tok0, float *acc, float *m, float *l, float *s) {
    const int64_t D = a->D, G = a->G, R = (p1 - p0) * G, nv = D / 16;
    for (int64_t r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    for (int64_t i = 0; i < R * D; i++) acc[i] = 0.0f;
    const int64_t lo = a->window > 0 ? (p0 + 1 - a->window > 0 ? p0 + 1 - a->window : 0) : 0;
    const int64_t b_first = lo / BS, b_last = (p1 - 1) / BS;
    const vf kpos_lane = vf_from_i(vi_lanes());
    for (int64_t b = b_first; b <= b_last; b++) {
        const float *kt = a->kc + ((int64_t)bt[b] * a->kvh_n + kvh) * D * BS;  /* [D][16] */
        const float *vb = a->vc + ((int64_t)bt[b] * a->kvh_n + kvh) * BS * D;  /* [16][D] */
        /* scores S[r][0..15] = sum over d of q[r][d] * K[d][0..15], d in increasing order */
        for (int64_t r0 = 0; r0 < R; r0 += RT) {
            const int64_t rt = R - r0 < RT ? R - r0 : RT;
            vf acc_s[RT];
            const float *qr[RT];
            for (int64_t i = 0; i < rt; i++) {
                const int64_t r = r0 + i, t = r / G, g = r % G;
                qr[i] = a->q + (tok0 + t) * a->q_tok + (kvh * G + g) * a->q_head;
                acc_s[i] = vf_zero();
            }
            for (int64_t d = 0; d < D; d++) {
                const vf kv = vf_load(kt + d * BS);
                for (int64_t i = 0; i < rt; i++) acc_s[i] = vf_fma(vf_set1(qr[i][d]), kv, acc_s[i]);
            }
            for (int64_t i = 0; i < rt; i++) vf_store(s + (r0 + i) * 16, acc_s[i]);
        }
        const vf kpos = vf_add(kpos_lane, vf_set1((float)(b * BS)));
        for (int64_t r = 0; r < R; r++) {
            const int64_t pos = p0 + r / G;
            /* the keys this row sees: pos - window < k <= pos */
            const vf z = vf_keep_in(vf_mul(vf_load(s + r * 16), vf_set1(a->scale)), kpos,
                                    vf_set1(a->window > 0 ? (float)(pos - a->window) : -1.0f),
                                    vf_set1((float)pos));
            const float m_new = fmaxf(m[r], vf_hmax(z));
            if (m_new == -INFINITY) continue;  /* nothing visible yet: the state stays as is */
            const float alpha = exp1(m[r] - m_new);
            const vf p = vf_exp(vf_sub(z, vf_set1(m_new)));
            l[r] = l[r] * alpha + vf_sum(p);
            m[r] = m_new;
            float ps[16];
            vf_store(ps, p);
            float *o = acc + r * D;
            const vf av = vf_set1(alpha);
            for (int64_t c = 0; c < nv; c += 4) {
                const int64_t cn = nv - c < 4 ? nv - c : 4;
                vf ov[4];
                for (int64_t u = 0; u < cn; u++) ov[u] = vf_mul(vf_load(o + (c + u) * 16), av);
                for (int j = 0; j < 16; j++) {
                    const vf pj = vf_set1(ps[j]);
                    const float *vr = vb + j * D + c * 16;
                    for (int64_t u = 0; u < cn; u++) ov[u] = vf_fma(pj, vf_load(vr + u * 16), ov[u]);
                }
                for (int64_t u = 0; u < cn; u++) vf_store(o + (c + u) * 16, ov[u]);
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t t = r / G, g = r % G;
        float *dst = a->out + (tok0 + t) * a->o_tok + (kvh * G + g) * a->o_head;
        const vf lv = vf_set1(l[r]);
        for (int64_t c = 0; c < nv; c++) vf_store(dst + c * 16, vf_div(vf_load(acc + r * D + c * 16), lv));
    }
}

void kiln_attention(const float *q, int64_t q_tok, int64_t q_head,
                    const float *key_cache, const float *value_cache,
                    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                    const int32_t *query_start_loc, int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window,
                    float *out, int64_t o_tok, int64_t o_head, int nthreads) {
    attn_args a = {q, q_tok, q_head, out, o_tok, o_head, key_cache, value_cache, num_kv_heads,
                   head_dim, num_heads / num_kv_heads, scale, window};
    /* units: per sequence, ceil(query_len / QT) position tiles x kv heads */
    int64_t total = 0;
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1));
    for (int64_t i = 0; i < num_seqs; i++) {
        first[i] = total;
        const int64_t ql = query_start_loc[i + 1] - query_start_loc[i];
        total += (ql + QT - 1) / QT * num_kv_heads;
    }
    first[num_seqs] = total;
    const int64_t R = QT * a.G;
#pragma omp parallel num_threads(nthreads)
    {
        float *scratch = aligned_alloc(64, sizeof(float) * (R * head_dim + 2 * R + R * 16 + 64));
        float *acc = scratch, *m = acc + R * head_dim, *l = m + R, *s = l + R;
        int64_t seq = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < total; u++) {
            while (first[seq + 1] <= u) seq++;
            while (first[seq] > u) seq--;
            const int64_t k = u - first[seq], tile = k / num_kv_heads, kvh = k % num_kv_heads;
            const int64_t qs = query_start_loc[seq], ql = query_start_loc[seq + 1] - qs;
            const int64_t L = seq_lens[seq], ctx = L - ql;
            const int64_t p0 = ctx + tile * QT, p1 = p0 + QT < L ? p0 + QT : L;
            unit(&a, block_tables + seq * bt_stride, kvh, p0, p1, qs + tile * QT, acc, m, l, s);
        }
        free(scratch);
    }
    free(first);
}

/* key, value [T, KVH, D] (token strides k_tok, v_tok) -> their slots; slot -1: skipped */
void kiln_store_kv(const float *key, int64_t k_tok, const float *value, int64_t v_tok,
                   const int64_t *slot_mapping, int64_t T, int64_t kvh_n, int64_t D,
                   float *key_cache, float *value_cache) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const int64_t b = slot / BS, off = slot % BS;
        for (int64_t h = 0; h < kvh_n; h++) {
            const float *k = key + t * k_tok + h * D, *v = value + t * v_tok + h * D;
            float *kt = key_cache + (b * kvh_n + h) * D * BS + off;
            float *vr = value_cache + ((b * kvh_n + h) * BS + off) * D;
            for (int64_t d = 0; d < D; d++) kt[d * BS] = k[d];
            memcpy(vr, v, sizeof(float) * D);
        }
    }
}
