# systemd/: the units, the launcher, the example config, tmpfiles and sysusers, installed under
# PREFIX (systemd reads PREFIX/lib/systemd/system, .../tmpfiles.d and .../sysusers.d for /usr and
# /usr/local); the config goes to SYSCONFDIR/epd/epd.yaml and SYSCONFDIR/default/epd only when
# they do not exist yet (an operator's file is never overwritten). The launcher's default MPIRUN
# is the mpirun of the MPI this build links (MPI_HOME), found now.
SYSCONFDIR ?= /etc
MPIRUN_PATH = $(shell command -v $(MPIRUN) 2>/dev/null || echo $(MPIRUN))
INSTALL_EXTRA += install -d $(DESTDIR)$(PREFIX)/lib/systemd/system $(DESTDIR)$(PREFIX)/lib/tmpfiles.d \
    $(DESTDIR)$(PREFIX)/lib/sysusers.d $(DESTDIR)$(PREFIX)/share/epd $(DESTDIR)$(PREFIX)/libexec/epd \
    $(DESTDIR)$(PREFIX)/share/man/man1 $(DESTDIR)$(PREFIX)/share/man/man8 \
    $(DESTDIR)$(PREFIX)/share/doc/epd $(DESTDIR)$(SYSCONFDIR)/epd $(DESTDIR)$(SYSCONFDIR)/default ; \
    for u in epd.service epd@.service; do \
        sed -e 's|/usr/local/libexec/epd/|$(PREFIX)/libexec/epd/|' \
            -e 's|/usr/local/share/doc/epd/|$(PREFIX)/share/doc/epd/|' \
            -e 's|/etc/epd/|$(SYSCONFDIR)/epd/|g' -e 's|/etc/default/epd|$(SYSCONFDIR)/default/epd|' \
            systemd/$$u >$(DESTDIR)$(PREFIX)/lib/systemd/system/$$u ; \
        chmod 0644 $(DESTDIR)$(PREFIX)/lib/systemd/system/$$u ; \
    done ; \
    sed -e 's|@MPIRUN@|$(MPIRUN_PATH)|' -e 's|@EPD@|$(PREFIX)/bin/epd|' \
        -e 's|/etc/default/epd|$(SYSCONFDIR)/default/epd|g' systemd/epd-launch \
        >$(DESTDIR)$(PREFIX)/libexec/epd/epd-launch ; \
    chmod 0755 $(DESTDIR)$(PREFIX)/libexec/epd/epd-launch ; \
    install -m 0644 systemd/epd.tmpfiles.conf $(DESTDIR)$(PREFIX)/lib/tmpfiles.d/epd.conf ; \
    install -m 0644 systemd/epd.sysusers.conf $(DESTDIR)$(PREFIX)/lib/sysusers.d/epd.conf ; \
    install -m 0644 systemd/epd.yaml $(DESTDIR)$(PREFIX)/share/epd/epd.yaml.example ; \
    install -m 0644 systemd/epd.default $(DESTDIR)$(PREFIX)/share/epd/epd.default.example ; \
    if [ -e $(DESTDIR)$(SYSCONFDIR)/epd/epd.yaml ]; then \
        echo "kept $(DESTDIR)$(SYSCONFDIR)/epd/epd.yaml (the new example: $(PREFIX)/share/epd/epd.yaml.example)"; \
    else install -m 0644 systemd/epd.yaml $(DESTDIR)$(SYSCONFDIR)/epd/epd.yaml ; fi ; \
    if [ -e $(DESTDIR)$(SYSCONFDIR)/default/epd ]; then \
        echo "kept $(DESTDIR)$(SYSCONFDIR)/default/epd"; \
    else install -m 0644 systemd/epd.default $(DESTDIR)$(SYSCONFDIR)/default/epd ; fi ; \
    install -m 0644 $(BUILD)/man/epd.8 $(DESTDIR)$(PREFIX)/share/man/man8/epd.8 ; \
    install -m 0644 $(BUILD)/man/epctl.1 $(DESTDIR)$(PREFIX)/share/man/man1/epctl.1 ; \
    install -m 0644 docs/operations.md $(DESTDIR)$(PREFIX)/share/doc/epd/operations.md ;

# What `make uninstall` removes (relative to DESTDIR$(PREFIX)); the config in SYSCONFDIR stays.
UNINSTALL_FILES += lib/systemd/system/epd.service lib/systemd/system/epd@.service \
    libexec/epd/epd-launch lib/tmpfiles.d/epd.conf lib/sysusers.d/epd.conf \
    share/epd/epd.yaml.example share/epd/epd.default.example share/man/man8/epd.8 \
    share/man/man1/epctl.1 share/doc/epd/operations.md
UNINSTALL_DIRS += libexec/epd share/epd share/doc/epd
