#!/usr/bin/env bash
# Install what is needed, then run moorage with the embedded defaults (SQLite, local sandboxes, local model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/moorage up "$@"
