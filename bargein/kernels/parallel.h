/* A pool of worker threads kept alive between calls, shared by the kernels in this folder. */
#ifndef BARGEIN_PARALLEL_H
#define BARGEIN_PARALLEL_H

/* Runs fn(arg, index, n) once for each index in [0, n), index 0 on the calling thread
 * and each other one on whichever thread claims it first (a pool thread, or the calling
 * thread when the pool's are slow to come: busy elsewhere, or asleep), and returns when
 * all have returned. fn must share out its work by the index and n it is given, and may
 * not wait for another index (two may run on one thread, one after the other). Calls
 * from several threads are served one at a time; a call with count 1 runs fn at once. */
typedef void (*bargein_task_fn)(void *arg, int index, int count);
void bargein_parallel_run(bargein_task_fn fn, void *arg, int count);

/* Items [0, n) of a call, shared out by thread index for work stealing: index i starts
 * with the even share [n * i / count, n * (i + 1) / count) and takes its items from the
 * front; once its own share is empty it takes items from the back of the share with the
 * most left. So a thread slowed by the memory, a late start or a lost core costs the call
 * only the item it is on, not the rest of its share. Every item is taken exactly once.
 * Items must not depend on which thread takes them (the kernels' results never do). */
#include <stdatomic.h>
#include <stdint.h>

typedef struct {
    _Atomic uint64_t span; /* [front, back): front in the low 32 bits */
    char pad[56];          /* a cache line per share: its owner's takes do not contend */
} bargein_share_t;

/* count shares of items [0, n) (n < 2^32), allocated (64-byte aligned: release with free)
 * and set to their even starts; NULL when the memory could not be had. */
bargein_share_t *bargein_shares_new(int count, int64_t n);

/* The next item for thread `index` of `count` into *item (0 when none is left), and the
 * one it will likely take after it into *next (-1 if none): the item whose data a kernel
 * may fetch ahead while it works on *item. */
int bargein_shares_take(bargein_share_t *shares, int index, int count, int64_t *item, int64_t *next);

/* A spinning thread's pause between two looks at shared state (it frees the core's
 * other hyperthread and saves power while it waits). */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#endif
