"""The kernels' thread pool (``parallel.c``): every index of every call runs exactly once.

Work is claimed (a compare-and-swap on one word that holds the call's generation), the
caller takes what the workers have not, and workers spin or sleep by what they see, so
the races worth testing are many calls back to back (a late worker must never take an
index of the next call with the last call's task) and calls after idle gaps (workers
asleep: the wake-up must not be lost). A small C driver built with the pool makes
20,000 calls of 2 to 8 indices, with task lengths from nothing to a few microseconds and
a sleep every 37 calls, and checks each call's counts; it takes about a second.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bargein.kernels import native

DRIVER = r"""
#define _DEFAULT_SOURCE
#include "parallel.h"
#include <stdatomic.h>
#include <stdio.h>
#include <unistd.h>

typedef struct { atomic_int hits[16]; long work; } job_t;

static void task(void *arg, int index, int count) {
    job_t *job = arg;
    atomic_fetch_add(&job->hits[index], 1);
    volatile long sink = 0;
    for (long k = 0; k < job->work; k++) sink += k;
    (void)count;
}

int main(void) {
    for (int call = 0; call < 20000; call++) {
        job_t job = {0};
        const int count = 2 + call % 7;
        job.work = (call % 13) * 50;
        bargein_parallel_run(task, &job, count);
        for (int i = 0; i < 16; i++) {
            const int want = i < count ? 1 : 0;
            if (atomic_load(&job.hits[i]) != want) {
                printf("call %d: index %d ran %d times\n", call, i, atomic_load(&job.hits[i]));
                return 1;
            }
        }
        if (call % 37 == 0) usleep(200);
    }
    printf("ok\n");
    return 0;
}
"""


def test_every_index_of_every_call_runs_exactly_once(tmp_path: Path) -> None:
    compiler = native._compiler()
    if compiler is None or shutil.which(compiler) is None:
        pytest.skip("no C compiler here")
    kernels = Path(native.__file__).parent
    (tmp_path / "driver.c").write_text(DRIVER)
    binary = tmp_path / "driver"
    subprocess.run([compiler, "-O2", "-std=c11", "-pthread", f"-I{kernels}", str(kernels / "parallel.c"),
                    str(tmp_path / "driver.c"), "-o", str(binary)], check=True, capture_output=True)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stdout) == (0, "ok\n")
