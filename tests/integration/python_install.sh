#!/usr/bin/env bash
# The Python package installs offline the way the README says (pip, no index, no build
# isolation: Debian's python3-setuptools builds it) and imports from outside the checkout with
# every module, its version equal to the tree's.
set -u
cd "$(dirname "$0")/../.."
skip() { echo "SKIP: $*"; exit 77; }
source tests/python/python_lib.bash
"$PY" -c 'import setuptools' 2>/dev/null || skip "no setuptools for $PY (python3-setuptools)"
"$PY" -m pip --version >/dev/null 2>&1 || skip "no pip for $PY (python3-pip)"
TMP=$(mktemp -d /tmp/epd-pyinst.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip install --no-index --no-build-isolation --no-deps --disable-pip-version-check \
    --root-user-action=ignore --target "$TMP/site" ./python || { echo "FAIL: pip install"; exit 1; }
cd "$TMP" && PYTHONPATH=$TMP/site "$PY" - <<'PY' || { echo "FAIL: import after install"; exit 1; }
import epd, epd.aio, epd.client, epd.group, epd.regions, epd.frame, epd.bf16, epd.errors
assert epd.__file__.startswith(__import__("os").getcwd()), epd.__file__
print("PASS: installed epd", epd.__version__, "imports from", epd.__file__)
PY
