/*
 * The thread pool behind bargein_parallel_run (see parallel.h).
 *
 * A kernel call lasts from tens of microseconds (a small matmul of one decoding row) to
 * milliseconds, and a decode step makes a hundred or more of them: starting threads per
 * call would cost as much as the work. Workers therefore stay alive, spin briefly after
 * a task (the next call usually follows within microseconds), then sleep on a condition
 * variable so that an idle engine takes no CPU. The spins are short, and the caller
 * waiting for the workers yields its core after a short spin: on a machine where other
 * work holds cores, a thread that spins holds the core the thread it waits for needs,
 * and every call then lasts a scheduler time slice (see bargein/cli/threads.py, which
 * sets the same policy for OpenMP). The pool is process state by nature; a child made
 * by fork() starts with an empty one.
 */
#include "parallel.h"

#ifdef _OPENMP
/* Built with OpenMP, the kernels run on the process's OpenMP threads: in a process that
 * has loaded PyTorch, the very threads PyTorch uses (the dynamic linker hands this
 * library the libgomp already loaded), so the two never compete for the cores. */
#include <omp.h>

void bargein_parallel_run(bargein_task_fn fn, void *arg, int count) {
    if (count <= 1) {
        fn(arg, 0, 1);
        return;
    }
#pragma omp parallel num_threads(count)
    fn(arg, omp_get_thread_num(), omp_get_num_threads());
}

#else /* no OpenMP: a pool of our own */

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_WORKERS 255
#define SPIN_ROUNDS 200 /* a few microseconds of spinning before sleeping (or yielding) */

typedef struct {
    pthread_mutex_t submit;  /* one call at a time */
    pthread_mutex_t lock;    /* guards sleeping and waking */
    pthread_cond_t wake;
    atomic_uint generation;  /* bumped once per call */
    atomic_int pending;      /* workers still running the current call's task */
    bargein_task_fn fn;
    void *arg;
    int count;
    int started;             /* worker threads alive */
    unsigned birth[MAX_WORKERS + 1]; /* the generation before each worker's first call */
} pool_t;

static pool_t pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0,
                      0, 0, 0, 0, {0}};
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1-based */
    /* Not the generation now: the call that started this thread may have bumped it already. */
    unsigned seen = pool.birth[index];
    for (;;) {
        unsigned now;
        int spins = 0;
        while ((now = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen && spins < SPIN_ROUNDS) {
            CPU_RELAX();
            spins++;
        }
        if (now == seen) {
            pthread_mutex_lock(&pool.lock);
            while ((now = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = now;
        if (index < pool.count) {
            pool.fn(pool.arg, index, pool.count);
            atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
        }
    }
    return NULL;
}

static void reset_in_child(void) {
    /* Only the forking thread survives fork(): forget the workers, unlock what it held. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    pool.submit = fresh;
    pool.lock = fresh;
    pool.wake = fresh_cond;
    pool.started = 0;
}

static void install_atfork(void) { pthread_atfork(NULL, NULL, reset_in_child); }

void bargein_parallel_run(bargein_task_fn fn, void *arg, int count) {
    if (count > MAX_WORKERS + 1) count = MAX_WORKERS + 1;
    if (count <= 1) {
        fn(arg, 0, 1);
        return;
    }
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&pool.submit);
    while (pool.started < count - 1) {
        pthread_t thread;
        pool.birth[pool.started + 1] = atomic_load(&pool.generation);
        if (pthread_create(&thread, NULL, worker_main, (void *)(intptr_t)(pool.started + 1)) != 0) break;
        pthread_detach(thread);
        pool.started++;
    }
    const int workers = count - 1 < pool.started ? count - 1 : pool.started;
    pool.fn = fn;
    pool.arg = arg;
    pool.count = workers + 1;
    atomic_store(&pool.pending, workers);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(arg, 0, workers + 1);
    for (int spins = 0; atomic_load_explicit(&pool.pending, memory_order_acquire) > 0; spins++) {
        if (spins < SPIN_ROUNDS) CPU_RELAX();
        else sched_yield(); /* a worker was descheduled: let it have this core */
    }
    pthread_mutex_unlock(&pool.submit);
}

#endif /* _OPENMP */
