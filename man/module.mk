# man/: epd(8) and epctl(1). epd.8's SETTINGS section is generated from `epd --help`, so the page
# lists exactly the settings of the binary.
MAN_PAGES := $(BUILD)/man/epd.8 $(BUILD)/man/epctl.1

$(BUILD)/man/epd.8: man/epd.8.in $(BUILD)/epd scripts/man-settings.sh
	@mkdir -p $(dir $@)
	$(call say,GEN)$(BUILD)/epd --help | sh scripts/man-settings.sh >$@.settings && \
	    sed -e 's/@VERSION@/$(VERSION)/' -e '/^@SETTINGS@$$/{r $@.settings' -e 'd}' $< >$@ && rm -f $@.settings

$(BUILD)/man/epctl.1: man/epctl.1.in
	@mkdir -p $(dir $@)
	$(call say,GEN)sed -e 's/@VERSION@/$(VERSION)/' $< >$@

BINS += $(MAN_PAGES)
