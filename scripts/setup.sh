#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine as root: system packages and the project's venv.
# Usage: scripts/setup.sh [EXTRAS]   (EXTRAS defaults to "dev"; "dev,bench" adds torch and matplotlib)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
apt_packages=(fuse3 libfuse3-dev pkg-config iproute2 gcc python3-dev python3-venv systemd curl
              clang bpftool libbpf-dev)
missing=()
for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "setup: installing system packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" </dev/null
fi
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
stamp=".venv/.installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setup: installing neuralcache[$extras] into .venv"
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e ".[$extras]"
    touch "$stamp"
fi
