"""Constants shared by the compressors and every kernel backend (a leaf module)."""

#: ``fmt`` codes of the half-precision kernels.
FMT_FP16 = 0
FMT_BF16 = 1

#: Elements per partial sum of the 1-bit sum of squares (``onebit_sumsq``); fixed, so
#: that the result depends neither on the number of threads nor on the backend.
SUMSQ_BLOCK = 4096

#: Bytes of the float32 scale at the start of every 1-bit frame.
SCALE_NBYTES = 4
