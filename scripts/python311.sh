# Sourced by the setup scripts: sets PY to a Python 3.11 interpreter ($PYTHON if given), or exits with a message.
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: kvtier needs Python 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
