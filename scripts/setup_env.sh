#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 and install the project (with its test extras) on the oldest
# jax pyproject.toml takes. `--jax-newest`: .venv-jax-newest instead, with the newest jax it takes
# and only what the tests need (`make test-jax-newest`; pallas_kernels/common/compat.py).
# Re-runs are cheap: it reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."

# The jax range: "jax>=OLDEST,<=NEWEST" in pyproject.toml.
RANGE="$(grep -oE '"jax>=[0-9.]+,<=[0-9.]+"' pyproject.toml | tr -d '"')"
OLDEST="${RANGE#jax>=}"; OLDEST="${OLDEST%%,*}"
NEWEST="${RANGE##*<=}"
if [ -z "$RANGE" ] || [ -z "$OLDEST" ] || [ -z "$NEWEST" ]; then
  echo "error: pyproject.toml has no \"jax>=OLDEST,<=NEWEST\" dependency" >&2
  exit 1
fi

case "${1:-}" in
  "") VENV=.venv; INSTALL=(-e ".[test]" "jax==$OLDEST") ;;
  --jax-newest) VENV=.venv-jax-newest; INSTALL=(-e . "jax==$NEWEST" pytest pytest-xdist) ;;
  *) echo "usage: $0 [--jax-newest]" >&2; exit 2 ;;
esac
STAMP="$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)"

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ]; then
  exit 0
fi

is_ok() {  # is_ok PYTHON: true when it runs and is >= 3.12
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 python3.13 python3.14 python3 python; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && is_ok "$(command -v "$c")"; then
      command -v "$c"; return 0
    fi
  done
  # pyenv keeps versions that are not on PATH; take the oldest >= 3.12 (3.12 is what the GPU machine runs).
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  if command -v pyenv >/dev/null 2>&1; then root="$(pyenv root)"; fi
  if [ -d "$root/versions" ]; then
    for c in $(ls -1 "$root/versions" | grep -E '^3\.[0-9]+(\.[0-9]+)?$' | sort -t. -k1,1n -k2,2n -k3,3n); do
      if is_ok "$root/versions/$c/bin/python"; then
        echo "$root/versions/$c/bin/python"; return 0
      fi
    done
  fi
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! is_ok "$VENV/bin/python"; then
  if ! PY="$(find_python)"; then
    echo "error: gdp-jax needs Python >= 3.12 (jax >= 0.11 requires it)." >&2
    echo "       None was found on PATH or under pyenv (\$PYENV_ROOT/versions)." >&2
    echo "       Install one (for example 'pyenv install 3.12'), or set PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "setting up $VENV with $PY ($("$PY" --version 2>&1))"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi

"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q "${INSTALL[@]}"
rm -f "$VENV"/.installed-*
touch "$STAMP"
echo "installed gdp-jax into $VENV (jax $("$VENV/bin/python" -c 'import jax; print(jax.__version__)'))"
