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
