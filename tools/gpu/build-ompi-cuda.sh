#!/usr/bin/env bash
# Build a CUDA-aware Open MPI to test hpcdp's CUDA-aware transport where the machine has
# none (no CUDA-aware MPI is on PyPI). Needs no GPU and no CUDA toolkit: Open MPI's CUDA
# support compiles against cuda.h (from PyPI's nvidia-cuda-runtime-cu12 wheel) and loads
# the driver's libcuda.so.1 at run time, so a stub library satisfies the link. The build
# has no UCX: device memory moves through Open MPI's own copies (see docs/cuda.md for what
# that costs). About 15 minutes on 2 cores.
#
#   PREFIX   install folder (default /opt/ompi-cuda); the build is not relocatable: on a
#            GPU machine unpack it to the same path
#   PACK     also write this tarball of the install (no docs or man pages), e.g. for
#            a machine without network access
#   JOBS     make -j (default: the number of cores)
#
# Then, with mpi4py's binary wheel (it carries the Open MPI ABI beside MPICH's):
#   export PATH=$PREFIX/bin:$PATH LD_LIBRARY_PATH=$PREFIX/lib:$LD_LIBRARY_PATH \
#          MPI4PY_MPIABI=openmpi MPI4PY_LIBMPI=$PREFIX/lib/libmpi.so.40
#   bash tools/gpu/check.sh          # the CUDA-aware test variants run instead of skipping
set -euo pipefail
PREFIX=${PREFIX:-/opt/ompi-cuda}
JOBS=${JOBS:-$(nproc)}
VERSION=5.0.7
SHA256=97f10c04e9b9a1771db3fd005009e4c07afa3ce739f940e41eb0fc7397cb9473
WORK=$(mktemp -d /tmp/ompi-cuda.XXXX)
cd "$WORK"

echo "== sources: Open MPI $VERSION (Debian's upstream tarball), cuda.h (PyPI)"
curl -fsSO "http://deb.debian.org/debian/pool/main/o/openmpi/openmpi_$VERSION.orig.tar.xz"
echo "$SHA256  openmpi_$VERSION.orig.tar.xz" | sha256sum -c -
tar xf "openmpi_$VERSION.orig.tar.xz"
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
  -d wheels "nvidia-cuda-runtime-cu12==12.8.*"
unzip -q wheels/*.whl 'nvidia/cuda_runtime/include/*' -d wheel
mv wheel/nvidia/cuda_runtime cuda  # (cuda/include/cuda.h)
mkdir stub

echo "== a stub libcuda.so (soname libcuda.so.1): every driver function cuda.h declares"
gcc -E -P cuda/include/cuda.h | tr '\n' ' ' | grep -oE 'CUresult +(CUDAAPI +)?cu[A-Za-z0-9_]+ *\(' \
  | grep -oE 'cu[A-Za-z0-9_]+' > names.txt
grep -oE '#define cu[A-Za-z0-9_]+ ' cuda/include/cuda.h | awk '{print $2}' >> names.txt
{ cat names.txt; sed -E 's/_v[0-9]+$//' names.txt; } | sort -u \
  | awk '{print "int " $1 "(void) { return 999; }"}' > stub.c
gcc -shared -fPIC -o stub/libcuda.so -Wl,-soname,libcuda.so.1 stub.c

echo "== configure, build, install into $PREFIX"
cd "openmpi-$VERSION"
./configure --prefix="$PREFIX" --with-cuda="$WORK/cuda" --with-cuda-libdir="$WORK/stub" \
  --disable-mpi-fortran --disable-oshmem --without-ucx --without-ofi --disable-io-romio \
  --disable-static --with-pmix=internal --with-prrte=internal \
  --with-hwloc=internal --with-libevent=internal > "$WORK/configure.log" 2>&1 \
  || { echo "configure failed: see $WORK/configure.log" >&2; exit 1; }
grep -A2 "^Accelerators" "$WORK/configure.log" | grep -q "CUDA support: yes" \
  || { echo "configure found no CUDA support: see $WORK/configure.log" >&2; exit 1; }
make -j "$JOBS" > "$WORK/make.log" 2>&1 || { echo "make failed: see $WORK/make.log" >&2; exit 1; }
make install > "$WORK/install.log" 2>&1
# (it loads where the driver's libcuda.so.1 is: ompi_info there lists "accelerator: cuda")
ls "$PREFIX/lib/openmpi/mca_accelerator_cuda.so"
if [ -n "${PACK:-}" ]; then
  tar -C / --exclude="${PREFIX#/}/share/doc" --exclude="${PREFIX#/}/share/man" --exclude='*.la' \
    -czf "$PACK" "${PREFIX#/}"
  echo "packed: $PACK"
fi
rm -rf "$WORK"
echo "built: $PREFIX"
