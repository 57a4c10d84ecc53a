"""hpcdp.dist.work without MPI: an operation's outcome reaches its future exactly once, and
who delivers it (a completion thread, or the thread that waits for the operation)."""
import threading

import pytest

torch = pytest.importorskip("torch")

from hpcdp.comm.engine import Engine  # noqa: E402
from hpcdp.dist import work  # noqa: E402
from hpcdp.errors import MismatchError  # noqa: E402


def test_a_completion_delivers_once_and_only_once_the_operation_ended():
    done = work.Completion(torch.futures.Future())
    done.deliver()  # the operation has not ended: nothing to deliver
    assert not done.future.done()
    value = [torch.ones(2)]
    done.outcome = value
    done.deliver()
    done.outcome = [torch.zeros(2)]  # (a second delivery would set the future twice)
    done.deliver()
    assert done.future.wait() is value


def test_a_failed_operation_fails_its_future_with_its_own_error():
    done = work.Completion(torch.futures.Future())
    chained = done.future.then(lambda f: f.value())
    error = MismatchError("rank 1: allreduce: different arguments")
    done.failed, done.outcome = True, error
    done.deliver()
    with pytest.raises(MismatchError) as raised:
        done.future.wait()
    assert raised.value is error
    with pytest.raises(RuntimeError, match="different arguments"):  # (torch wraps it here)
        chained.wait()


class _Engine(Engine):
    def __init__(self, mode, thread):
        self.mode, self._thread, self.thread_setup = mode, thread, None


@pytest.mark.parametrize("mode, on_progress_thread, by_pool", [
    ("thread", True, True),    # the progress thread finished it: a completion thread
    ("thread", False, False),  # its waiter ran it inline: Work.wait delivers
    ("poll", False, True),     # any caller's progress may finish it: a completion thread
])
def test_who_delivers(monkeypatch, mode, on_progress_thread, by_pool):
    submitted = []
    monkeypatch.setattr(work, "_completer", lambda engine: type("Pool", (), {
        "submit": staticmethod(submitted.append)})())
    engine = _Engine(mode, threading.current_thread() if on_progress_thread else None)
    done = work.Completion(torch.futures.Future())
    done.outcome = [torch.ones(1)]
    work._hand_over(done, engine)
    assert submitted == ([done.deliver] if by_pool else [])
    assert not done.future.done()


def test_wait_delivers_what_it_ran_also_when_it_failed():
    """Work.wait delivers its completions after the engine's handles, raising or not."""
    error = MismatchError("different arguments")

    class Handle:
        def wait(self):
            raise error

    done = work.Completion(torch.futures.Future())
    done.failed, done.outcome = True, error
    w = work.Work(done.future, [Handle()], [done])
    with pytest.raises(MismatchError):
        w.wait()
    assert done.future.done()
    with pytest.raises(MismatchError):
        done.future.wait()
