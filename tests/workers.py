"""The suite over pytest-xdist workers (``make test`` runs ``-n 2 --dist loadgroup``).

Work is handed out a module at a time, so that a module's own fixtures (its servers,
models and engines, most of them module-scoped) are set up once, on one worker. The
modules of :data:`GROUPED_MODULES` are one unit per group instead: the modules that use
the session's Ray cluster all run on one worker, in order, so that one cluster is
started for them; the two modules of the portable kernel build share that build. The
modules that start a Ray instance of their own are units of their own, which may run
beside the cluster's; no two Ray starts overlap (``tests/ray_starts.py``).

The groups are by module, read from node ids in the controller: xdist's own
``xdist_group`` marks do nothing under pytest 9 (xdist 3.8 renames an item by setting
``_nodeid``, which pytest 9 no longer reads). Each worker checks the table as it
collects (:func:`check_groups`): a test that uses a fixture of :data:`SHARED_FIXTURES`
from a module outside that fixture's group stops the run with the module to add.

The worker that frees up takes the heaviest unit left (longest processing time first):
started last, a long module would keep one worker busy while the other idles. Weights
are :data:`SECONDS` (measured) or, for a unit not listed there, its number of tests
times :data:`SECONDS_PER_TEST`; an estimate only orders the work, nothing depends on it.

Without xdist (``pytest -p no:xdist``) none of this is used: the tests run in order, in
one process, as before.
"""

from __future__ import annotations

import time

import pytest

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is a test extra; without it the suite runs in one process
    LoadScopeScheduling = object

# Session fixtures that cost seconds and must not run twice (or two at once), and the
# group whose modules may use them.
SHARED_FIXTURES = {
    "ray_cluster": "ray",  # a Ray cluster of 3 nodes (tests/ray_cluster.py)
    "portable_kernels": "portable-kernels",  # a ~25 s build (tests/kernels/conftest.py)
}

GROUPED_MODULES = {
    "tests/distributed/test_pipeline.py": "ray",
    "tests/distributed/test_pipeline_recovery.py": "ray",
    "tests/distributed/test_replicas.py": "ray",
    "tests/distributed/test_replicas_placement.py": "ray",
    "tests/distributed/test_shipped_weights.py": "ray",
    "tests/distributed/test_moe_ray.py": "ray",
    "tests/distributed/test_pipeline_kv_disk.py": "ray",
    "tests/distributed/test_pipeline_kv_disk_server.py": "ray",
    "tests/distributed/test_cluster_auth.py": "ray",
    "tests/kernels/test_native_kernels.py": "portable-kernels",
    "tests/kernels/test_quant_kernels.py": "portable-kernels",
}
# Not in the Ray unit: the namespace hosts (tests/distributed/test_hosts.py) and the
# compiled graph's one-node instance (tests/distributed/test_pipeline_graph.py) are Ray
# instances of their own, units of their own that run beside the shared cluster's tests
# on the other worker; their starts wait for each other's (tests/ray_starts.py).

# Units that take longer than their test count says: seconds on CI's 2-core machine under
# `make test` (its --durations, set-up included). Only their order matters, and the
# balance at the end: the worker that frees up takes the heaviest unit left.
SECONDS = {
    "ray": 230.0,  # the shared cluster's 9 modules, one after another
    "tests/distributed/test_hosts.py": 130.0,  # 31% of the old Ray unit's time, the graph 11%
    "tests/distributed/test_pipeline_graph.py": 72.0,
    "tests/model/test_reference_parity.py": 40.0,
    "portable-kernels": 25.0,
    "tests/server/test_server_hardening.py": 35.0,
    "tests/model/test_perplexity.py": 10.0,
    "tests/server/test_structured_finish.py": 16.0,
    "tests/server/test_api_fuzz.py": 14.0,
}
SECONDS_PER_TEST = 0.3


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def check_groups(items: list[pytest.Item]) -> None:
    """Raises UsageError for a test that uses a :data:`SHARED_FIXTURES` fixture from a
    module that is not in that fixture's group (its worker would start a second one)."""
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            group = SHARED_FIXTURES.get(name)
            if group is not None and GROUPED_MODULES.get(module_of(item.nodeid)) != group:
                raise pytest.UsageError(f"{item.nodeid} uses {name}: add its module to tests/workers.py's "
                                        f"GROUPED_MODULES as {group!r}")


class ModuleScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with a module (or a group of modules) as the unit of work,
    the heaviest unit first."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        heaviest = max(self.workqueue, key=lambda unit: weight(unit, len(self.workqueue[unit])))
        self.workqueue.move_to_end(heaviest, last=False)  # the base class hands out the first unit
        super()._assign_work_unit(node)


def weight(unit: str, num_tests: int) -> float:
    """The estimated seconds of one unit of work."""
    return SECONDS.get(unit, SECONDS_PER_TEST * num_tests)


class UnitClock:
    """The seconds each unit of work took on one worker (its tests' set-up, call and
    tear-down, as ``--durations`` counts them), and the worker's own time from its start
    to its end: sent to the controller, which prints one line per worker, so that a run
    shows its critical path (the worker that finished last, and with what)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.units: dict[str, float] = {}

    def add(self, nodeid: str, seconds: float) -> None:
        unit = unit_of(nodeid)
        self.units[unit] = self.units.get(unit, 0.0) + seconds

    def output(self) -> dict:
        return {"wall": time.monotonic() - self.started, "units": self.units}


def describe_worker(name: str, output: dict, shown: int = 4) -> str:
    """One line: a worker's wall time, its busiest units and how many others."""
    units = sorted(output["units"].items(), key=lambda item: -item[1])
    busy = sum(seconds for _, seconds in units)
    top = ", ".join(f"{unit} {seconds:.0f}" for unit, seconds in units[:shown])
    rest = f" and {len(units) - shown} more" if len(units) > shown else ""
    return f"{name}: {output['wall']:.0f} s, {busy:.0f} s in tests: {top}{rest}"


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or the module's group."""
    module = module_of(nodeid)
    return GROUPED_MODULES.get(module, module)
