/* A pool of worker threads kept alive between calls, shared by the kernels in this folder. */
#ifndef BARGEIN_PARALLEL_H
#define BARGEIN_PARALLEL_H

/* Runs fn(arg, index, n) once for each index in [0, n), index 0 on the calling thread
 * and the others on pool threads, and returns when all have returned. n is at most
 * count: fewer when threads could not be started, so fn must share out its work by the
 * n it is given. Calls from several threads are served one at a time. */
typedef void (*bargein_task_fn)(void *arg, int index, int count);
void bargein_parallel_run(bargein_task_fn fn, void *arg, int count);

#endif
