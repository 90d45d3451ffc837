#!/usr/bin/env bash
# Builds a CUDA-aware Open MPI over UCX for GPU nodes (the distro's Open MPI is not CUDA-aware).
#   scripts/cuda-mpi.sh download DIR                  fetch sources + build helpers into DIR (needs apt)
#   scripts/cuda-mpi.sh build DIR PREFIX [CUDA_HOME]  no network: UCX (cuda_copy, cuda_ipc), then Open MPI
#   scripts/cuda-mpi.sh check PREFIX                  say what the installed prefix supports
#   scripts/cuda-mpi.sh pack PREFIX TARBALL           tar.gz of PREFIX, to untar at the same path elsewhere
# Environment: JOBS (make -j, default nproc), DEBIAN_MIRROR, DEBIAN_SUITE. docs/gpu-nodes.md explains when and how.
set -eEuo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=${DEBIAN_SUITE:-bookworm}
KEYRING=${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
# Binary packages fetched besides the two source packages: NVML's header and library, which UCX's
# CUDA support needs at build time and which a pip-installed CUDA toolkit does not ship.
NVML_DEBS=(libnvidia-ml-dev libnvidia-ml1)

die() { echo "cuda-mpi: error: $*" >&2; exit 1; }
trap 'echo "cuda-mpi: error: unexpected failure at line $LINENO (exit $?)" >&2' ERR
say() { echo "cuda-mpi: $*"; }
# logged WHAT LOG CMD...: runs CMD with its output in LOG; when it fails, shows the end of LOG
# and dies.
logged() {
    local what=$1 log=$2; shift 2
    "$@" >"$log" 2>&1 || { tail -n 30 "$log" >&2; die "$what failed (log: $log)"; }
}

usage() {
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-2}"
}

# apt_private ARGS...: apt-get with a private sources list, lists and caches under $APT_DIR,
# so that the system's apt configuration is never changed.
apt_private() {
    apt-get -q \
        -o Dir::Etc::SourceList="$APT_DIR/sources.list" \
        -o Dir::Etc::SourceParts="$APT_DIR/sources.list.d" \
        -o Dir::State::Lists="$APT_DIR/lists" \
        -o Dir::Cache="$APT_DIR/cache" \
        -o Dir::State::Status=/var/lib/dpkg/status \
        -o APT::Sandbox::User=root \
        "$@"
}

# Fetches the ucx and openmpi source packages and the NVML .debs into DIR, unpacks the pristine
# upstream tarballs and runs UCX's autogen.sh, so that `build` needs only a compiler and make.
cmd_download() {
    [[ $# -eq 1 ]] || usage
    local dir=$1
    command -v apt-get >/dev/null || die "download needs apt-get (run it on a Debian/Ubuntu machine with network, then carry DIR)"
    for t in autoconf automake libtoolize tar xz dpkg-source dpkg-deb; do
        command -v "$t" >/dev/null || die "download needs '$t' (apt-get install autoconf automake libtool xz-utils dpkg-dev)"
    done
    [[ -r $KEYRING ]] || die "no Debian archive keyring at $KEYRING (set DEBIAN_KEYRING)"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    APT_DIR=$dir/apt
    mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$APT_DIR/sources.list.d" \
        "$dir/pkgs" "$dir/debs" "$dir/src"
    cat >"$APT_DIR/sources.list" <<EOF
deb [signed-by=$KEYRING] $MIRROR $SUITE main non-free non-free-firmware
deb-src [signed-by=$KEYRING] $MIRROR $SUITE main
EOF
    say "updating a private package list ($MIRROR $SUITE) in $APT_DIR"
    apt_private update >"$APT_DIR/update.log" 2>&1 || { tail -n 20 "$APT_DIR/update.log" >&2; die "apt-get update failed (log: $APT_DIR/update.log)"; }

    if ! compgen -G "$dir/pkgs/ucx_*.orig.tar.*" >/dev/null || ! compgen -G "$dir/pkgs/openmpi_*.orig.tar.*" >/dev/null; then
        say "downloading source packages ucx and openmpi"
        (cd "$dir/pkgs" && apt_private source --download-only ucx openmpi) >"$dir/pkgs/download.log" 2>&1 ||
            { tail -n 20 "$dir/pkgs/download.log" >&2; die "apt-get source failed (log: $dir/pkgs/download.log)"; }
    fi
    local p
    for p in "${NVML_DEBS[@]}"; do
        if ! compgen -G "$dir/debs/${p}_*.deb" >/dev/null; then
            say "downloading $p"
            (cd "$dir/debs" && apt_private download "$p") >>"$dir/debs/download.log" 2>&1 ||
                { tail -n 20 "$dir/debs/download.log" >&2; die "apt-get download $p failed"; }
        fi
    done

    local ucx_tar ompi_tar ucx_ver ompi_ver
    ucx_tar=$(ls "$dir"/pkgs/ucx_*.orig.tar.* | head -n1)
    ompi_tar=$(ls "$dir"/pkgs/openmpi_*.orig.tar.* | head -n1)
    ucx_ver=$(basename "$ucx_tar" | sed -E 's/^ucx_(.*)\.orig\.tar\..*$/\1/')
    ompi_ver=$(basename "$ompi_tar" | sed -E 's/^openmpi_(.*)\.orig\.tar\..*$/\1/')

    # UCX: Debian's source package with its patches applied. Its upstream tarball lacks the
    # debian/*.in files that configure.ac names, which one of those patches removes from it; the
    # others fix builds with newer gcc and binutils.
    if [[ ! -f $dir/src/ucx/.epd-prepared ]]; then
        rm -rf "$dir/src/ucx" "$dir/src/ucx.tmp"
        dpkg-source -x "$dir/pkgs/ucx_${ucx_ver}"-*.dsc "$dir/src/ucx.tmp" >"$dir/src/ucx-unpack.log" 2>&1 ||
            { tail -n 20 "$dir/src/ucx-unpack.log" >&2; die "dpkg-source -x of UCX failed (log: $dir/src/ucx-unpack.log)"; }
        fix_ucx_cuda13 "$dir/src/ucx.tmp"
        say "running UCX $ucx_ver autogen.sh"
        (cd "$dir/src/ucx.tmp" && ./autogen.sh) >"$dir/src/ucx-autogen.log" 2>&1 ||
            { tail -n 20 "$dir/src/ucx-autogen.log" >&2; die "UCX autogen.sh failed (log: $dir/src/ucx-autogen.log)"; }
        echo "$ucx_ver" >"$dir/src/ucx.tmp/.epd-prepared"
        mv "$dir/src/ucx.tmp" "$dir/src/ucx"
    fi
    if [[ ! -f $dir/src/openmpi/.epd-prepared ]]; then
        # Open MPI: the pristine upstream tarball; Debian's patches are not needed.
        rm -rf "$dir/src/openmpi" "$dir/src/openmpi.tmp"
        mkdir -p "$dir/src/openmpi.tmp"
        tar -xf "$ompi_tar" -C "$dir/src/openmpi.tmp" --strip-components=1
        [[ -x $dir/src/openmpi.tmp/configure ]] || die "the Open MPI tarball $ompi_tar has no configure script"
        echo "$ompi_ver" >"$dir/src/openmpi.tmp/.epd-prepared"
        mv "$dir/src/openmpi.tmp" "$dir/src/openmpi"
    fi
    say "ready: UCX $ucx_ver and Open MPI $ompi_ver in $dir/src, NVML packages in $dir/debs"
    say "DIR is self-contained: carry it to the GPU node and run: $0 build $dir /opt/epd-cuda-mpi [CUDA_HOME]"
}

# fix_ucx_cuda13 SRC: CUDA 13 gave cuCtxCreate a 4th argument (CUctxCreateParams *, before the
# flags); UCX 1.13's test/apps/test_cuda_hook.c uses the old 3-argument call and stops the build.
fix_ucx_cuda13() {
    local f=$1/test/apps/test_cuda_hook.c
    [[ -f $f ]] || return 0
    grep -q 'EPD: CUDA 13' "$f" && return 0
    grep -q 'cuCtxCreate(' "$f" || return 0
    perl -0pi -e 's/cuCtxCreate\(\s*([^,()]+),\s*([^,()]+),\s*([^,()]+)\)/
#if CUDA_VERSION >= 13000 \/* EPD: CUDA 13 added a CUctxCreateParams * argument *\/
    cuCtxCreate($1, NULL, $2, $3)
#else
    cuCtxCreate($1, $2, $3)
#endif
    /g' "$f"
    grep -q 'EPD: CUDA 13' "$f" || die "could not adapt cuCtxCreate in $f"
}

# find_nvml DIR CUDA_HOME: sets NVML_CPPFLAGS / NVML_LDFLAGS (empty when the toolkit has NVML),
# else unpacks the downloaded libnvidia-ml .debs into DIR/nvml and points there.
find_nvml() {
    local dir=$1 cuda=$2
    NVML_CPPFLAGS= NVML_LDFLAGS=
    if [[ -f $cuda/include/nvml.h ]]; then
        say "NVML: $cuda/include/nvml.h (from the CUDA toolkit)"
        return 0
    fi
    local root=$dir/nvml deb
    if [[ ! -f $root/.epd-unpacked ]]; then
        compgen -G "$dir/debs/libnvidia-ml*.deb" >/dev/null ||
            die "$cuda has no nvml.h and $dir/debs has no libnvidia-ml .debs (run '$0 download $dir' first)"
        rm -rf "$root"
        mkdir -p "$root"
        for deb in "$dir"/debs/libnvidia-ml*.deb; do
            dpkg-deb -x "$deb" "$root" || die "cannot unpack $deb"
        done
        touch "$root/.epd-unpacked"
    fi
    local hdr lib
    hdr=$(find "$root" -name nvml.h -print -quit)
    [[ -n $hdr ]] || die "no nvml.h in the packages unpacked in $root"
    # libnvidia-ml.so (the link name) may be a symlink into an alternatives path that does not
    # exist here; make our own link name next to the real libnvidia-ml.so.1.
    local l
    lib=
    while read -r l; do
        if [[ -e $l ]]; then lib=$l; break; fi
    done < <(find "$root" -path "$root/link" -prune -o \( -type f -o -type l \) -name 'libnvidia-ml.so.1*' -print)
    [[ -n $lib ]] || die "no libnvidia-ml.so.1 in the packages unpacked in $root"
    mkdir -p "$root/link"
    ln -sf "$(readlink -f "$lib")" "$root/link/libnvidia-ml.so"
    ln -sf "$(readlink -f "$lib")" "$root/link/libnvidia-ml.so.1"
    NVML_CPPFLAGS="-I$(dirname "$hdr")"
    NVML_LDFLAGS="-L$root/link"
    say "NVML: $hdr and $(readlink -f "$lib") (unpacked from $dir/debs; used at link time only)"
}

# Builds and installs UCX, then Open MPI against it, into PREFIX. Each stage is skipped when a
# previous run already installed it with the same PREFIX and CUDA_HOME.
cmd_build() {
    [[ $# -ge 2 && $# -le 3 ]] || usage
    local dir=$1 prefix=$2 cuda=${3:-${CUDA_HOME:-/usr/local/cuda}}
    [[ -d $dir/src/ucx && -f $dir/src/ucx/.epd-prepared ]] || die "$dir/src/ucx is missing or incomplete (run '$0 download $dir' first)"
    [[ -f $dir/src/openmpi/.epd-prepared ]] || die "$dir/src/openmpi is missing or incomplete (run '$0 download $dir' first)"
    [[ -x $dir/src/ucx/configure ]] || die "$dir/src/ucx has no configure (autogen.sh did not run)"
    [[ $prefix == /* ]] || die "PREFIX must be an absolute path (got '$prefix')"
    [[ -f $cuda/include/cuda.h && -f $cuda/include/cuda_runtime_api.h ]] || die "no CUDA toolkit at '$cuda' (cuda.h missing); pass CUDA_HOME"
    command -v make >/dev/null && command -v cc >/dev/null || die "build needs cc and make"
    command -v c++ >/dev/null || die "build needs a C++ compiler (UCX has C++ parts): apt-get install g++"
    dir=$(cd "$dir" && pwd)
    mkdir -p "$prefix" || die "cannot create $prefix"
    [[ -w $prefix ]] || die "$prefix is not writable"

    # libcuda.so (the driver API) may exist only as the toolkit's link stub on a machine without a
    # driver; UCX's cuda module links against it, and the driver's real one is used at run time.
    local cudalib=$cuda/lib64 cuda_ldflags=
    [[ -d $cudalib ]] || cudalib=$cuda/lib
    if [[ ! -e $cudalib/libcuda.so ]] && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
        [[ -e $cudalib/stubs/libcuda.so ]] || die "no libcuda.so in $cudalib, its stubs/ or the system"
        cuda_ldflags="-L$cudalib/stubs"
        say "libcuda: linking against the stub $cudalib/stubs/libcuda.so (the driver provides it at run time)"
    fi
    find_nvml "$dir" "$cuda"

    # Transports are built for what this machine's headers offer (verbs/rdmacm when rdma-core's
    # -dev packages are present); cuda_copy and cuda_ipc are required. Shared libraries only.
    local ucx_args=(--prefix="$prefix" --with-cuda="$cuda" --enable-mt --disable-static
        --without-go --without-java --disable-doxygen-doc --without-rocm --without-knem
        --without-xpmem --without-gdrcopy --without-bfd --enable-optimizations --disable-debug
        --disable-assertions --disable-params-check
        CPPFLAGS="$NVML_CPPFLAGS ${CPPFLAGS:-}" LDFLAGS="$NVML_LDFLAGS $cuda_ldflags ${LDFLAGS:-}")
    # Bundled hwloc, libevent and PMIx: the prefix then depends on nothing a GPU node may lack.
    local ompi_args=(--prefix="$prefix" --with-cuda="$cuda" --with-ucx="$prefix"
        --disable-mpi-fortran --disable-oshmem --disable-mpi-java --without-verbs --without-ofi
        --with-hwloc=internal --with-libevent=internal --with-pmix=internal)
    local ucx_stamp="ucx=$(cat "$dir/src/ucx/.epd-prepared") ${ucx_args[*]}"
    local ompi_stamp="$ucx_stamp ompi=$(cat "$dir/src/openmpi/.epd-prepared") ${ompi_args[*]}"
    local bdir=$dir/build
    mkdir -p "$bdir"

    if [[ -f $bdir/ucx.done && $(cat "$bdir/ucx.done") == "$ucx_stamp" && -x $prefix/bin/ucx_info ]]; then
        say "UCX already installed in $prefix (remove $bdir/ucx.done to rebuild)"
    else
        # Installing over an older build would leave its files behind, mixed with the new ones.
        [[ -z $(ls -A "$prefix") ]] ||
            die "$prefix is not empty and holds no UCX built by this DIR with these settings: remove it or choose another PREFIX"
        rm -f "$bdir/ucx.done" "$bdir/ompi.done"
        rm -rf "$bdir/ucx" && mkdir -p "$bdir/ucx"
        say "configuring UCX (log: $bdir/ucx/configure.log)"
        (cd "$bdir/ucx" && logged "UCX configure" "$bdir/ucx/configure.log" \
            "$dir/src/ucx/configure" "${ucx_args[@]}") || exit 1
        grep -qE 'UCT modules: *<.* cuda( |>)' "$bdir/ucx/configure.log" ||
            { grep -iE 'cuda|nvml' "$bdir/ucx/configure.log" | tail -n 20 >&2
              die "UCX configure did not enable its CUDA module (see $bdir/ucx/configure.log)"; }
        say "building UCX with -j$JOBS (log: $bdir/ucx/make.log)"
        logged "UCX build" "$bdir/ucx/make.log" make -C "$bdir/ucx" -j"$JOBS"
        logged "UCX install" "$bdir/ucx/install.log" make -C "$bdir/ucx" install
        echo "$ucx_stamp" >"$bdir/ucx.done"
    fi
    [[ -e $prefix/lib/ucx/libuct_cuda.so ]] || die "UCX installed without its CUDA transport module ($prefix/lib/ucx/libuct_cuda.so)"

    if [[ -f $bdir/ompi.done && $(cat "$bdir/ompi.done") == "$ompi_stamp" && -x $prefix/bin/ompi_info ]]; then
        say "Open MPI already installed in $prefix (remove $bdir/ompi.done to rebuild)"
    else
        rm -rf "$bdir/ompi" && mkdir -p "$bdir/ompi"
        say "configuring Open MPI (log: $bdir/ompi/configure.log)"
        (cd "$bdir/ompi" && logged "Open MPI configure" "$bdir/ompi/configure.log" \
            "$dir/src/openmpi/configure" "${ompi_args[@]}") || exit 1
        grep -q 'CUDA support: yes' "$bdir/ompi/configure.log" ||
            die "Open MPI configure did not enable CUDA support (see $bdir/ompi/configure.log)"
        say "building Open MPI with -j$JOBS (log: $bdir/ompi/make.log)"
        logged "Open MPI build" "$bdir/ompi/make.log" make -C "$bdir/ompi" -j"$JOBS"
        logged "Open MPI install" "$bdir/ompi/install.log" make -C "$bdir/ompi" install
        echo "$ompi_stamp" >"$bdir/ompi.done"
    fi
    bundle_libs "$prefix"
    cmd_check "$prefix"
}

# bundle_libs PREFIX: copies libnuma.so.1 (UCX's one library outside glibc that a bare GPU node
# may lack) into PREFIX/lib, where the RUNPATH of UCX's libraries finds it. The CUDA runtime,
# the driver's libcuda/libnvidia-ml and the RDMA libraries are not bundled: they must match the
# node (an executable that links libcudart, like epd and the tests, provides libcudart.so.N).
bundle_libs() {
    local prefix=$1 lib
    [[ -e $prefix/lib/libnuma.so.1 ]] && return 0
    lib=$(ldd "$prefix/lib/libucs.so" 2>/dev/null | awk '$1 == "libnuma.so.1" { print $3 }')
    [[ -n $lib && -e $lib ]] || return 0
    cp -L "$lib" "$prefix/lib/libnuma.so.1"
    say "bundled $lib as $prefix/lib/libnuma.so.1"
}

# Reports what PREFIX supports; fails when Open MPI is not CUDA-aware, has no UCX PML, or UCX
# has no CUDA transport module.
cmd_check() {
    [[ $# -eq 1 ]] || usage
    local prefix=$1 bad=0 line
    [[ -x $prefix/bin/ompi_info ]] || die "no $prefix/bin/ompi_info"
    [[ -x $prefix/bin/ucx_info ]] || die "no $prefix/bin/ucx_info"
    say "checking $prefix"
    echo "  $("$prefix/bin/ompi_info" --version 2>/dev/null | head -n1)"
    echo "  $("$prefix/bin/ucx_info" -v 2>/dev/null | grep -m1 -i 'version')"
    line=$("$prefix/bin/ompi_info" --parsable --all 2>/dev/null | grep 'mpi_built_with_cuda_support:value' || true)
    echo "  ompi_info: ${line:-no mpi_built_with_cuda_support line}"
    [[ $line == *:value:true ]] || { echo "  -> Open MPI is NOT CUDA-aware"; bad=1; }
    if "$prefix/bin/ompi_info" 2>/dev/null | grep -q 'MCA pml: ucx'; then
        echo "  ompi_info: MCA pml: ucx present"
    else
        echo "  -> Open MPI has no UCX PML"; bad=1
    fi
    if [[ -e $prefix/lib/ucx/libuct_cuda.so ]]; then
        echo "  UCX CUDA transport module: $prefix/lib/ucx/libuct_cuda.so"
    else
        echo "  -> no $prefix/lib/ucx/libuct_cuda.so"; bad=1
    fi
    line=$("$prefix/bin/ucx_info" -d 2>/dev/null | grep -E 'Transport: *(cuda_copy|cuda_ipc|gdr_copy)' | sed 's/^[# ]*//' | sort -u | tr '\n' ' ' || true)
    if [[ -n $line ]]; then
        echo "  ucx_info -d lists: $line"
    else
        echo "  ucx_info -d lists no cuda transport: expected without a GPU/driver (the module loads only with libcuda.so.1)"
    fi
    line=$("$prefix/bin/ucx_info" -d 2>/dev/null | grep -E 'Transport: ' | sed 's/^[# ]*Transport: *//' | sort -u | tr '\n' ' ' || true)
    echo "  ucx_info -d transports here: ${line:-none}"
    [[ $bad -eq 0 ]] || die "$prefix is not a usable CUDA-aware MPI"
    say "OK: $prefix is a CUDA-aware Open MPI over UCX"
}

# Packs PREFIX into a tar.gz whose top folder is PREFIX's last component; untar it with
# `tar -C $(dirname PREFIX) -xzf TARBALL` on the other machine.
cmd_pack() {
    [[ $# -eq 2 ]] || usage
    local prefix=${1%/} tarball=$2
    [[ -x $prefix/bin/ompi_info ]] || die "$prefix does not look like an installed prefix (no bin/ompi_info)"
    mkdir -p "$(dirname "$tarball")"
    tar -C "$(dirname "$prefix")" -czf "$tarball.tmp" "$(basename "$prefix")" || die "tar failed"
    mv "$tarball.tmp" "$tarball"
    say "packed $prefix into $tarball ($(du -h "$tarball" | cut -f1)); unpack with: tar -C $(dirname "$prefix") -xzf $(basename "$tarball")"
}

[[ $# -ge 1 ]] || usage
case $1 in
    download) shift; cmd_download "$@" ;;
    build)    shift; cmd_build "$@" ;;
    check)    shift; cmd_check "$@" ;;
    pack)     shift; cmd_pack "$@" ;;
    -h|--help|help) usage 0 ;;
    *) echo "cuda-mpi: unknown command '$1'" >&2; usage ;;
esac
