#!/usr/bin/env bash
# Installs what building and testing flashport needs on a fresh Debian machine (idempotent).
# Usage: scripts/deps.sh [--python]    (--python adds the Python test dependencies)
set -euo pipefail
need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi
if [ "${1:-}" = "--python" ]; then
  python3 -m pip install -q --disable-pip-version-check -r "$(dirname "$0")/../python/requirements-test.txt"
fi
