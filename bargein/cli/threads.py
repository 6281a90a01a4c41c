"""``--threads N`` of ``serve``, ``run`` and ``chat``, and how the compute threads wait.

The model runs on PyTorch's intra-op threads and, in ``fast`` precision (the CPU default),
on the native kernels' own pool (``bargein/kernels/parallel.c``) with as many threads.
The default is what the machine offers this process: the CPUs it may run on
(``sched_getaffinity``: a container's or ``taskset``'s limit counts), and the command
says so when it starts.

Waiting. Between two kernels a compute thread spins before it sleeps. On a quiet machine
spinning makes back-to-back kernels start at once; on a machine where something else runs
(a browser, a compile, another server or a pipeline stage of another model), threads that
spin hold cores the thread they wait for needs, and a step that took milliseconds takes a
scheduler time slice per kernel. Measured on a busy 2-core machine, greedy decoding with
GNU OpenMP's default spin (some 300,000 rounds) ran an order of magnitude slower than with
a short one (100 rounds) or none (``OMP_WAIT_POLICY=passive``). The kernels' pool decides
for itself, as it goes: its threads spin while nothing else wants their cores and stop
when they see themselves descheduled (one stream decodes as fast as with a long spin on a
quiet machine, and as with none on a busy one). What is left on OpenMP's threads, PyTorch's
own operations (the ``exact`` precision's matmuls, sampling), keeps the safe short spin:
``GOMP_SPINCOUNT`` is set to :data:`SPIN_COUNT` unless the user set it or
``OMP_WAIT_POLICY``. It must be in the environment before the OpenMP runtime loads (with
torch), so :func:`settle_waiting` runs first thing in ``bargein``'s ``main``; Ray nodes
started by ``bargein cluster`` inherit it through their environment.
"""

from __future__ import annotations

import argparse
import os
import sys

SPIN_COUNT = "100"


def settle_waiting(env: dict[str, str] | None = None) -> None:
    """Sets GOMP_SPINCOUNT in ``env`` (default: this process's) unless a wait policy is given."""
    env = os.environ if env is None else env
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT


def available_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="compute threads for the model here (default: the CPUs this process may use; fewer "
                        "leave cores to other work on the machine)")


def apply_threads(args: argparse.Namespace) -> int:
    """Sets torch's intra-op threads from ``--threads`` (or the default), says so on stderr
    in one line, and returns the number. Raises ValueError for N < 1."""
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    import torch

    cpus = available_cpus()
    threads = args.threads or cpus
    torch.set_num_threads(threads)
    how = "--threads" if args.threads else "default: the CPUs this process may use; --threads N to change"
    print(f"bargein: {threads} compute threads ({how}; {cpus} CPUs here)", file=sys.stderr, flush=True)
    return threads
