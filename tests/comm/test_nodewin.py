"""Flag rounds wait by reading shared memory, and must still let MPI make progress: a peer
may wait in MPI for an answer this rank's MPI owes it (see hpcdp.comm.nodewin.Round)."""
import sys

import numpy as np
import pytest

from hpcdp.comm.nodewin import Round


class PeerNeedsProgress:
    """A window whose peer arrives at the round only after this rank has let MPI make
    progress ``needed`` times (its large message's acknowledgement was pending here)."""

    def __init__(self, needed: int, spin_polls: int):
        self.seq, self.spin_polls, self.needed, self.pokes = 1, spin_polls, needed, 0
        self.seqs = np.array([1, 0], np.int64)  # this rank has arrived, the peer not yet
        self._seq_view = memoryview(self.seqs)

    def poke(self):
        self.pokes += 1
        if self.pokes >= self.needed:
            self.seqs[1] = 1

    def late(self):
        return [1] if self.seqs[1] < self.seq else []


@pytest.mark.timeout(20)
@pytest.mark.parametrize("spin_polls", [1, 1 << 15])
def test_wait_lets_mpi_progress(spin_polls):
    win = PeerNeedsProgress(needed=3, spin_polls=spin_polls)
    Round(win, {}).Wait()  # would spin forever on the flags alone
    assert win.pokes == 3 and win.seqs.tolist() == [1, 1]


@pytest.mark.timeout(20)
def test_wait_polls_in_compiled_code_not_python():
    """Polled in Python, a wait held the GIL: the rank's other threads (the stall watchdog,
    the trace's writing when the job is aborted) got it 5 ms after each of their system
    calls, and rank 0's trace took seconds to write, longer than the aborting rank waited
    for it. The polls now run compiled, without the GIL: between two calls into MPI the
    wait runs a few Python calls, not a thousand."""
    win = PeerNeedsProgress(needed=50, spin_polls=1 << 15)
    Round(win, {}).Wait()  # (compiled, or loaded from numba's cache, before counting)
    win = PeerNeedsProgress(needed=50, spin_polls=1 << 15)
    events = []
    sys.setprofile(lambda frame, event, arg: events.append(event))
    try:
        Round(win, {}).Wait()
    finally:
        sys.setprofile(None)
    assert win.pokes == 50 and len(events) < 10 * 50, f"{len(events)} Python events for 50 pokes"


@pytest.mark.timeout(20)
def test_test_lets_mpi_progress_until_complete():
    win = PeerNeedsProgress(needed=2, spin_polls=1)
    r = Round(win, None)
    assert [r.Test(), r.Test(), r.Test(), r.Test()] == [False, False, True, True]
    assert win.pokes == 2  # no MPI call once the round is complete


ABORTING_JOB = """
import numpy as np, hpcdp
hpcdp.init()
x = np.ones(1 << 20, np.float32)
hpcdp.allreduce(x, algo="shm")
if hpcdp.rank() == 1:
    raise RuntimeError("rank 1 fails on purpose")
hpcdp.barrier()
"""


@pytest.mark.timeout(120)
def test_a_rank_that_fails_leaves_no_window_in_dev_shm():
    """The node's windows live in /dev/shm while the job runs (MPICH unlinks its files at
    once and keeps them mapped, so a name check would not see them: the free space does).
    A job ended by one rank's uncaught exception must give them all back; the MPI library's
    own 2 MiB segment, which a plain MPI_Abort leaves too, is inside the tolerance."""
    import os
    import time

    from launch import run_mpi
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    capacity = 16 << 20  # 2 ranks x 2 halves x 16 MiB = 64 MiB of windows

    def free():
        st = os.statvfs("/dev/shm")
        return st.f_bavail * st.f_frsize

    before = free()
    p = run_mpi(2, ["-c", ABORTING_JOB], timeout=100, env={"HPCDP_SHM_BYTES": str(capacity)})
    assert p.returncode != 0 and "rank 1 fails on purpose" in p.stdout + p.stderr, p.stderr
    deadline = time.monotonic() + 10  # the ranks' exits may finish after mpirun's
    while (lost := before - free()) >= 8 << 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lost < 8 << 20, f"/dev/shm has {lost / 2**20:.0f} MiB less free 10 s after the job"


FIRST_CALL_MISMATCH = """
import numpy as np, hpcdp
hpcdp.init()
x = np.ones(100, np.float32)
try:  # the job's first shared-memory call: rank 0 calls the ring instead
    hpcdp.allreduce(x, algo="ring" if hpcdp.rank() == 0 else "shm")
except hpcdp.MismatchError as exc:
    assert "algo=ring" in str(exc) and "algo=shm" in str(exc), str(exc)
else:
    raise AssertionError("no MismatchError")
hpcdp.allreduce(x, algo="shm")
assert np.all(x == hpcdp.size()), x[:3]
print("OK", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_mismatch_at_the_first_shared_memory_call_raises_instead_of_hanging(np_):
    """The first shared-memory call makes the data window (with every rank of the node);
    a rank calling something else then must not leave the others waiting in its creation."""
    from launch import run_mpi
    p = run_mpi(np_, ["-c", FIRST_CALL_MISMATCH], timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("OK") == np_, p.stdout  # every rank raised, then reduced
