#!/usr/bin/env bash
# Installs Debian's chromium for the test that opens the built documentation site in a
# real headless browser (tests/docs/test_site.py). Safe to re-run. Skips, saying why,
# where it cannot install: not root, no apt-get, no chromium package, or SKIP_CHROMIUM=1
# (the browser test is then skipped with the reason).
set -euo pipefail

log() { printf '\n==> %s\n' "$*"; }

for exe in chromium chromium-browser google-chrome; do
  if command -v "$exe" >/dev/null; then
    log "$exe already installed"
    exit 0
  fi
done
if [ "${SKIP_CHROMIUM:-0}" = "1" ]; then
  log "SKIP_CHROMIUM=1: not installing chromium (the browser test is skipped)"
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null; then
  log "not root with apt-get: not installing chromium (the browser test is skipped)"
  exit 0
fi

log "installing chromium from Debian's packages"
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || log "apt-get update failed: trying the package lists already here"
if ! apt-get install -y -qq --no-install-recommends chromium >/dev/null; then
  log "apt-get could not install chromium (the browser test is skipped)"
  exit 0
fi
log "$(chromium --version 2>/dev/null || echo chromium) installed in $(($(date +%s) - start)) s"
