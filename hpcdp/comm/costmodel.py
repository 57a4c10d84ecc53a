"""An alpha-beta-gamma cost model of hpcdp's allreduce algorithms (and of native MPI's, for
contrast): predicted seconds per call from a :class:`Topology` and measured constants
(:class:`Calibration`, written by ``hpcdp-bench calibrate``, read by :func:`load`).

Per message: alpha (latency) + bytes / beta (bandwidth); per reduction: bytes / gamma. Where
the calibration holds measured profiles (times per size of a point-to-point exchange inside a
node, of a copy and of a float32 addition, hpcdp's and the MPI library's own: ``hpcdp-bench
calibrate`` writes them), those are read off the profiles instead (piecewise linear between
the measured sizes, the largest one's rate beyond it), which sees per-call overheads and
buffers that leave the cache. The model is a sum of dependent steps (no overlap between
steps; the ring's segment pipelining inside a step is not modelled), each step as slow as its
slowest link. A node's network link is shared by every message that leaves the node in the
same step. Standard library only: no torch, no MPI, so it runs anywhere (``hpcdp-bench model``).

    cal = load()                                     # measured, or DEFAULTS
    topo = Topology.uniform(8, 4)                    # 8 nodes x 4 ranks, block placement
    predict("two_level", 64 << 20, topo, cal)        # seconds
    choose(64 << 20, topo, cal)                      # "two_level"
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .shm import SHM_CAPACITY, SHM_SEGMENT, SHM_SMALL, one_round_fits

ENV_VAR = "HPCDP_CALIBRATION"
# one message of MPI's own C implementation inside a node (MPICH shared memory, a few us)
NATIVE_ALPHA_INTRA = 2e-6
#: the sizes hpcdp-bench calibrate profiles (bytes): tiny, in cache, and out of it
#: (16 and 32 KiB: the ring's chunks of a 64 KiB buffer at np = 4 and 2; an exchange's time is
#: not linear between 4 and 64 KiB, here 5.9 us at 4 KiB, 9.2 at 8, 10.9 at 32, 14.9 at 64)
PROFILE_SIZES = (8, 4 << 10, 16 << 10, 32 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
#: the float32 CUDA tensor sizes (bytes) whose allreduce hpcdp-bench calibrate times with
#: device memory passed to a CUDA-aware MPI and with it staged through host memory
DEVICE_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
DEVICE_PROFILES = ("device_direct", "device_staged")
PROFILES = ("p2p", "copy", "add", "native_add", "shared_copy", "shared_add",
            "shared_write") + DEVICE_PROFILES
ALGOS = ("ring", "shm", "two_level", "native_rd", "native_rsag", "native")
HPCDP_ALGOS = ("ring", "shm", "two_level")
#: two_level's stages across nodes (hpcdp.comm.twolevel)
ACROSS = ("ring", "doubling", "halving")
#: another stage replaces the ring only when predicted this much faster: on two nodes all
#: three move the same bytes and the model's gain of one fewer message was 0.1 % of a
#: 64 MiB call, while recursive doubling measured 2 % slower than the ring (one message of
#: a 2 MiB slice against two of 1 MiB; emulated 1 Gbit/s link, docs/performance.md)
ACROSS_MARGIN = 0.05
# latencies may be 0 (alpha_inter on one node); bandwidths and speeds must be > 0
_MAY_BE_ZERO = ("alpha_step", "alpha_inter", "alpha_sync", "alpha_call", "alpha_check",
                "alpha_ring_step", "alpha_round_call")
# fields a calibration file may leave out (files written before they existed): the defaults'
_OPTIONAL = ("alpha_check", "alpha_native", "alpha_ring_step", "alpha_round_call") + PROFILES


@dataclass(frozen=True)
class Calibration:
    """The model's constants: times in seconds, bandwidths in bytes/second."""
    alpha_step: float   # one Python-driven point-to-point ring step inside a node (tiny Sendrecv)
    alpha_inter: float  # extra latency of a message between nodes
    alpha_sync: float   # one shared-memory flag round among a node's ranks
    alpha_call: float   # fixed cost of one hpcdp allreduce call in Python (arguments, engine)
    beta_intra: float   # point-to-point bandwidth between two ranks of a node
    beta_inter: float   # one node's network link, each direction (shared by the node's ranks)
    beta_mem: float     # memcpy bandwidth of one rank (into / out of a shared window)
    gamma: float        # reduction speed of one rank (a += b, float32), bytes of b per second
    alpha_check: float = 0.0   # what the default argument check adds to a ring call
    alpha_ring_step: float = 0.0  # what a step of hpcdp's ring costs beyond its exchange
    alpha_native: float = 1e-6  # one native MPI_Allreduce call on one rank (mpi4py and MPI)
    # fixed cost of a blocking one-round shm call whose plan is kept (hpcdp.collectives):
    # the buffer's checks, the engine's claim, the plan's lookup; alpha_call is the rest's
    alpha_round_call: float = 2e-6
    # measured ((bytes, seconds), ...) by size, increasing: a Sendrecv between ring neighbours
    # inside a node (replaces alpha_step + n / beta_intra), a copy (n / beta_mem) and a float32
    # addition (n / gamma); empty: the constants
    p2p: tuple = ()
    copy: tuple = ()
    add: tuple = ()
    # the MPI library's own float32 addition (MPI_Reduce_local with MPI_SUM), which its
    # allreduce adds with (MPICH's is not vectorised: 2.6-3.2x numpy's time here; Open
    # MPI's 1.1-1.5x); empty: add's
    native_add: tuple = ()
    # the same copy and addition reading a node window part another rank has just written
    # (its lines come from the writer's cache), and a copy into a rank's own part after
    # another rank read it (its lines are invalidated there first), up to a segment;
    # empty: copy and add's
    shared_copy: tuple = ()
    shared_add: tuple = ()
    shared_write: tuple = ()
    # hpcdp.allreduce of a float32 CUDA tensor by size, its memory passed to the CUDA-aware
    # MPI (the ring) and staged through pinned host memory; empty (no GPU, MPI not
    # CUDA-aware, or not calibrated): device memory goes to a CUDA-aware MPI at every size
    device_direct: tuple = ()
    device_staged: tuple = ()
    source: str = "defaults"  # "defaults", or the file it was read from and when it was measured

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def t_p2p(self, n: float) -> float:
        """Seconds of a point-to-point exchange of ``n`` bytes inside a node (Python-driven)."""
        return _read(self.p2p, n) if self.p2p else self.alpha_step + n / self.beta_intra

    def t_copy(self, n: float) -> float:
        """Seconds of one rank's copy of ``n`` bytes (every rank copying at once)."""
        return _read(self.copy, n) if self.copy else n / self.beta_mem

    def t_add(self, n: float) -> float:
        """Seconds of one rank's float32 ``a += b`` over ``n`` bytes of ``b``."""
        return _read(self.add, n) if self.add else n / self.gamma

    def t_native_add(self, n: float) -> float:
        """Seconds of the MPI library's own float32 addition over ``n`` bytes (what native
        allreduce algorithms add with); :meth:`t_add` where it was not measured."""
        return _read(self.native_add, n) if self.native_add else self.t_add(n)

    def t_shared_copy(self, n: float) -> float:
        """Seconds of one rank's copy of ``n`` bytes out of a window part that another rank
        has just written (see :func:`_shared`)."""
        return _shared(self.shared_copy, n, self.t_copy(n))

    def t_shared_add(self, n: float) -> float:
        """Seconds of one rank's float32 ``a += b`` where ``b`` (``n`` bytes) is a window
        part that another rank has just written (see :func:`_shared`)."""
        return _shared(self.shared_add, n, self.t_add(n))

    def t_shared_write(self, n: float) -> float:
        """Seconds of one rank's copy of ``n`` bytes into its window part after another rank
        read it (see :func:`_shared`)."""
        return _shared(self.shared_write, n, self.t_copy(n))

    def device_transport(self, n: float) -> str:
        """How an allreduce of ``n`` bytes of device memory is faster where MPI is
        CUDA-aware: ``"direct"`` (device memory to MPI) or ``"staged"`` (through pinned host
        memory), off the two device profiles; ``"direct"`` where they were not measured."""
        if not (self.device_direct and self.device_staged):
            return "direct"
        return "staged" if _read(self.device_staged, n) < _read(self.device_direct, n) else "direct"

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        """Check every field (all present, numbers, finite, positive; no unknown ones)."""
        if not isinstance(d, dict):
            raise ValueError(f"a calibration is a JSON object, not {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))} "
                             f"(known: {', '.join(names)})")
        values = {}
        for name in names[:-1]:
            if name in PROFILES:
                if name in d:
                    values[name] = _profile(name, d[name])
                continue
            if name not in d:
                if name in _OPTIONAL:
                    values[name] = getattr(DEFAULTS, name)
                    continue
                raise ValueError(f"missing field {name!r}")
            v = d[name]
            if not _finite(v) or v < 0 or (v == 0 and name not in _MAY_BE_ZERO):
                raise ValueError(f"field {name!r} must be a finite number > 0"
                                 f"{' (or 0)' if name in _MAY_BE_ZERO else ''}, not {v!r}")
            values[name] = float(v)
        source = d.get("source", "defaults")
        if not isinstance(source, str):
            raise ValueError(f"field 'source' must be a string, not {source!r}")
        return cls(**values, source=source)


# hpcdp-bench calibrate on the 2-core VM hpcdp is developed on (MPICH 5, one rank a core,
# quiet), and a 1 Gbit/s link between nodes: alpha_step 2-3 us, alpha_sync (a flag round)
# 0.6-1 us, alpha_call (an empty call) 5.5-6.5 us, alpha_round_call (a one-round shm call
# but its round) ~2 us, alpha_ring_step ~2 us, alpha_check ~3 us,
# a native call on one rank 0.5 us, beta_intra 15-17 GB/s, beta_mem and gamma 40-44 GB/s over
# a 4 MiB segment (in cache). Without profiles the model takes in-cache speeds at every size;
# it prefers shm on one node at every size (the runtime offers shm up to the window's half,
# see _Runtime.auto_algo) and two_level across nodes.
# Measure your machine (hpcdp-bench calibrate): that also writes the profiles.
DEFAULTS = Calibration(alpha_step=2.5e-6, alpha_inter=50e-6, alpha_sync=0.8e-6, alpha_call=6e-6,
                       beta_intra=16e9, beta_inter=125e6, beta_mem=40e9, gamma=40e9,
                       alpha_check=3e-6, alpha_ring_step=2e-6, alpha_native=0.5e-6)


def _finite(v) -> bool:
    """A finite int or float (not a bool): what every calibration number must be."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _profile(name: str, points) -> tuple:
    """A profile field as ``((bytes, seconds), ...)``: pairs of positive numbers, sizes increasing."""
    bad = ValueError(f"field {name!r} must be a list of [bytes, seconds] pairs of positive "
                     f"numbers, sizes increasing, not {points!r}")
    if not isinstance(points, (list, tuple)):
        raise bad
    out = []
    for pair in points:
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and all(
            _finite(v) and v > 0 for v in pair)
        if not ok or (out and pair[0] <= out[-1][0]):
            raise bad
        out.append((int(pair[0]), float(pair[1])))
    return tuple(out)


def _shared(profile: tuple, n: float, own: float) -> float:
    """A shared-window profile's time for ``n`` bytes, never less than ``own``, the same
    operation on the rank's own memory (beyond the profile's largest size both stream from
    memory); ``own`` where the calibration has no such profile."""
    return max(own, _read(profile, n)) if profile else own


def _read(profile: tuple, n: float) -> float:
    """Seconds for ``n`` bytes off a measured profile: the first point's time below its size,
    linear between two points, the last point's time per byte beyond it."""
    if n <= profile[0][0]:
        return profile[0][1]
    for (b0, t0), (b1, t1) in zip(profile, profile[1:]):
        if n <= b1:
            return t0 + (t1 - t0) * (n - b0) / (b1 - b0)
    b, t = profile[-1]
    return t * n / b


def default_path() -> Path:
    """Where ``hpcdp-bench calibrate`` writes and :func:`load` looks by default."""
    return Path("~/.cache/hpcdp/calibration.json").expanduser()


def load(path=None) -> Calibration:
    """The calibration in ``path``, else in ``$HPCDP_CALIBRATION``, else in
    :func:`default_path`; :data:`DEFAULTS` when that file does not exist. A malformed
    file is a ``ValueError`` naming the file and the field."""
    path = Path(path or os.environ.get(ENV_VAR) or default_path()).expanduser()
    if not path.exists():
        return DEFAULTS
    try:
        d = json.loads(path.read_text())
        cal = Calibration.from_dict(d)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"calibration file {path}: {e}") from None
    return dataclasses.replace(cal, source=f"{path} ({cal.source})")


def save(cal: Calibration, path) -> Path:
    """Write ``cal`` to ``path`` as JSON, atomically (a temporary file renamed over it),
    creating the directory."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cal.to_dict(), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


@dataclass(frozen=True)
class Topology:
    """Nodes and ranks: ``ranks_per_node`` has one entry per node (uneven allowed).
    ``placement``: ``"block"`` (consecutive ranks share a node) or ``"cyclic"`` (rank r on
    node r % nodes; with uneven nodes, round robin over the nodes that still have room)."""
    ranks_per_node: tuple[int, ...]
    placement: str = "block"

    def __post_init__(self):
        rpn = tuple(int(x) for x in self.ranks_per_node)
        if not rpn or min(rpn) < 1:
            raise ValueError(f"ranks_per_node needs at least one node and >= 1 rank on each, "
                             f"not {self.ranks_per_node!r}")
        if self.placement not in ("block", "cyclic"):
            raise ValueError(f"placement is 'block' or 'cyclic', not {self.placement!r}")
        object.__setattr__(self, "ranks_per_node", rpn)

    @property
    def nodes(self) -> int:
        return len(self.ranks_per_node)

    @property
    def size(self) -> int:
        return sum(self.ranks_per_node)

    @classmethod
    def uniform(cls, nodes: int, ranks_per_node: int, placement: str = "block") -> "Topology":
        return cls((ranks_per_node,) * nodes, placement)

    def rank_nodes(self) -> tuple:
        """The node of every rank, in rank order."""
        return _rank_nodes(self)


@functools.lru_cache(maxsize=256)
def _rank_nodes(topo: Topology) -> tuple:
    if topo.placement == "block":
        return tuple(i for i, n in enumerate(topo.ranks_per_node) for _ in range(n))
    room, out = list(topo.ranks_per_node), []
    while len(out) < topo.size:
        for i in range(topo.nodes):
            if room[i]:
                out.append(i)
                room[i] -= 1
    return tuple(out)


def _pof2(p: int) -> int:
    """The largest power of two <= ``p``."""
    return 1 << (p.bit_length() - 1)


@functools.lru_cache(maxsize=4096)
def _pattern(topo: Topology, kind: str, k: int = 0) -> tuple:
    """Who sends to whom in one step, as (any message inside a node, most messages leaving one
    node). ``kind``: ``"ring"`` (r -> r+1 mod p), ``"xor"`` (r <-> r xor 2^k, r < p2, the
    largest power of two <= p), ``"fold"`` (2i -> 2i+1, i < p - p2)."""
    p, nodes = topo.size, topo.rank_nodes()
    p2 = _pof2(p)
    if kind == "ring":
        pairs = [(r, (r + 1) % p) for r in range(p)]
    elif kind == "xor":
        pairs = [(r, r ^ (1 << k)) for r in range(p2)]
    else:
        pairs = [(2 * i, 2 * i + 1) for i in range(p - p2)]
    out, intra = {}, False
    for src, dst in pairs:
        if nodes[src] == nodes[dst]:
            intra = True
        else:
            out[nodes[src]] = out.get(nodes[src], 0) + 1
    return intra, max(out.values(), default=0)


def _step(pattern: tuple, cal: Calibration, n: float, native: bool = False) -> float:
    """Seconds of a step in which messages of ``n`` bytes follow ``pattern`` (:func:`_pattern`):
    as slow as its slowest message. One inside a node is a point-to-point exchange
    (:meth:`Calibration.t_p2p`; native MPI's own, in C, pays ``NATIVE_ALPHA_INTRA`` instead of
    the Python-driven exchange's latency); one that leaves its node pays ``alpha_inter`` on
    top and shares the node's link with every other message leaving that node in the step."""
    intra, leaving = pattern
    alpha = NATIVE_ALPHA_INTRA if native else cal.t_p2p(0)
    inside = cal.t_p2p(n) - cal.t_p2p(0) + alpha
    if not leaving:
        return inside
    across = alpha + cal.alpha_inter + n * leaving / cal.beta_inter
    return max(across, inside) if intra else across


def _ring(n: int, topo: Topology, cal: Calibration) -> float:
    """hpcdp's flat ring over all p ranks (rank r sends to r + 1):
    1. scatter-reduce, p - 1 steps: each rank sends a chunk of n/p, receives one, adds it;
    2. allgather, p - 1 steps: the same messages, no addition.
    A step is as slow as the slowest edge of the ring (see :func:`_step`), plus the ring's
    own bookkeeping (alpha_ring_step)."""
    p = topo.size
    if p == 1 or n == 0:
        return cal.alpha_call
    chunk = n / p
    step = _step(_pattern(topo, "ring"), cal, chunk) + cal.alpha_ring_step
    return cal.alpha_call + 2 * (p - 1) * step + (p - 1) * cal.t_add(chunk)


def _shm(n: int, ranks: int, cal: Calibration, segment: int = SHM_SEGMENT,
         small: int = SHM_SMALL) -> float:
    """hpcdp's shared-memory allreduce on one node of L ranks. Per segment of ``segment``
    bytes (segments run one after the other; the last one may be shorter):
    1. copy in: every rank copies its segment but its own slice (n (L-1)/L) into its window
       part, which the others read during the call before;
    2. one flag round (alpha_sync);
    3. rank j reduces slice j: its own input plus the other L - 1 (L - 1 additions of n/L
       read from the others' window parts), written to its window part and to its buffer;
    4. one flag round;
    5. copy out: every rank copies the other slices back (n (L-1)/L, from the others' parts).
    Each segment is timed at its own size: what the ranks exchange through the window is one
    segment at a time, and that decides whether another rank's lines are still in cache.
    Reads of what another rank wrote and writes of what another rank read take the shared
    profiles (:meth:`Calibration.t_shared_copy`, :meth:`~Calibration.t_shared_add`,
    :meth:`~Calibration.t_shared_write`). The whole is never faster than one copy of the
    buffer at its own size (:meth:`Calibration.t_copy`): every byte of it is read once and
    written once, and a buffer too large for the caches streams from memory (here a 16 MiB
    call took 1.5x sixteen 1 MiB calls, the copy of 16 MiB about as long as the call).
    Where one round fits (:func:`hpcdp.comm.shm.one_round_fits`: up to ``small`` bytes and a
    bounded read of the others' inputs), the one-round variant is taken when it is faster:
    copy in, one flag round, every rank reduces the whole buffer itself (a copy and L - 1
    additions of n, read from the window), as a blocking call with its plan kept
    (alpha_round_call, not alpha_call: see :func:`hpcdp.collectives.allreduce`). That
    constant is a whole call of one element, the compiled round's fixed work included, so
    the bytes add only what the profiles add beyond their smallest size (a profile's small
    sizes are mostly the cost of a numpy call, which the compiled round does not make)."""
    if ranks == 1 or n == 0:
        return cal.alpha_call
    L = ranks

    def two_rounds(m):
        return (2 * cal.alpha_sync + (L - 1) / L * (cal.t_shared_write(m) + cal.t_shared_copy(m))
                + cal.t_shared_write(m / L) + (L - 1) * cal.t_shared_add(m / L))
    full, rest = divmod(n, segment)
    big = cal.alpha_call + max(full * two_rounds(segment) + (two_rounds(rest) if rest else 0.0),
                               cal.t_copy(n))
    if one_round_fits(n, L, small):
        one_round = (cal.alpha_round_call + cal.alpha_sync + _beyond(cal.t_shared_write, n)
                     + _beyond(cal.t_shared_copy, n) + (L - 1) * _beyond(cal.t_shared_add, n))
        return min(big, one_round)
    return big


def _beyond(t, n: float) -> float:
    """What ``t(n)`` (a profile's or a bandwidth's time) adds to ``t`` of the profiles'
    smallest size."""
    return max(0.0, t(n) - t(PROFILE_SIZES[0]))


def _two_level(n: int, topo: Topology, cal: Calibration, segment: int = SHM_CAPACITY,
               small: int = SHM_SMALL, across: str | None = None) -> float:
    """Shared memory inside the nodes, a stage across them (N nodes, Lmin = fewest ranks on a
    node; local ranks >= Lmin only contribute their data), per segment of ``segment`` bytes
    (the node window's capacity, as hpcdp.comm.twolevel does):
    1. reduce-scatter in every node: copy in, one flag round, local rank j < Lmin reduces
       slice j of n/Lmin from the node's L inputs (first one copied, the others added from
       their window parts: the shared profile);
    2. local rank j reduces slice j across the N nodes: the Lmin stages share each node's
       link, and each takes :func:`choose_across`'s stage for its slice (as the runtime
       does), or ``across`` where it is given (``HPCDP_ACROSS``);
    3. allgather in the node: one flag round, every rank copies the result out of the
       owners' parts (the shared profile).
    Copies and the node's additions are timed at the whole buffer's size, where its cache
    residency is decided; every segment pays its flag rounds and its stage across nodes.
    With one rank on every node, steps 1 and 3 are skipped (the stage runs in place).
    One node: :func:`_shm` (see :func:`predict`)."""
    N = topo.nodes
    if n == 0:
        return cal.alpha_call
    lmin, lmax = min(topo.ranks_per_node), max(topo.ranks_per_node)
    part = n / lmin
    scatter = cal.t_shared_write(n) + cal.t_copy(part) + (lmax - 1) * cal.t_shared_add(part)
    gather = cal.t_shared_copy(n)
    sync = 2 * cal.alpha_sync
    if lmax == 1:  # every rank alone on its node: the stage runs on its buffer in place
        scatter = gather = sync = 0.0
    full, rest = divmod(n, segment)

    def stage(piece):
        return across_time(across or choose_across(piece, N, lmin, cal), piece, N, lmin, cal)
    t = full * stage(segment / lmin) + (stage(rest / lmin) if rest else 0.0)
    return cal.alpha_call + scatter + gather + t + (full + bool(rest)) * sync


def across_time(how: str, part: float, nodes: int, lanes: int, cal: Calibration) -> float:
    """Seconds of two_level's stage across ``nodes`` nodes (one of :data:`ACROSS`) on a slice
    of ``part`` bytes, ``lanes`` such stages (one per local rank) sharing each node's link.
    A message costs hpcdp's Python-driven step (``t_p2p(0) + alpha_ring_step``) plus
    ``alpha_inter``, and ``lanes x bytes / beta_inter``:
    ring: 2(N-1) steps of part/N and N-1 additions of part/N;
    doubling: log2(N2) rounds of part, an addition each (N2: the largest power of two <= N);
    halving: 2 log2(N2) rounds, round k of part / 2^(k+1) (+ an addition in the first half);
    doubling and halving on N != N2: a fold and an unfold of part, one addition, besides."""
    if nodes == 1 or part == 0:
        return 0.0
    alpha = cal.t_p2p(0) + cal.alpha_ring_step + cal.alpha_inter

    def msg(b):
        return alpha + lanes * b / cal.beta_inter
    if how == "ring":
        chunk = part / nodes
        return 2 * (nodes - 1) * msg(chunk) + (nodes - 1) * cal.t_add(chunk)
    if how not in ("doubling", "halving"):
        raise ValueError(f"unknown stage across nodes {how!r} (known: {', '.join(ACROSS)})")
    n2 = _pof2(nodes)
    t = 2 * msg(part) + cal.t_add(part) if n2 != nodes else 0.0
    for k in range(n2.bit_length() - 1):
        if how == "doubling":
            t += msg(part) + cal.t_add(part)
        else:
            half = part / (2 << k)
            t += 2 * msg(half) + cal.t_add(half)
    return t


def choose_across(part: int, nodes: int, lanes: int, cal: Calibration = DEFAULTS) -> str:
    """The stage across nodes (of :data:`ACROSS`) for a slice of ``part`` bytes: the one with
    the lowest :func:`across_time`, where it beats the ring's by :data:`ACROSS_MARGIN`, else
    the ring."""
    t = {how: across_time(how, part, nodes, lanes, cal) for how in ACROSS}
    best = min(ACROSS, key=lambda how: (t[how], ACROSS.index(how)))
    return best if t[best] < (1 - ACROSS_MARGIN) * t["ring"] else "ring"


def _pof2_split(topo: Topology, cal: Calibration, n: int) -> tuple:
    """Native algorithms on a p that is no power of two: ranks 2i, 2i+1 (i < p - p2) first
    fold their buffers into one (a message of n, a reduction) and finally get the result
    back (a message of n). Returns (p2, seconds of those two extra rounds). The rounds in
    between are modelled on ranks 0 .. p2-1 (MPICH keeps the odd ones of the folded pairs)."""
    p = topo.size
    p2 = _pof2(p)
    if p2 == p:
        return p, 0.0
    return p2, 2 * _step(_pattern(topo, "fold"), cal, n, native=True) + cal.t_native_add(n)


def _native_rd(n: int, topo: Topology, cal: Calibration) -> float:
    """MPI's recursive doubling (MPICH's choice for small buffers): the call (alpha_native),
    then round k = 0 .. log2(p) - 1: rank r exchanges the whole buffer with r xor 2^k and
    adds it (a native message, :func:`_step`, and MPI's own addition of n,
    :meth:`Calibration.t_native_add`); non-powers of two pay
    two more rounds (:func:`_pof2_split`)."""
    if topo.size == 1:
        return cal.alpha_native
    p2, t = _pof2_split(topo, cal, n)
    for k in range(p2.bit_length() - 1):
        t += _step(_pattern(topo, "xor", k), cal, n, native=True) + cal.t_native_add(n)
    return cal.alpha_native + t


def _native_rsag(n: int, topo: Topology, cal: Calibration) -> float:
    """Rabenseifner (MPICH's choice for large buffers), after the call (alpha_native):
    1. reduce-scatter by recursive halving: round k = 0 .. log2(p) - 1 exchanges n / 2^(k+1)
       bytes with r xor 2^k and adds them (MPI's own addition);
    2. allgather by recursive doubling: the same rounds in reverse order, no addition.
    2 log2(p) rounds, 2(p-1)/p n bytes sent per rank; non-powers of two as in _native_rd."""
    if topo.size == 1:
        return cal.alpha_native
    p2, t = _pof2_split(topo, cal, n)
    for k in range(p2.bit_length() - 1):
        part = n / (2 << k)
        t += 2 * _step(_pattern(topo, "xor", k), cal, part, native=True) + cal.t_native_add(part)
    return cal.alpha_native + t


def predict(algo: str, nbytes: int, topo: Topology, cal: Calibration = DEFAULTS, *,
            shm_segment: int = SHM_SEGMENT, window: int = SHM_CAPACITY, small: int = SHM_SMALL,
            check: bool = False, across: str | None = None) -> float:
    """Predicted seconds of one allreduce of ``nbytes`` with ``algo`` (one of :data:`ALGOS`;
    hpcdp's own include alpha_call). ``shm_segment``: shm's segment (``HPCDP_SHM_SEGMENT``);
    ``window``: the node window's half (``HPCDP_SHM_BYTES``), two_level's segment and the
    largest of shm's; ``small``: the size up to which shm's one-round variant may be taken;
    ``check``: hpcdp's call makes its argument check (the default of ``hpcdp.allreduce``;
    DDP's buckets skip it), which adds alpha_check to the ring and two_level (shm carries the
    check in its own flag round); ``across``: two_level's stage across nodes (one of
    :data:`ACROSS`; default: the fastest per segment, as ``HPCDP_ACROSS=auto``)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, not {nbytes}")
    if check and algo in ("ring", "two_level") and topo.size > 1:
        return cal.alpha_check + predict(algo, nbytes, topo, cal, shm_segment=shm_segment,
                                         window=window, small=small, across=across)
    if algo == "ring":
        return _ring(nbytes, topo, cal)
    if algo == "shm" and topo.nodes != 1:
        raise ValueError(f"algo 'shm' needs every rank on one node, this topology has "
                         f"{topo.nodes} nodes (use 'two_level' or 'ring')")
    if algo == "shm" or (algo == "two_level" and topo.nodes == 1):  # (one node: one level)
        return _shm(nbytes, topo.size, cal, min(shm_segment, window), small)
    if algo == "two_level":
        return _two_level(nbytes, topo, cal, window, small, across)
    if algo == "native_rd":
        return _native_rd(nbytes, topo, cal)
    if algo == "native_rsag":
        return _native_rsag(nbytes, topo, cal)
    if algo == "native":
        return min(_native_rd(nbytes, topo, cal), _native_rsag(nbytes, topo, cal))
    raise ValueError(f"unknown algorithm {algo!r} (known: {', '.join(ALGOS)})")


def applies(algo: str, topo: Topology) -> bool:
    """Whether :func:`choose` considers ``algo``: shm on one node only, two_level on more."""
    if algo == "shm":
        return topo.nodes == 1
    if algo == "two_level":
        return topo.nodes > 1
    return algo in ALGOS


def choose(nbytes: int, topo: Topology, cal: Calibration = DEFAULTS,
           available=HPCDP_ALGOS, **sizes) -> str:
    """The algorithm of ``available`` (that applies to ``topo``) with the lowest predicted
    time; ties go to the earlier one in ``available``. ``sizes``: :func:`predict`'s
    ``shm_segment`` and ``window``."""
    cands = [a for a in available if applies(a, topo)]
    if not cands:
        raise ValueError(f"none of {list(available)} applies to {topo.nodes} node(s)")
    return min(cands, key=lambda a: (predict(a, nbytes, topo, cal, **sizes), cands.index(a)))


def link_bytes(algo: str, nbytes: int, topo: Topology, across: str = "ring") -> float:
    """Bytes through the busiest node link, each direction, in one allreduce: the flat ring
    sends 2(p-1)/p n times the number of its edges that leave the node (block placement: one,
    cyclic: every rank's); two_level's Lmin stages together, by ``across`` (N nodes, N2 the
    largest power of two <= N): the ring 2(N-1)/N n, halving 2(N2-1)/N2 n, doubling
    log2(N2) n, and where N != N2 the nodes that fold a partner in send n more. 0 on one node."""
    if topo.nodes == 1 or nbytes == 0:
        return 0.0
    if algo == "ring":
        p = topo.size
        return 2 * (p - 1) * _pattern(topo, "ring")[1] * nbytes / p
    if algo != "two_level":
        raise ValueError(f"link_bytes knows 'ring' and 'two_level', not {algo!r}")
    N = topo.nodes
    if across == "ring":
        return 2 * (N - 1) * nbytes / N
    n2 = _pof2(N)
    if across == "halving":
        stage = 2 * (n2 - 1) * nbytes / n2
    elif across == "doubling":
        stage = (n2.bit_length() - 1) * nbytes
    else:
        raise ValueError(f"unknown stage across nodes {across!r} (known: {', '.join(ACROSS)})")
    return stage + (nbytes if N != n2 else 0.0)


def ddp_step(params_bytes: int, bucket_bytes: int, backward_s: float, forward_s: float,
             algo: str, topo: Topology, cal: Calibration = DEFAULTS) -> dict:
    """A DDP training step: gradients fill buckets of ``bucket_bytes`` (the last one holds the
    remainder) at an even rate over backward, the last one at its end;
    1. bucket i's allreduce starts when it is ready and bucket i-1's has finished;
    2. step = forward + max(end of backward, end of the last allreduce).
    ``algo="auto"`` takes :func:`choose`'s pick per bucket. Returns ``step_s``, ``comm_s``
    (all allreduces, overlapped or not) and ``exposed_s`` (communication after backward)."""
    if params_bytes <= 0 or bucket_bytes <= 0:
        raise ValueError("params_bytes and bucket_bytes must be > 0")
    full, rest = divmod(params_bytes, bucket_bytes)
    sizes = [bucket_bytes] * full + ([rest] if rest else [])
    end = comm = done = 0.0
    for size in sizes:
        done += size
        ready = backward_s * done / params_bytes
        t = predict(choose(size, topo, cal) if algo == "auto" else algo, size, topo, cal)
        end = max(end, ready) + t
        comm += t
    exposed = max(0.0, end - backward_s)
    return {"step_s": forward_s + backward_s + exposed, "comm_s": comm, "exposed_s": exposed}
