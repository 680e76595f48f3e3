#!/usr/bin/env bash
# Idempotent set-up for the benches (bench/repro.py) on Debian 12 as root: rclone, the peer the
# reproduction measures against (Debian's package, 1.60), then the project's venv with the dev
# and bench extras (torch, matplotlib) through scripts/setup.sh.
# Usage: scripts/setup-bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v rclone >/dev/null 2>&1; then
    echo "setup-bench: installing rclone"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rclone </dev/null
fi
scripts/setup.sh dev,bench
echo "setup-bench: $(rclone version | head -n 1); $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
