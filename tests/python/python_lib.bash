# Sourced by the Python client's test scripts: PY is a python3 that imports numpy (the first
# `python3` on PATH may be another installation than Debian's, which python3-numpy serves).
# PYTHON=/path/to/python3 picks one (e.g. the one torch is installed in).
PY=
for candidate in ${PYTHON:-} python3 /usr/bin/python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import numpy' 2>/dev/null; then
        PY=$(command -v "$candidate")
        break
    fi
done
[[ -n $PY ]] || skip "no python3 with numpy (scripts/deps.sh installs python3-numpy)"
