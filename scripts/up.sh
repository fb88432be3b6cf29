#!/usr/bin/env bash
# Install what is needed, then run moorage with the embedded defaults (SQLite, local sandboxes, local model):
# it deploys examples/assistant, holds a short two-session conversation with it, and keeps serving.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/moorage up --demo examples/assistant "$@"
