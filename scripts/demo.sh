#!/usr/bin/env bash
# Set everything up (idempotent), then run the demo: hub + spoke on loopback over generated data.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
exec .venv/bin/neuralcache demo "$@"
