"""hpcdp.comm.hugepages: which buffers are advised or collapsed, and when (serial)."""
import platform
import sys

import numpy as np
import pytest

from hpcdp.comm import hugepages
from hpcdp.comm.buffers import as_buffer

MiB = 1 << 20


class Recorder:
    """A stand-in for libc's madvise: records every call, answers ``rc``."""

    def __init__(self, rc=0):
        self.calls, self.rc = [], rc

    def __call__(self, address, length, advice):
        self.calls.append((address, length, advice))
        return self.rc


def test_a_buffer_is_collapsed_once_at_its_second_sighting():
    rec = Recorder()
    c = hugepages.Collapser(rec)
    base = 64 * MiB + 4096  # not 2 MiB aligned: only the whole huge pages inside are advised
    c.see(base, 16 * MiB)
    assert rec.calls == [] and c.collapsed == 0
    c.see(base, 16 * MiB)
    assert rec.calls == [(66 * MiB, 14 * MiB, 25)] and c.collapsed == 1
    for _ in range(3):
        c.see(base, 16 * MiB)
    assert len(rec.calls) == 1


def test_small_buffers_other_lengths_and_failures():
    rec = Recorder(rc=-1)
    c = hugepages.Collapser(rec)
    for _ in range(3):
        c.see(0, hugepages.MIN_BYTES - 1)          # below the size worth a collapse
    c.see(0, 8 * MiB)
    c.see(0, 6 * MiB)                              # same address, another length: a new buffer
    assert rec.calls == []
    c.see(0, 8 * MiB)                              # its second sighting: tried, refused
    assert rec.calls == [(0, 8 * MiB, 25)] and c.collapsed == 0
    c.see(0, 8 * MiB)
    assert len(rec.calls) == 1                     # a refusal is not retried
    assert hugepages.Collapser(None).see(0, 8 * MiB) is None  # no madvise here: nothing happens


def test_forgets_the_least_recently_seen(monkeypatch):
    monkeypatch.setattr(hugepages, "_REMEMBERED", 2)
    rec = Recorder()
    c = hugepages.Collapser(rec)
    c.see(0, 8 * MiB)
    c.see(16 * MiB, 8 * MiB)
    c.see(32 * MiB, 8 * MiB)                       # the first is forgotten
    c.see(0, 8 * MiB)
    assert rec.calls == []


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("HPCDP_HUGEPAGES", "0")
    assert hugepages._madvise() is None
    assert not hugepages.advise(0, 64 * MiB)


def test_collectives_see_their_host_buffers_from_min_bytes(monkeypatch):
    """Buffers of MIN_BYTES and more are shown to the collapser; smaller ones are not looked
    at (the collapser would skip them, and their address costs a small call a microsecond)."""
    seen = []
    monkeypatch.setattr(hugepages.collapser(), "see", lambda a, n: seen.append((a, n)))
    x = np.zeros((4, hugepages.MIN_BYTES // 16), np.float32)
    as_buffer(x)
    as_buffer(np.zeros(1024, np.float32))
    assert seen == [(x.ctypes.data, hugepages.MIN_BYTES)]
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, hugepages.MIN_BYTES // 16, dtype=torch.float64)
    as_buffer(t)
    as_buffer(torch.zeros(3, 5, dtype=torch.float64))
    assert seen[1:] == [(t.data_ptr(), hugepages.MIN_BYTES)]


def _kernel_collapses() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not switched off."""
    release = platform.release().split(".")
    try:
        version = (int(release[0]), int(release[1]))
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return version >= (6, 1) and "[never]" not in f.read()
    except (OSError, ValueError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_a_real_collapse_keeps_the_contents():
    """Where the kernel can, the second sighting collapses; either way the buffer's contents
    are untouched."""
    x = np.arange(12 * MiB // 8, dtype=np.float64)
    c = hugepages.Collapser(hugepages._madvise())
    c.see(x.ctypes.data, x.nbytes)
    c.see(x.ctypes.data, x.nbytes)
    if _kernel_collapses():
        assert c.collapsed == 1
    np.testing.assert_array_equal(x, np.arange(x.size, dtype=np.float64))
