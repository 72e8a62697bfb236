#!/usr/bin/env bash
# Build Horovod 0.28.1 (Gloo, CPU) against the TensorFlow installed in the active Python.
#
# Horovod's last release does not build against TensorFlow 2.21 as shipped. Two changes make it build:
#   1. drop horovod/tensorflow/xla_mpi_ops.cc (optional XLA ops whose headers TF 2.21 moved);
#   2. add TF's bundled highwayhash and farmhash headers to the include path.
# The build uses --no-build-isolation so it compiles against *this* environment's TensorFlow.
#
# Usage: launch/build_horovod.sh [PYTHON]   (default: python on PATH)
# Env:   HOROVOD_GPU_OPERATIONS=NCCL etc. are passed through for GPU builds (see BUILD.md).
set -euo pipefail

PY=${1:-python}
VERSION=0.28.1

say() { printf '[build_horovod] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

"$PY" -c 'import tensorflow' 2>/dev/null \
  || die "TensorFlow is not importable with '$PY'. Install it first (pip install -e .)."

if "$PY" - <<'PY' 2>/dev/null
import horovod.tensorflow as hvd
hvd.init()
assert hvd.size() >= 1
PY
then
  say "a working Horovod is already importable with '$PY'; nothing to do."
  exit 0
fi

command -v cmake >/dev/null || die "cmake not found: install it (apt-get install cmake) and run again."
command -v g++ >/dev/null || die "g++ not found: install it (apt-get install g++) and run again."

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say "downloading the horovod==$VERSION source distribution"
"$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "horovod==$VERSION" \
  || die "could not download the horovod==$VERSION sdist from the package index."
tar -xzf "$work"/horovod-$VERSION.tar.gz -C "$work"
src="$work/horovod-$VERSION"

cml="$src/horovod/tensorflow/CMakeLists.txt"
grep -q 'xla_mpi_ops.cc' "$cml" || die "unexpected sdist layout: xla_mpi_ops.cc not in $cml"
sed -i '/xla_mpi_ops\.cc/d' "$cml"
say "patched: removed xla_mpi_ops.cc from the TensorFlow sources"

tf_inc=$("$PY" -c 'import tensorflow as tf; print(tf.sysconfig.get_include())')
for d in "$tf_inc/external/highwayhash" "$tf_inc/external/farmhash_archive/src"; do
  [ -d "$d" ] || die "expected TensorFlow header folder missing: $d"
done
export CXXFLAGS="${CXXFLAGS:-} -I$tf_inc/external/highwayhash -I$tf_inc/external/farmhash_archive/src"

export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_GLOO=1
export HOROVOD_WITHOUT_MPI=${HOROVOD_WITHOUT_MPI:-1}
export HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-GLOO}
export MAKEFLAGS="-j$(nproc)"

say "building horovod==$VERSION (takes about 5 minutes on 2 cores; log: $work/build.log)"
if ! "$PY" -m pip install --no-build-isolation --no-deps --no-cache-dir "$src" >"$work/build.log" 2>&1; then
  tail -n 60 "$work/build.log" >&2
  die "the Horovod build failed (last 60 lines above)."
fi
# horovod's runtime dependencies (its own pins are loose): cloudpickle, psutil, pyyaml, packaging.
"$PY" -m pip install --quiet cloudpickle psutil pyyaml packaging

"$PY" - <<'PY' || die "Horovod built but does not import or initialise."
import horovod.tensorflow as hvd
hvd.init()
print(f"[build_horovod] Horovod {__import__('horovod').__version__} works: gloo={hvd.gloo_built()}")
PY
