"""The suite over pytest-xdist workers (``make test`` runs ``-n 2 --dist loadgroup``).

Work is handed out a module at a time, so that a module's own fixtures (its servers,
models and engines, most of them module-scoped) are set up once, on one worker. Tests
that use a costly session fixture of :data:`SHARED_FIXTURES` are one unit instead,
whatever their module: one Ray cluster is started for them all, on one worker, never two
at once on this machine, and the portable kernels are built once.

The worker that frees up takes the heaviest unit left (longest processing time first):
started last, a long module would keep one worker busy while the other idles. Weights
are :data:`SECONDS` (measured) or, for a unit not listed there, its number of tests
times :data:`SECONDS_PER_TEST`; an estimate only orders the work, nothing depends on it.

Without xdist (``pytest -p no:xdist``) none of this is used: the tests run in order, in
one process, as before.
"""

from __future__ import annotations

import pytest

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is a test extra; without it the suite runs in one process
    LoadScopeScheduling = object

# Session fixtures that cost seconds and must not run twice (or two at once): the tests
# that use one are a unit named after it, run by one worker.
SHARED_FIXTURES = {
    "ray_cluster": "ray",  # a Ray cluster of 3 nodes (tests/ray_cluster.py)
    "portable_kernels": "portable-kernels",  # a ~25 s build (tests/kernels/conftest.py)
}

# Units that take longer than their test count says, in seconds of one run under
# `-p no:xdist` (their order is what matters). The rest weigh SECONDS_PER_TEST a test.
SECONDS = {
    "ray": 300.0,
    "tests/distributed/test_pipeline_graph.py": 35.0,
    "tests/distributed/test_hosts.py": 40.0,
    "tests/server/test_server_hardening.py": 30.0,
    "portable-kernels": 22.0,
    "tests/model/test_reference_parity.py": 34.0,
    "tests/model/test_perplexity.py": 16.0,
}
SECONDS_PER_TEST = 0.3


def group_items(items: list[pytest.Item]) -> None:
    """Marks the tests that use a :data:`SHARED_FIXTURES` fixture with its ``xdist_group``
    (xdist then ends their node ids with ``@NAME``, which :class:`ModuleScheduling` reads)."""
    for item in items:
        names = [SHARED_FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in SHARED_FIXTURES]
        if len(names) > 1:
            raise pytest.UsageError(f"{item.nodeid} uses two shared fixtures ({names}): give them one group")
        if names:
            item.add_marker(pytest.mark.xdist_group(names[0]))


class ModuleScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with a module (or an ``xdist_group``) as the unit of work,
    the heaviest unit first."""

    def _split_scope(self, nodeid: str) -> str:
        test, at, group = nodeid.rpartition("@")
        if at and "]" not in group:  # "@" inside a parameter's id is not a group
            return group
        return nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node) -> None:
        heaviest = max(self.workqueue, key=lambda unit: weight(unit, len(self.workqueue[unit])))
        self.workqueue.move_to_end(heaviest, last=False)  # the base class hands out the first unit
        super()._assign_work_unit(node)


def weight(unit: str, num_tests: int) -> float:
    """The estimated seconds of one unit of work."""
    return SECONDS.get(unit, SECONDS_PER_TEST * num_tests)
