#!/bin/sh
# man-settings.sh < `epd --help`: the settings table of epd's help as roff (.TP entries) for the
# SETTINGS section of epd(8), so the man page lists exactly the settings the binary has.
awk '
function roff(s) { gsub(/\\/, "\\e", s); gsub(/-/, "\\-", s); return s }
/^Settings:/ { on = 1; next }
/^Deprecated environment variables/ { on = 0; dep = 1; print ".SS \"Deprecated environment variables\""; next }
on && /^  [a-z_]+\.[a-z_]+ / {
    name = $1; type = $2; def = $0; sub(/.* default /, "", def)
    getline doc; sub(/^ +/, "", doc)
    getline env; sub(/^ +env /, "", env)
    split(env, parts, "; ")
    printf ".TP\n.B %s\n", roff(name)
    printf "%s.\n", roff(doc)
    printf "Type %s, default \\fI%s\\fR, environment \\fB%s\\fR; %s.\n", type, roff(def), roff(parts[1]), roff(parts[2])
}
dep && /^  [A-Z0-9_]+$/ { name = $1; getline doc; sub(/^ +/, "", doc)
    printf ".TP\n.B %s\n%s.\n", roff(name), roff(doc) }
'
