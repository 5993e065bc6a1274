#!/usr/bin/env bash
# Builds horovod 0.28.1 from the PyPI sdist against the torch in the active
# environment, with gloo and without MPI, MXNet or TensorFlow.
#
# Why a wrapper: horovod 0.28.1 (its last release) forces -std=c++14 in its
# CMake files, and torch >= 2.1's headers need C++17. The wrapper below
# rewrites the standard flag on every compiler call; nothing else changes.
# Takes about 5 minutes on 2 cores. Re-running it is a no-op once horovod.torch
# imports. On failure it says why and how to retry; polytrain works without it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
if python -c "import horovod.torch" 2>/dev/null; then
  echo "horovod.torch already importable: nothing to do"
  exit 0
fi
command -v cmake >/dev/null || { echo "horovod needs cmake: apt-get install -y cmake (or pip install cmake)" >&2; exit 1; }
REAL_CXX=$(command -v "${CXX:-g++}") || { echo "horovod needs a C++ compiler (g++)" >&2; exit 1; }

WRAP_DIR=$(mktemp -d)
trap 'rm -rf "$WRAP_DIR"' EXIT
cat > "$WRAP_DIR/cxx17" <<WRAP
#!/usr/bin/env bash
args=()
for a in "\$@"; do
  case "\$a" in
    -std=c++11|-std=c++14|-std=gnu++11|-std=gnu++14) args+=("-std=c++17") ;;
    *) args+=("\$a") ;;
  esac
done
exec "$REAL_CXX" "\${args[@]}"
WRAP
chmod +x "$WRAP_DIR/cxx17"

echo "==> building horovod 0.28.1 (gloo, torch, C++17 wrapper around $REAL_CXX); about 5 minutes on 2 cores"
export CXX="$WRAP_DIR/cxx17"
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
       HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1
export MAKEFLAGS="-j$(nproc)"
# horovod's own setup needs these before the build starts (no build isolation).
# Plain horovod, not horovod[ray]: that extra pins google-api-core<2.9 (protobuf<5), which
# breaks TensorFlow; polytrain uses only horovod's gloo rendezvous, not horovod.ray.
python -m pip install -q --disable-pip-version-check cloudpickle psutil pyyaml packaging
if ! python -m pip install --disable-pip-version-check --no-build-isolation \
      -v "horovod==0.28.1" > "${HOROVOD_BUILD_LOG:-/tmp/horovod-build.log}" 2>&1; then
  echo "horovod build FAILED; the last lines of ${HOROVOD_BUILD_LOG:-/tmp/horovod-build.log}:" >&2
  tail -n 40 "${HOROVOD_BUILD_LOG:-/tmp/horovod-build.log}" >&2
  echo "Retry with: bash scripts/install_horovod.sh   (polytrain keeps working without the horovod backend)" >&2
  exit 1
fi
python -c "import horovod.torch as hvd; print('horovod gloo built:', hvd.gloo_built())"
