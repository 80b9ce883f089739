# Sourced by ci/test.sh and ci/demo.sh: puts nox into a private virtualenv and exports
#   ROOT     the repository root
#   NOX      the nox executable to use
# Needs only python3 (>= 3.10, with its venv module or pip) on PATH.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NOX_VERSION=2026.10.20
CI_VENV=${SPYRECCL_CI_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/spyreccl-ci/venv}
PYTHON=${PYTHON:-python3}

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "ci: $PYTHON not found on PATH; install Python >= 3.10" >&2
  exit 2
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "ci: $("$PYTHON" --version 2>&1) is too old; spyreccl needs Python >= 3.10" >&2
  exit 2
fi
# Resolve wrappers (pyenv shims re-resolve, and can fail transiently, on every call).
PYTHON=$("$PYTHON" -c 'import sys; print(sys.executable)')

_nox_version() {
  "$CI_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("nox"))' 2>/dev/null || true
}

_make_venv() {
  rm -rf "$CI_VENV"
  mkdir -p "$(dirname "$CI_VENV")"
  if ! "$PYTHON" -m venv "$CI_VENV"; then
    # Debian's python3 without python3-venv: fall back to virtualenv from pip.
    echo "ci: '$PYTHON -m venv' failed; trying virtualenv" >&2
    rm -rf "$CI_VENV"
    "$PYTHON" -m pip install --user --quiet virtualenv
    "$PYTHON" -m virtualenv "$CI_VENV"
  fi
  "$CI_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "nox==$NOX_VERSION"
}

if [ "$(_nox_version)" != "$NOX_VERSION" ]; then
  echo "ci: installing nox $NOX_VERSION into $CI_VENV"
  _make_venv
  # A half-built venv (interrupted run, full disk) must not be trusted: check, retry once.
  if [ "$(_nox_version)" != "$NOX_VERSION" ]; then
    echo "ci: nox is not importable from $CI_VENV; rebuilding it" >&2
    _make_venv
  fi
  if [ "$(_nox_version)" != "$NOX_VERSION" ]; then
    echo "ci: could not install nox $NOX_VERSION into $CI_VENV" >&2
    exit 2
  fi
fi

NOX="$CI_VENV/bin/nox"
export NO_COLOR=1 PY_COLORS=0
cd "$ROOT"
