# systemd/: the unit, the example config, tmpfiles and sysusers, installed under PREFIX (systemd
# reads PREFIX/lib/systemd/system, .../tmpfiles.d and .../sysusers.d for /usr and /usr/local).
INSTALL_EXTRA += install -d $(DESTDIR)$(PREFIX)/lib/systemd/system $(DESTDIR)$(PREFIX)/lib/tmpfiles.d \
    $(DESTDIR)$(PREFIX)/lib/sysusers.d $(DESTDIR)$(PREFIX)/share/epd ; \
    sed 's|/usr/local/bin/epd|$(PREFIX)/bin/epd|' systemd/epd.service \
    >$(DESTDIR)$(PREFIX)/lib/systemd/system/epd.service ; \
    install -m 0644 systemd/epd.tmpfiles.conf $(DESTDIR)$(PREFIX)/lib/tmpfiles.d/epd.conf ; \
    install -m 0644 systemd/epd.sysusers.conf $(DESTDIR)$(PREFIX)/lib/sysusers.d/epd.conf ; \
    install -m 0644 systemd/epd.yaml $(DESTDIR)$(PREFIX)/share/epd/epd.yaml.example ;
