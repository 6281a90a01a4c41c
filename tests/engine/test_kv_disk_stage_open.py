"""How the head opens its pipeline stages' tiers (``distributed/stage_tiers._open_stages``),
as units over stand-in actors (no Ray cluster): a stage whose directory another process
holds is asked again until it lets go (the stages of a server killed moments ago) or the
wait is over (then its answer names the holder); a stage that fails is not asked again;
stages that opened are asked once."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from bargein.distributed import stage_tiers  # noqa: E402
from bargein.distributed.stage_disk import StageTierBusy  # noqa: E402

BUSY = StageTierBusy("/kv/stage-0-2 is in use by another bargein server (pid 123)")
OPENED = object()  # what a stage answers once its tier is open (StageTierOpened); only passed on


class StandInStage:
    """An actor whose ``open_kv_disk.remote`` answers from a script (the last answer repeats)."""

    def __init__(self, *answers: object):
        self.answers, self.asked = list(answers), 0
        self.open_kv_disk = SimpleNamespace(remote=self._remote)

    def _remote(self, base: str, files: tuple, blocks: int) -> object:
        self.asked += 1
        return self.answers[min(self.asked, len(self.answers)) - 1]


def _get(answer: object) -> object:
    """``ray.get`` of a stand-in's answer: an exception is raised, as Ray raises a task's."""
    if isinstance(answer, BaseException):
        raise answer
    return answer


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch) -> None:
    monkeypatch.setattr(stage_tiers, "ray", SimpleNamespace(get=_get, exceptions=ray.exceptions))


def test_a_busy_stage_is_asked_again_until_its_directory_is_let_go() -> None:
    released, opened = StandInStage(BUSY, BUSY, OPENED), StandInStage(OPENED)
    assert stage_tiers._open_stages([released, opened], "/kv", (), 4, busy_wait_s=30) == [OPENED, OPENED]
    assert (released.asked, opened.asked) == (3, 1)


def test_a_stage_still_busy_after_the_wait_is_named_and_a_failed_one_is_not_asked_again() -> None:
    held, failed = StandInStage(BUSY), StandInStage(ray.exceptions.RayError("cannot make /kv/stage-2-4"))
    started = time.monotonic()
    answers = stage_tiers._open_stages([held, failed], "/kv", (), 4, busy_wait_s=0.3)
    assert time.monotonic() - started >= 0.3
    assert answers == [BUSY.reason, "a stage cannot use /kv: cannot make /kv/stage-2-4"]
    assert held.asked >= 2 and failed.asked == 1
