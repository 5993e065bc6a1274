#!/usr/bin/env bash
# The offline GPU check: polytrain's GPU paths on a bare CUDA machine (docs/gpu-check.md).
#
# Where the package registries are (a checkout with `make setup` done):
#   scripts/gpu_check.sh prepare [--out gpu_bundle]      the bundle: polytrain, DeepSpeed, fairscale
#                                                        and what the node lacks (<= 60 MiB, manifest)
#   scripts/gpu_check.sh ray-prepare [--out ray_bundle]  the optional second bundle: Ray's wheel in
#                                                        parts of <= 60 MiB, and Ray's missing needs
# On the GPU node (no network):
#   gpu_check.sh run [--bundle DIR] [--site DIR] [run options]
#                                                        checks the bundle, installs it into a
#                                                        temporary folder (or --site, kept), runs
#                                                        the check (~6-8 min on one H100)
#   gpu_check.sh ray-run --bundle DIR --ray DIR [--site DIR] [pytest options]
#                                                        joins Ray's parts, installs both bundles,
#                                                        runs tests/gpu (a checkout: the tests are
#                                                        not in the wheel)
# Anywhere:
#   scripts/gpu_check.sh results REPORT.json [--results-md benchmarks/RESULTS.md]
#                                                        a dated section at the end of RESULTS.md
# Run options (python -m polytrain.tools.gpu_check run --help): --device cpu|cuda, --out DIR,
# --only ddp,fsdp2,..., --precisions bf16,fp16, --no-compile, --budget-s S, --peak-tflops X.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
else PY=python3
fi

log() { printf '==> %s\n' "$*" >&2; }
# Temporary folders to delete at exit (a global: the trap runs after the functions return).
CLEANUP=()
trap 'if [ ${#CLEANUP[@]} -gt 0 ]; then rm -rf "${CLEANUP[@]}"; fi' EXIT
die() { printf 'gpu_check.sh: %s\n' "$*" >&2; exit 2; }

# The bundle folder: --bundle DIR, else the folder this script sits in when it holds a
# bundle (the script travels inside it), else ./gpu_bundle.
default_bundle() {
  if [ -f "$HERE/manifest.json" ]; then echo "$HERE"; else echo "$PWD/gpu_bundle"; fi
}

# Check every file of a bundle against its SHA256SUMS (sha256sum -c), then install its wheels
# offline into $2 (a folder put first on PYTHONPATH later): nothing outside $2 changes.
install_bundle() {
  local bundle="$1" target="$2" began=$SECONDS
  [ -f "$bundle/SHA256SUMS" ] || die "$bundle has no SHA256SUMS: not a bundle (run prepare)"
  (cd "$bundle" && sha256sum -c --quiet SHA256SUMS) || die "$bundle: a file does not match SHA256SUMS"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --target "$target" "$bundle"/*.whl
  log "installed $(ls "$bundle"/*.whl | wc -l) wheels from $bundle into $target in $((SECONDS - began)) s"
}

cmd_prepare() {
  cd "$ROOT"
  PYTHONPATH="$ROOT" "$PY" -m polytrain.tools.gpu_check prepare "$@"
}

cmd_ray_prepare() {
  local out=ray_bundle
  if [ "${1:-}" = "--out" ]; then out="$2"; shift 2; fi
  cd "$ROOT"
  PYTHONPATH="$ROOT" "$PY" -m polytrain.tools.gpu_check prepare --ray --out "$out" "$@"
}

# The options of run and ray-run, into globals: BUNDLE, SITE, OUT, RAY, and ARGS (the rest,
# passed on). $1 names the options this command takes besides --bundle and --site.
parse_options() {
  local takes="$1"; shift
  BUNDLE="$(default_bundle)" SITE="" OUT="$PWD/gpu_check_out" RAY="" ARGS=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --bundle) BUNDLE="$2"; shift 2 ;;
      --site) SITE="$2"; shift 2 ;;  # install there and keep it (default: a temporary folder)
      --out|--ray)
        [[ " $takes " == *" $1 "* ]] || die "this command takes no $1"
        if [ "$1" = --out ]; then OUT="$2"; else RAY="$2"; fi
        shift 2 ;;
      *) ARGS+=("$1"); shift ;;
    esac
  done
  BUNDLE="$(cd "$BUNDLE" && pwd)"
}

# Install BUNDLE into SITE, or into a temporary folder deleted at exit (SITE names it then).
install_site() {
  if [ -n "$SITE" ]; then
    mkdir -p "$SITE"; SITE="$(cd "$SITE" && pwd)"
  else
    SITE="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")"
    CLEANUP+=("$SITE")
  fi
  install_bundle "$BUNDLE" "$SITE"
}

cmd_run() {
  parse_options "--out" "$@"
  mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
  install_site
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  # Away from any checkout: the bundle's polytrain is the one imported.
  cd "$OUT"
  "$PY" -c 'import polytrain, sys; print("polytrain", polytrain.__version__, "from", polytrain.__file__, file=sys.stderr)'
  "$PY" -m polytrain.tools.gpu_check run --out "$OUT" "${ARGS[@]}"
}

cmd_ray_run() {
  parse_options "--ray" "$@"
  [ -n "$RAY" ] || die "ray-run needs --ray DIR (the folder with Ray's parts: ray-prepare)"
  [ -f "$ROOT/tests/gpu/test_gpu.py" ] || die "ray-run runs tests/gpu of a checkout; $ROOT has none"
  install_site
  local began=$SECONDS wheels
  wheels="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_ray.XXXXXX")"
  CLEANUP+=("$wheels")
  (cd "$RAY" && sha256sum -c --quiet SHA256SUMS) || die "$RAY: a file does not match SHA256SUMS"
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -m polytrain.tools.gpu_check join "$RAY" --out "$wheels" >/dev/null
  cp "$RAY"/*.whl "$wheels"/
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --target "$SITE" "$wheels"/*.whl
  log "joined and installed Ray from $RAY in $((SECONDS - began)) s"
  # tests/conftest.py hands the driver's PYTHONPATH to Ray's workers (Ray lives in $SITE).
  cd "$ROOT"
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c 'import ray, sys; print("ray", ray.__version__, "from", ray.__file__, file=sys.stderr)'
  "$PY" -m pytest tests/gpu -q -rA -p no:cacheprovider "${ARGS[@]}"
}

cmd_results() {
  cd "$ROOT"
  PYTHONPATH="$ROOT" "$PY" -m polytrain.tools.gpu_check results "$@"
}

case "${1:-}" in
  prepare) shift; cmd_prepare "$@" ;;
  ray-prepare) shift; cmd_ray_prepare "$@" ;;
  run) shift; cmd_run "$@" ;;
  ray-run) shift; cmd_ray_run "$@" ;;
  results) shift; cmd_results "$@" ;;
  *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac
