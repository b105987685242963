/* The thread pool of pool.h: workers started on first use, woken through a generation counter
 * (spin, then futex), and a count of shares still running that the caller waits on. */
#include "pool.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 256
#define SPIN_NS 2000000 /* a worker stays awake 2 ms after a call: a decode step's gaps */

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static int num_workers;             /* started so far (threads 1 .. num_workers) */
static _Atomic uint32_t generation; /* bumped once per call; workers wait for a change */
static _Atomic int sleepers;        /* workers in futex_wait */
static _Atomic int pending;         /* workers yet to finish (or skip) the current call */
static kiln_task cur_task;
static void *cur_ctx;
static int cur_n;
static uint32_t started_at[MAX_THREADS]; /* the generation each worker was started in */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
}

static void *worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    /* started under run_lock, before the call that needs it bumps the generation */
    uint32_t seen = started_at[tid];
    int64_t spin_ns = SPIN_NS;
    for (;;) {
        uint32_t g;
        const int64_t until = now_ns() + spin_ns;
        int spins = 0;
        while ((g = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            _mm_pause();
            if (++spins % 256 == 0 && now_ns() > until) {
                atomic_fetch_add(&sleepers, 1);
                if (atomic_load(&generation) == seen) futex_wait(&generation, seen);
                atomic_fetch_sub(&sleepers, 1);
            }
        }
        seen = g;
        /* every worker answers every call, so none can read a later call's task late. One
         * with no share (a call on fewer threads than were ever started: a process that
         * changed its thread count) sleeps as soon as it has answered: spinning, it would
         * take a core from the threads doing the work (a 15x slower decode on 2 cores after
         * one 3-thread call). */
        const int share = tid < cur_n;
        if (share) cur_task(cur_ctx, tid, cur_n);
        spin_ns = share ? SPIN_NS : 0;
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
    }
    return NULL;
}

static void start_workers(int n) {
    pthread_mutex_lock(&start_lock);
    while (num_workers < n) {
        pthread_t th;
        pthread_attr_t attr;
        started_at[num_workers + 1] = atomic_load(&generation);
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        if (pthread_create(&th, &attr, worker, (void *)(intptr_t)(num_workers + 1)) != 0) {
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        pthread_detach(th);
        num_workers++;
    }
    pthread_mutex_unlock(&start_lock);
}

void kiln_parallel(kiln_task task, void *ctx, int nthreads) {
    int n = nthreads < 1 ? 1 : nthreads > MAX_THREADS ? MAX_THREADS : nthreads;
    if (n == 1) {
        task(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&run_lock);
    if (num_workers < n - 1) start_workers(n - 1);
    if (num_workers < n - 1) n = num_workers + 1; /* the system would not start more */
    cur_task = task;
    cur_ctx = ctx;
    cur_n = n;
    /* every worker wakes; those past n only answer */
    atomic_store(&pending, num_workers);
    atomic_fetch_add(&generation, 1);
    if (atomic_load(&sleepers) > 0) futex_wake_all(&generation);
    task(ctx, 0, n);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) _mm_pause();
    pthread_mutex_unlock(&run_lock);
}
