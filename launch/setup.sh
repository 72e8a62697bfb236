#!/usr/bin/env bash
# Sets up tfdist on a fresh machine: a virtual environment in .venv with tfdist and its
# dependencies; with --horovod also Horovod built against that TensorFlow; with --dev the test
# and lint tools and, as root with apt, the test services (iproute2, SLURM and munge, Chromium).
# Idempotent: run it again and it only does what is missing.
#
# Usage: launch/setup.sh [--horovod] [--dev]      (from the repository root)
# Env:   PYTHON (default python3.11, else python3), VENV (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

with_horovod=0
extras="tools"  # the tfdist command and the benchmarks
for arg in "$@"; do
  case "$arg" in
    --horovod) with_horovod=1; extras="${extras:+$extras,}horovod" ;;
    --dev) extras="${extras:+$extras,}dev" ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "setup: unknown option '$arg' (use --horovod and/or --dev)" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${VENV:-.venv}
"$PYTHON" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] <= (3, 12)))' \
  || { echo "setup: tfdist needs Python 3.10-3.12 (TensorFlow 2.21); $PYTHON is $("$PYTHON" -V)" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $("$PYTHON" -V)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip setuptools wheel
fi
echo "setup: installing tfdist${extras:+ [$extras]} (TensorFlow 2.21, Keras 3.15, ...)"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"

# The test services: iproute2 (ip, tc) for the emulated cluster, SLURM (slurm-wlm, munge) for the
# scheduler tests, a headless Chromium to lay out the docs site; installed where we may (root with
# apt), else those tests are skipped, saying why.
if [[ ",$extras," == *",dev,"* ]] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  wanted=()
  command -v tc >/dev/null || wanted+=(iproute2)
  command -v slurmctld >/dev/null || wanted+=(slurm-wlm)
  command -v munged >/dev/null || wanted+=(munge)
  command -v chromium >/dev/null || wanted+=(chromium)
  if [ ${#wanted[@]} -gt 0 ]; then
    echo "setup: installing ${wanted[*]} (the emulated cluster, SLURM and docs site tests)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        "${wanted[@]}" >/dev/null) \
      || echo "setup: could not install ${wanted[*]}; the tests that need them will be skipped" >&2
  fi
fi

if [ "$with_horovod" = 1 ]; then
  bash launch/build_horovod.sh "$VENV/bin/python"
fi
echo "setup: done ($("$VENV/bin/python" -c 'import tensorflow as tf, keras; print(f"tensorflow {tf.__version__}, keras {keras.__version__}")' 2>/dev/null))"
