#!/usr/bin/env bash
# Set everything up (idempotent), then run the whole test suite (real FUSE mounts, network namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
exec .venv/bin/python -m pytest "$@"
