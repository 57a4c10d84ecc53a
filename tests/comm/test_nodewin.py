"""Flag rounds wait by reading shared memory, and must still let MPI make progress: a peer
may wait in MPI for an answer this rank's MPI owes it (see hpcdp.comm.nodewin.Round)."""
import pytest

from hpcdp.comm.nodewin import Round


class PeerNeedsProgress:
    """A window whose peer arrives at the round only after this rank has let MPI make
    progress ``needed`` times (its large message's acknowledgement was pending here)."""

    def __init__(self, needed: int, spin_mask: int):
        self.seq, self.spin_mask, self.needed, self.pokes = 1, spin_mask, needed, 0
        self._seq_view = [1, 0]  # this rank has arrived, the peer not yet

    def poke(self):
        self.pokes += 1
        if self.pokes >= self.needed:
            self._seq_view[1] = 1

    def late(self):
        return [1] if self._seq_view[1] < self.seq else []


@pytest.mark.timeout(20)
@pytest.mark.parametrize("spin_mask", [0, 0x3FF])
def test_wait_lets_mpi_progress(spin_mask):
    win = PeerNeedsProgress(needed=3, spin_mask=spin_mask)
    Round(win, {}).Wait()  # would spin forever on the flags alone
    assert win.pokes == 3 and win._seq_view == [1, 1]


@pytest.mark.timeout(20)
def test_test_lets_mpi_progress_until_complete():
    win = PeerNeedsProgress(needed=2, spin_mask=0)
    r = Round(win, None)
    assert [r.Test(), r.Test(), r.Test(), r.Test()] == [False, False, True, True]
    assert win.pokes == 2  # no MPI call once the round is complete
