/* kiln's thread pool: kernel calls share their work out over `nthreads` threads (the caller
 * and nthreads - 1 workers), and return when every share is done.
 *
 * Why not OpenMP: between the many short kernel calls of a decode step, libgomp's idle
 * workers went to sleep and woke late (one attention call of 13 us took 9 ms with two
 * threads). Here a worker spins for a while after each call (SPIN_NS), so the calls of a
 * forward pass find it awake, then sleeps on a futex, so an idle server burns nothing.
 * Which thread computes which output never changes an output's bits (each is one thread's
 * fixed sequence of operations), so neither the thread count nor the schedule matters. */
#pragma once
#include <stdint.h>

typedef void (*kiln_task)(void *ctx, int tid, int nthreads);

/* Run task(ctx, tid, n) for tid in [0, n) with n = max(1, nthreads), tid 0 on the caller.
 * Calls from several threads at once are run one after the other. */
void kiln_parallel(kiln_task task, void *ctx, int nthreads);

/* [lo, hi) of n items for share tid of nt: contiguous, sizes differing by at most one */
static inline void kiln_share(int64_t n, int tid, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * tid / nt;
    *hi = n * (tid + 1) / nt;
}
