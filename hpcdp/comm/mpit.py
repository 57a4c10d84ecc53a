"""Control variables of the loaded MPI library, read through the MPI tool interface (MPI_T):
what hpcdp asks the MPI about its own behaviour (does it yield when idle, how does its tcp
transport send large messages) without a launcher option or a parse of ``ompi_info``."""
from __future__ import annotations

import ctypes

__all__ = ["first_cvar", "open_mpi_tcp_put"]

#: Open MPI's btl flag that makes large messages an emulated RDMA put (``btl_tcp_flags``)
_PUT = 0x2
#: what jobs/multinode.sbatch sets instead: the default flags less put and hetero-rdma
TCP_FLAGS = "send,inplace,need-ack,need-csum"


def first_cvar(libmpi: str | None, names) -> tuple[str, int] | None:
    """``(name, value)`` of the first of the integer control variables ``names`` that the
    MPI library at path ``libmpi`` has, read through the MPI tool interface (MPI_T);
    ``None`` where it has none of them or MPI_T cannot be used."""
    if libmpi is None:
        return None
    try:
        lib = ctypes.CDLL(libmpi)
        init, get_index = lib.MPI_T_init_thread, lib.MPI_T_cvar_get_index
        alloc, read = lib.MPI_T_cvar_handle_alloc, lib.MPI_T_cvar_read
        free, fini = lib.MPI_T_cvar_handle_free, lib.MPI_T_finalize
    except (OSError, AttributeError):
        return None
    # The MPI_T session asks for the level MPI already runs at: Open MPI (5.0.x) writes the
    # level given here over the process's, and MPI_THREAD_SINGLE there turns its locking
    # off under hpcdp's progress thread (MPI_Query_thread then says SINGLE too).
    level, flag = ctypes.c_int(0), ctypes.c_int(0)
    if lib.MPI_Initialized(ctypes.byref(flag)) == 0 and flag.value:
        lib.MPI_Query_thread(ctypes.byref(level))
    provided = ctypes.c_int()
    if init(level, ctypes.byref(provided)) != 0:
        return None
    try:
        for name in names:
            index = ctypes.c_int(-1)
            if get_index(name.encode(), ctypes.byref(index)) != 0:
                continue
            handle, count = ctypes.c_void_p(), ctypes.c_int()
            if alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) != 0:
                return None
            try:
                value = ctypes.c_int64(0)  # a bool or an int: either fits, zero-extended
                if count.value != 1 or read(handle, ctypes.byref(value)) != 0:
                    return None
                return name, ctypes.c_int32(value.value & 0xFFFFFFFF).value
            finally:
                free(ctypes.byref(handle))
        return None
    finally:
        fini()


def open_mpi_tcp_put(vendor: str, libmpi: str | None) -> tuple[bool | None, str]:
    """``(put, how)``: whether Open MPI's tcp btl sends large messages as an emulated RDMA
    put, which on a loaded Ethernet link makes each message above 64 KiB wait for its
    receiver's request behind bulk data (docs/sharp-bits.md); ``None`` for other MPIs or
    where MPI_T cannot tell."""
    if vendor != "Open MPI":
        return None, f"not Open MPI ({vendor})"
    found = first_cvar(libmpi, ("btl_tcp_flags",))
    if found is None:
        return None, "btl_tcp_flags not readable through MPI_T (no tcp btl?)"
    flags = found[1]
    if flags & _PUT:
        return True, (f"btl_tcp_flags={flags:#x} has put: where nodes talk over Ethernet through the tcp "
                      f"btl, set OMPI_MCA_btl_tcp_flags={TCP_FLAGS} (docs/sharp-bits.md)")
    return False, f"btl_tcp_flags={flags:#x}: large messages by send/recv"
