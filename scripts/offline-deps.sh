#!/usr/bin/env bash
# An offline bundle of the few libraries a GPU node may lack (libyaml, cJSON, cmocka), for nodes
# that cannot reach a package archive (the GPU machines of this project cannot).
#   scripts/offline-deps.sh bundle DIR          on a machine with the archive: apt-get download the .debs into DIR
#   scripts/offline-deps.sh install DIR PREFIX  on the node: unpack them into PREFIX (not into /) and fix their
#                                               pkg-config files; then build with
#                                               PKG_CONFIG_PATH=PREFIX/pkgconfig LIBRARY_PATH=PREFIX/lib LD_LIBRARY_PATH=PREFIX/lib make
set -euo pipefail

debs=(libyaml-0-2 libyaml-dev libcjson1 libcjson-dev libcmocka0 libcmocka-dev)

usage() {
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

cmd=${1:-}
case "$cmd" in
bundle)
    dir=${2:?DIR}
    mkdir -p "$dir"
    (cd "$dir" && apt-get download "${debs[@]}")
    ls -1 "$dir"/*.deb
    ;;
install)
    dir=${2:?DIR} prefix=${3:?PREFIX}
    mkdir -p "$prefix/root" "$prefix/pkgconfig" "$prefix/lib"
    prefix=$(cd "$prefix" && pwd)
    for deb in "$dir"/*.deb; do
        dpkg -x "$deb" "$prefix/root"
    done
    # Debian's .pc files say prefix=/usr; point them at the unpacked tree.
    for pc in "$prefix"/root/usr/lib/*/pkgconfig/*.pc "$prefix"/root/usr/share/pkgconfig/*.pc; do
        [[ -e $pc ]] || continue
        sed -e "s|^prefix=.*|prefix=$prefix/root/usr|" \
            -e "s|^libdir=.*|libdir=$prefix/lib|" \
            -e "s|^includedir=/usr|includedir=$prefix/root/usr|" "$pc" >"$prefix/pkgconfig/$(basename "$pc")"
    done
    for lib in "$prefix"/root/usr/lib/*/lib*.so*; do
        ln -sf "$lib" "$prefix/lib/"
    done
    echo "PKG_CONFIG_PATH=$prefix/pkgconfig LIBRARY_PATH=$prefix/lib LD_LIBRARY_PATH=$prefix/lib"
    ;;
*)
    usage
    ;;
esac
