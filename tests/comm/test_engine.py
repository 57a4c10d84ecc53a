"""The progress engine's calls on the caller's thread (no MPI: operations here are plain
functions and generators that need no requests)."""
import time

import pytest

from hpcdp.comm.engine import Engine
from hpcdp.errors import CommError


class _Comm:
    """What the engine asks of its communicator outside MPI calls: the rank, for messages."""

    def Get_rank(self):
        return 3

    def Get_size(self):
        return 4


def _ops(log, name):
    log.append(f"{name} ran")
    return
    yield  # noqa: unreachable; makes this a generator


@pytest.mark.parametrize("mode", ["poll", "thread"])
def test_a_claimed_engine_queues_the_others_until_finished(mode):
    """``claim`` takes the idle engine for the caller (a running handle); while it holds it a
    second claim gets ``None`` and a submitted operation waits in the queue; ``finish``
    frees it and the queued one runs."""
    engine, log = Engine(_Comm(), None, mode), []
    try:
        h = engine.claim("mine", where={})
        assert h is not None and engine._running is h
        assert engine.claim("another") is None
        queued = engine.submit(_ops(log, "queued"), "queued")
        assert not queued._done and log == []
        engine.finish(h)
        assert h._done and engine._running is not h
        queued.wait()
        assert log == ["queued ran"]
        assert engine.claim("again") is not None
    finally:
        engine.close()


def test_finish_raises_the_callers_error_naming_rank_and_operation_and_frees_the_engine():
    engine = Engine(_Comm(), None, "poll")
    h = engine.claim("allreduce(bucket3)")
    with pytest.raises(CommError, match=r"rank 3: allreduce\(bucket3\) failed: .*boom"):
        engine.finish(h, RuntimeError("boom"))
    assert engine._running is None and h._done
    assert engine.run(lambda: None, "next", result=7) == 7


def test_run_queues_behind_a_claimed_operation():
    """A blocking ``run`` while the engine is claimed on another thread waits its turn."""
    import threading
    engine, log = Engine(_Comm(), None, "thread"), []
    try:
        h = engine.claim("first")
        done = threading.Event()

        def second():
            engine.run(lambda: log.append("second"), "second")
            done.set()

        threading.Thread(target=second).start()
        assert not done.wait(0.2) and log == []
        log.append("first")
        engine.finish(h)
        assert done.wait(10)
        assert log == ["first", "second"]
    finally:
        engine.close()


class _Asked:
    """Departures whose ranks answer as given (rank 5 does not answer)."""

    def __init__(self, answers):
        self.answers, self.asked = answers, None

    def ask(self, ranks):
        self.asked = list(ranks)
        return self.answers


def test_a_stall_message_says_what_each_asked_rank_answered():
    """Each kind of answer in words: the same collective, another one (the ranks call them in
    different orders), none (it computes), finished, and no answer (dead)."""
    engine = Engine(_Comm(), None, "poll")
    try:
        h = engine.claim("allreduce(bucket2)", where={"phase": "scatter-reduce", "peer": 1})
        asked = _Asked({0: ("op", "allreduce(bucket2)", 7, 3.0), 1: ("op", "broadcast(params)", 7, 3.5),
                        2: ("idle", 6, "allreduce(bucket1)", 4.0), 4: ("finished", 6, None, 1.5)})
        engine._departures = (asked, None)
        said = engine._ask_peers(h, [0, 1, 2, 4, 5])
        assert asked.asked == [0, 1, 2, 4, 5]
        assert said == (
            " Asked: rank 0 is in allreduce(bucket2) (#7), no progress for 3.0 s; "
            "rank 1 is in broadcast(params) (#7), no progress for 3.5 s (another collective: the "
            "ranks call them in different orders); rank 2 is in no hpcdp operation (6 run, the last "
            "allreduce(bucket1); none for 4.0 s): it computes, or waits outside hpcdp; rank 4 has "
            "finished, 1.5 s ago (6 run); rank 5 did not answer (dead, or stuck where Python cannot "
            "run its threads).")
        # the stall's message asks the peer it waits for, and says so
        assert "Asked: rank 1 is in broadcast(params)" in engine.describe_stall(h, 9.0, 5.0)
        assert asked.asked == [1]
        engine.finish(h)
    finally:
        engine.close()


def test_a_stall_warning_says_when_the_job_would_be_aborted_and_a_watched_stall_is_warned_of_once_a_period():
    """The warning's message ends with the timeout that will abort the job, or says none is
    set; the watchdog says it once per period of no progress, again after each further
    period, and anew for the next stalled operation."""
    def _until(cond, limit=20.0):
        end = time.monotonic() + limit
        while not cond():
            assert time.monotonic() < end, said
            time.sleep(0.01)

    engine, said = Engine(_Comm(), None, "thread"), []
    try:
        h = engine.claim("allreduce(bucket2)", where={"phase": "scatter-reduce", "peer": 1})
        text = engine.describe_stall(h, 9.0, 600.0, warning=60.0)
        assert text.startswith("rank 3/4: no progress for 9.0 s in allreduce(bucket2) (#1), scatter-reduce")
        assert text.endswith("The job is aborted after 600 s without progress (HPCDP_STALL_TIMEOUT) and "
                             "warns every 60 s (HPCDP_STALL_WARNING; 0: no warnings)."), text
        assert engine.describe_stall(h, 9.0, 0.0, warning=60.0).endswith(
            "No stall timeout is set (HPCDP_STALL_TIMEOUT=0): the job waits and warns every 60 s "
            "(HPCDP_STALL_WARNING; 0: no warnings).")
        engine.warn_stalls(0.3, said.append)
        _until(lambda: len(said) >= 2)
        idle = [float(s.split("no progress for ")[1].split(" s")[0]) for s in said[:2]]
        assert 0.3 <= idle[0] and idle[1] // 0.3 > idle[0] // 0.3, said  # a period apart, not a round
        engine.finish(h)
        n = len(said)
        time.sleep(0.5)
        assert len(said) == n  # nothing runs: nothing to warn of
        h = engine.claim("broadcast(params)", where={"peer": 1})
        _until(lambda: len(said) > n)
        assert "in broadcast(params) (#2)" in said[n], said
        engine.finish(h)
    finally:
        engine.close()
