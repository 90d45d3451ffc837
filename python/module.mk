# python/: the Python client package (python/epd, numpy only). `make install` installs it with
# pip, offline (no index, no build isolation: Debian's python3-setuptools builds it), for the
# python3 that imports numpy (PYTHON=... picks another), into that python's site directory under
# $(PREFIX) (Debian: $(PREFIX)/lib/python3.X/dist-packages), below $(DESTDIR) when set.
PYTHON ?= $(shell for p in python3 /usr/bin/python3; do \
    $$p -c 'import numpy' 2>/dev/null && command -v $$p && break; done)
# pip's --prefix lands in PREFIX/local/... with Debian's python, so the site directory is asked
# for and given as --target.
PY_SITE = $(shell $(PYTHON) -c 'import site, sysconfig; \
    d = [p for p in site.getsitepackages() if p.startswith("$(PREFIX)/")]; \
    print(d[0] if d else sysconfig.get_path("purelib", "posix_prefix", \
    vars={"base": "$(PREFIX)", "platbase": "$(PREFIX)"}))')
# Debian 12's pip refuses to touch the system python without --break-system-packages (PEP 668);
# older pips do not know the flag. numpy is the python's own (checked when PYTHON is picked).
PIP_BREAK = $(if $(shell $(PYTHON) -m pip install --help 2>/dev/null | \
    grep -e --break-system-packages),--break-system-packages)
PIP_INSTALL = $(PYTHON) -m pip install --no-index --no-build-isolation --no-deps --upgrade \
              --disable-pip-version-check --root-user-action=ignore $(PIP_BREAK) \
              --target $(DESTDIR)$(PY_SITE)
PY_NONE = echo "make install: no python3 with numpy: the Python package is not installed" >&2
INSTALL_EXTRA += $(if $(PYTHON),$(PIP_INSTALL) ./python,$(PY_NONE)) ;
