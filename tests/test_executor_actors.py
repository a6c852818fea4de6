"""`RayActors` build errors: a worker whose `__init__` fails makes its jobs raise that error (not
"worker lost"), whether the actor was started cold or prestarted (`RayActors.prestart`); a failed
`warm_up` is only a lost head start: the actor is built and runs its jobs. A pool stopped and
started again runs its jobs on fresh actors."""
from __future__ import annotations

import pytest

from tasks.core.executor import Job, JobRunner, RayActors


def _worker_class():
    """Defined in a function so Ray ships it by value to its workers (tests/ is not on their path)."""
    class Worker:
        @staticmethod
        def warm_up(mode: str) -> None:
            if mode == "fail":
                raise OSError("warm-up could not load its model")

        def __init__(self, tag: str):
            if tag == "bad":
                raise ValueError("bad init argument: tag")
            self.tag = tag

        def build(self) -> str:  # a method of the worker's own that the wrapper must not hide
            return f"worker build {self.tag}"

        def work(self, k: int) -> tuple[str, int, str]:
            return self.tag, k, self.build()

    return Worker


def _run(actors: RayActors, n: int = 3) -> list:
    with JobRunner(actors) as runner:
        for k in range(n):
            runner.submit(Job(f"j{k}", None, (k,)))
        return sorted(result for _, result in runner.finished())


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "prestarted"])
def test_a_failing_init_raises_its_own_error(ray_session, warm):
    actors = RayActors(_worker_class(), ("bad",), "work")
    if warm:
        actors.prestart(3, "ok")
        assert actors.prestarted == 2
    with pytest.raises(ValueError, match="bad init argument: tag"):
        _run(actors)


def test_a_failing_warm_up_is_dropped_and_a_stopped_pool_restarts(ray_session):
    actors = RayActors(_worker_class(), ("good",), "work")
    actors.prestart(3, "fail")
    assert actors.prestarted == 2
    expected = [("good", k, "worker build good") for k in range(3)]
    assert _run(actors) == expected  # built after the failed warm-up; the worker's own build() intact
    assert actors.prestarted == 2 and actors._actors == []  # stopped by the runner
    assert _run(actors) == expected  # started again: fresh (cold) actors
    assert actors.prestarted == 0
