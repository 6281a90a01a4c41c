/*
 * The thread pool behind bargein_parallel_run (see parallel.h).
 *
 * A kernel call lasts from tens of microseconds (a small matmul of one decoding row) to
 * milliseconds, and a decode step makes hundreds of them: starting threads per call would
 * cost as much as the work, and so does waking a sleeping thread (a futex call and, on a
 * virtual machine, an interrupt to a halted CPU: tens of microseconds each time). So
 * workers stay alive and, after a task, spin a little while for the next one.
 *
 * Whether spinning pays depends on the machine. On a quiet one it halves a one-stream
 * decode step (issue 29: 9.9 against 20 ms with OpenMP's spin on and off); where other
 * programs want the cores, a spinning thread holds a core that the thread it waits for
 * needs, and the same step took 50 ms against 18 (see bargein/cli/threads.py). So the
 * spin adapts: a spinning thread looks at the clock as it spins, and a gap in what it saw,
 * with an involuntary switch of the thread counted in it, means that another task of this
 * system had its core, which happens when more threads want to run than there are cores;
 * so does a worker that ends its index much later than the caller ends its own, and a
 * caller that lost an eighth of its time to other tasks since it last looked (every few
 * calls: its time waiting on a run queue, /proc/thread-self/schedstat). A gap without a
 * switch is the hypervisor's (its vCPU was descheduled on the host) or an interrupt's, and
 * a switch that cost a few microseconds in tens of milliseconds is a kernel thread's
 * (a virtual machine's rcu, kworker and kdamond threads preempt a busy thread several
 * times a second): neither is helped by sleeping, and taking them for contention kept the
 * worker of a 2-core VM asleep for 14% of a prompt's prefill (2-75 ms at a time, the
 * caller alone on the call). Then workers spin only a few microseconds for a while (CALM_MIN_NS), doubled
 * each time spinning is descheduled again soon after it resumed (up to CALM_MAX_NS), and
 * reset after a calm period passes clean: on a quiet machine threads spin, on a busy one
 * they sleep almost at once and are not woken (the caller takes their indices; waiting
 * for workers that run its call's indices it spins a little longer: they end about when
 * its own index does).
 *
 * Work is claimed, not assigned: the caller runs index 0, then takes any index no worker
 * has claimed yet, so a worker that is descheduled (or still waking) costs its share of
 * the call, never a wait for a scheduler time slice. Which thread runs an index changes
 * no result: every kernel computes each output by the same code for any index and count.
 * The pool is process state by nature; a child made by fork() starts with an empty one.
 */
#define _GNU_SOURCE /* RUSAGE_THREAD */
#include "parallel.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>


#define MAX_WORKERS 255
#define SPIN_NS 200000       /* the longest a thread spins for work (or for the workers) */
#define CALM_SPIN_NS 3000    /* while calm, a worker still spins this long: a kernel right after */
#define CALM_WAIT_NS 20000   /* while calm, the caller spins this long for running workers */
#define SPIN_CHECK 32        /* relax rounds between two looks at the clock */
#define PREEMPTED_NS 50000   /* a gap this long between two looks: the thread was descheduled */
#define CALM_MIN_NS 2000000  /* no spinning for this long after a descheduled spin ... */
#define CALM_MAX_NS 256000000 /* ... doubled while it happens again, up to this */
#define PREEMPT_CHECK 16     /* calls between two looks at the caller's involuntary switches */
#define LOST_SHARE 8         /* a caller that waited on a run queue 1/8 of the time since its last look */

/* The current call, one word: generation (32 bits), count (16), next index to claim (16).
 * A claim is a compare-and-swap on it, so a worker that comes late can never take an index
 * of a newer call with an older call's task: the generation differs. */
#define WORK(gen, count, next) (((uint64_t)(gen) << 32) | ((uint64_t)(count) << 16) | (uint64_t)(next))
#define WORK_GEN(w) ((uint32_t)((w) >> 32))
#define WORK_COUNT(w) ((int)(((w) >> 16) & 0xffff))
#define WORK_NEXT(w) ((int)((w) & 0xffff))

typedef struct {
    pthread_mutex_t submit;   /* one call at a time */
    pthread_mutex_t lock;     /* guards sleeping and waking, both ways */
    pthread_cond_t wake;      /* workers: there is work */
    pthread_cond_t finished;  /* the caller: every claimed index has returned */
    _Atomic uint64_t work;
    atomic_int done;          /* indices other than 0 that have returned, this call */
    atomic_int sleepers;      /* workers asleep on `wake` */
    atomic_int caller_asleep;
    bargein_task_fn fn;       /* written before `work` is published, read after a claim */
    void *arg;
    int started;              /* worker threads alive */
    /* the spin policy */
    _Atomic int64_t calm_until; /* no spinning before this (CLOCK_MONOTONIC ns) */
    _Atomic int64_t calm_ns;    /* the last calm period's length, 0: none recently */
} pool_t;

static pool_t pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                      PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, 0};
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* A thread was seen descheduled at `now` (a spinning one, or a worker the caller waited
 * for): calm down, longer if it was soon again. */
static void contention_seen(int64_t now) {
    const int64_t until = atomic_load_explicit(&pool.calm_until, memory_order_relaxed);
    int64_t calm = atomic_load_explicit(&pool.calm_ns, memory_order_relaxed);
    if (now < until) return; /* another thread saw it already */
    calm = (calm > 0 && now - until < calm) ? 2 * calm : CALM_MIN_NS; /* soon again: double */
    if (calm > CALM_MAX_NS) calm = CALM_MAX_NS;
    atomic_store_explicit(&pool.calm_ns, calm, memory_order_relaxed);
    atomic_store_explicit(&pool.calm_until, now + calm, memory_order_relaxed);
}

/* The calling thread's involuntary context switches so far; -1 where the system does not
 * count them per thread. */
static long involuntary_switches(void) {
#ifdef RUSAGE_THREAD
    struct rusage usage;
    return getrusage(RUSAGE_THREAD, &usage) == 0 ? usage.ru_nivcsw : -1;
#else
    return -1;
#endif
}

/* How long the calling thread has waited on a run queue (runnable while another task had
 * its core), ns, from /proc/thread-self/schedstat; -1 where the kernel does not say (not
 * Linux, or no CONFIG_SCHED_INFO). */
static int64_t run_queue_wait_ns(void) {
    char text[96];
    const int fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    const ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0) return -1;
    text[n] = 0;
    unsigned long long running, waiting;
    return sscanf(text, "%llu %llu", &running, &waiting) == 2 ? (int64_t)waiting : -1;
}

/* Whether losing `lost` ns to other tasks over `span` ns is contention worth calming down
 * for: an eighth of the time, and more than one descheduled spin's worth. */
static int lost_to_contention(int64_t lost, int64_t span) {
    return lost > PREEMPTED_NS && lost * LOST_SHARE >= span;
}

typedef int (*ready_fn)(void);

/* Spins until ready() or the spin's end; 1 if ready. While calm (see the top), a spin for
 * work is cut to CALM_SPIN_NS, and the caller's spin for workers running their indices
 * (`for_workers`: they end about when the caller's own did, unless descheduled, and then
 * the caller's core is better given up) to CALM_WAIT_NS. */
static inline int spin_until(ready_fn ready, int for_workers) {
    if (ready()) return 1;
    const long switches = involuntary_switches();
    int64_t last = now_ns();
    const int calm = last < atomic_load_explicit(&pool.calm_until, memory_order_relaxed);
    const int64_t end = last + (!calm ? SPIN_NS : for_workers ? CALM_WAIT_NS : CALM_SPIN_NS);
    for (;;) {
        for (int i = 0; i < SPIN_CHECK; i++) {
            if (ready()) return 1;
            CPU_RELAX();
        }
        const int64_t now = now_ns();
        /* a gap: descheduled, by this system's scheduler only if it counted a switch */
        if (now - last > PREEMPTED_NS && (switches < 0 || involuntary_switches() != switches)) {
            contention_seen(now);
            return ready();
        }
        if (now > end) return ready();
        last = now;
    }
}

/* The two predicates a thread may sleep on load in sequential consistency: with the waker's
 * store-then-check of the sleeper flags, either the sleeper sees the news or the waker sees
 * the sleeper (no lost wake-up). */
static int work_claimable(void) {
    const uint64_t w = atomic_load(&pool.work);
    return WORK_NEXT(w) < WORK_COUNT(w);
}

/* Claims an index of the current call; 0 when none is left. */
static int claim(int *index, int *count, bargein_task_fn *fn, void **arg) {
    uint64_t w = atomic_load_explicit(&pool.work, memory_order_acquire);
    while (WORK_NEXT(w) < WORK_COUNT(w)) {
        if (atomic_compare_exchange_weak_explicit(&pool.work, &w, w + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *index = WORK_NEXT(w);
            *count = WORK_COUNT(w);
            *fn = pool.fn;
            *arg = pool.arg;
            return 1;
        }
    }
    return 0;
}

/* Runs every index still unclaimed; the caller's own index 0 is not among them. */
static void run_claims(void) {
    int index, count;
    bargein_task_fn fn;
    void *arg;
    while (claim(&index, &count, &fn, &arg)) {
        fn(arg, index, count);
        if (atomic_fetch_add(&pool.done, 1) + 1 == count - 1 && atomic_load(&pool.caller_asleep)) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.finished);
            pthread_mutex_unlock(&pool.lock);
        }
    }
}

static void *worker_main(void *unused) {
    (void)unused;
    for (;;) {
        if (!spin_until(work_claimable, 0)) {
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while (!work_claimable()) pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        run_claims();
    }
    return NULL;
}

static int call_count; /* the running call's count, for all_done (read under `submit`) */
/* per calling thread: its calls; when it last looked, its involuntary switches then, and
 * its run-queue wait when last read (-1: not yet) */
static _Thread_local unsigned calls;
static _Thread_local long caller_switches = -1;
static _Thread_local int64_t caller_looked, caller_wait = -1;

/* Whether the calling thread lost its core to other tasks for an eighth of the time since
 * its last look (lost_to_contention), looked at every PREEMPT_CHECK calls: a system call,
 * and a read of its schedstat only when it was switched out against its will since (until
 * then its run-queue wait only grows by its wake-ups'). The caller runs most of a step:
 * when it is the thread that loses its core, no spin of a worker sees it. Where the wait is
 * not known, any involuntary switch counts. */
static int caller_was_preempted(void) {
    if (++calls % PREEMPT_CHECK) return 0;
    const long switches = involuntary_switches(), before = caller_switches;
    const int64_t now = now_ns(), since = caller_looked;
    caller_switches = switches;
    caller_looked = now;
    if (switches < 0 || before < 0 || switches == before) return 0;
    const int64_t wait = run_queue_wait_ns(), lost = wait - caller_wait;
    const int known = wait >= 0 && caller_wait >= 0;
    caller_wait = wait;
    return known ? lost_to_contention(lost, now - since) : wait < 0;
}

static int all_done(void) { return atomic_load(&pool.done) >= call_count - 1; }

static void reset_in_child(void) {
    /* Only the forking thread survives fork(): forget the workers, unlock what it held. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    pool.submit = fresh;
    pool.lock = fresh;
    pool.wake = fresh_cond;
    pool.finished = fresh_cond;
    pool.started = 0;
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.caller_asleep, 0);
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
        if (pthread_create(&thread, NULL, worker_main, NULL) != 0) break; /* the caller claims their share */
        pthread_detach(thread);
        pool.started++;
    }
    pool.fn = fn;
    pool.arg = arg;
    call_count = count;
    atomic_store(&pool.done, 0);
    const uint32_t gen = WORK_GEN(atomic_load(&pool.work)) + 1;
    atomic_store(&pool.work, WORK(gen, count, 1)); /* publishes fn and arg with it */
    /* While calm, sleeping workers are left asleep: with more threads wanting the cores than
     * there are cores, a woken worker mostly makes the caller wait for it (measured: one
     * stream beside a busy loop decoded faster on one thread than on two). */
    if (atomic_load(&pool.sleepers) > 0 && now_ns() >= atomic_load_explicit(&pool.calm_until, memory_order_relaxed)) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    const int64_t started = now_ns();
    fn(arg, 0, count);
    const int64_t own = now_ns() - started;
    run_claims(); /* what no worker has taken yet */
    const int64_t waiting = now_ns();
    if (!spin_until(all_done, 1)) {
        pthread_mutex_lock(&pool.lock);
        atomic_store(&pool.caller_asleep, 1);
        while (!all_done()) pthread_cond_wait(&pool.finished, &pool.lock);
        atomic_store(&pool.caller_asleep, 0);
        pthread_mutex_unlock(&pool.lock);
        /* Indices are even shares: a worker that ends this much later than the caller's own
         * index took was descheduled while it ran. */
        const int64_t now = now_ns();
        if (now - waiting > own + SPIN_NS) contention_seen(now);
    }
    if (caller_was_preempted()) contention_seen(now_ns());
    pthread_mutex_unlock(&pool.submit);
}

/* ---- shares of a call's items (parallel.h) ------------------------------------------- */

#define SPAN(front, back) (((uint64_t)(back) << 32) | (uint64_t)(front))
#define SPAN_FRONT(s) ((int64_t)(uint32_t)(s))
#define SPAN_BACK(s) ((int64_t)((s) >> 32))

bargein_share_t *bargein_shares_new(int count, int64_t n) {
    bargein_share_t *shares = aligned_alloc(64, sizeof(bargein_share_t) * (size_t)count);
    for (int i = 0; shares && i < count; i++) atomic_init(&shares[i].span, SPAN(n * i / count, n * (i + 1) / count));
    return shares;
}

/* Takes the front item of a share (from_back 0) or its back item (1); 0 when it is empty. */
static int take_from(bargein_share_t *share, int from_back, int64_t *item, int64_t *next) {
    uint64_t s = atomic_load_explicit(&share->span, memory_order_relaxed);
    for (;;) {
        const int64_t front = SPAN_FRONT(s), back = SPAN_BACK(s);
        if (front >= back) return 0;
        const uint64_t taken = from_back ? SPAN(front, back - 1) : SPAN(front + 1, back);
        /* relaxed: a take only decides who computes an item; what the items read was
         * published with the call, what they write is seen after the call's end */
        if (atomic_compare_exchange_weak_explicit(&share->span, &s, taken, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *item = from_back ? back - 1 : front;
            *next = back - front > 1 ? (from_back ? back - 2 : front + 1) : -1;
            return 1;
        }
    }
}

int bargein_shares_take(bargein_share_t *shares, int index, int count, int64_t *item, int64_t *next) {
    if (take_from(&shares[index], 0, item, next)) return 1;
    for (;;) {
        int victim = -1;
        int64_t most = 0;
        for (int i = 0; i < count; i++) {
            const uint64_t s = atomic_load_explicit(&shares[i].span, memory_order_relaxed);
            if (SPAN_BACK(s) - SPAN_FRONT(s) > most) most = SPAN_BACK(s) - SPAN_FRONT(s), victim = i;
        }
        if (victim < 0) return 0;
        if (take_from(&shares[victim], 1, item, next)) return 1;
    }
}
