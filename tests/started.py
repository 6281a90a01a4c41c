"""What a test session started that costs seconds: servers, Ray clusters and nodes.

Counted where each is started, and listed at the end of the run (``tests/conftest.py``'s
terminal summary), so that a change to the suite shows what it saved in work, not only
in seconds that depend on the machine's load.
"""

from __future__ import annotations

from collections import Counter

STARTED: Counter[str] = Counter()


def count(what: str, n: int = 1) -> None:
    STARTED[what] += n
