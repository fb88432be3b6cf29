#!/usr/bin/env bash
# Install what is needed, then run the whole test suite (real PostgreSQL, real QEMU, no skips).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export MOORAGE_TEST_STRICT=1   # a missing service fails the suite instead of skipping
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
# pytest's "no tests collected" (5) must not pass as green.
exit $rc
