#!/usr/bin/env bash
# Builds, idempotently and cached, the CPythons of the test matrix that cannot
# run on the host (DESIGN.md "Testing"): a minimal Debian testing ("forky")
# root holding Debian's python3.14, python3.14-dbg, python3.15 and python3.15-dbg,
# a launcher that runs 3.15 from Debian's shared libpython3.15.so, and the
# free-threaded CPython 3.13t, built inside it from the upstream tarball of
# Debian's python3.13 source package (the archive holds no source of 3.14 or
# 3.15). Their glibc is newer
# than the host's: they run only inside the root, which is also our container
# case (other root, other glibc).
#
# Usage: tools/build-chroot.sh [bookworm] (as root; `make test` runs it)
#   PYOFFCPU_CHROOT  the root (default /var/cache/pyoffcpu/chroot/forky)
#   PYOFFCPU_MIRROR  the Debian mirror (default: read from apt's own sources)
#   PYOFFCPU_JOBS    make -j for the free-threaded builds (default 2)
# Build output goes to ROOT.log (next to the root, not inside it).
#
# Stages, each skipped when its stamp ROOT/.pyoffcpu-stage-NAME holds the
# stage's current settings: debootstrap (a half-finished root is removed and
# redone), packages, shared315 (the launcher), python313t, verify. With everything in place a run prints
# one "ready" line and takes a few milliseconds.
# debootstrap is never installed on the host: the newest .deb apt can see is
# unpacked into a temporary directory (forky's own when the host's does not know
# forky; bookworm's does not) and run from there. Every chroot step runs in a
# private mount namespace (unshare --mount) with /proc and /dev/shm mounted only
# there: the mounts go away with the step, even when it fails or is killed.
#
# Running a program in the root (ROOT=/var/cache/pyoffcpu/chroot/forky):
#   chroot ROOT /usr/bin/python3.14 -c 'print(1)'
#       works without /proc: checked 2026-12 with the 3.14 and 3.13t interpreters (they
#       start, find their prefix, import sysconfig, ctypes, hashlib, zlib,
#       asyncio, run threads, take a multiprocessing.Lock; ROOT/dev/shm is a
#       plain directory, which sem_open is content with). What needs /proc is
#       code that reads it: os.listdir('/proc/self/fd'), /dev/stdout (a link to
#       /proc/self/fd/1), psutil-like introspection. With /proc:
#   unshare --mount --propagation private sh -c \
#       'mount -t proc proc ROOT/proc && exec chroot ROOT /usr/bin/python3.14 ...'
#       /proc only in a private mount namespace: nothing to clean up afterwards.
#       unshare, sh and chroot each exec the next, so the PID you spawned is the
#       interpreter's PID.
#   unshare --pid --fork --mount --mount-proc=ROOT/proc chroot ROOT /usr/bin/python3.14 ...
#       also in its own PID namespace: it is PID 1 there, and its host PID is
#       that of the unshare process's child, not the one you spawned.
# The interpreters, as seen inside the root: /usr/bin/python3.14 and
# /usr/bin/python3.15 (release, static), /usr/bin/python3.14d and
# /usr/bin/python3.15d (-dbg), /opt/python3.15-shared/bin/python3.15 (3.15 from
# libpython3.15.so), /opt/python3.13t/bin/python3.13t.
set -Eeuo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "build-chroot: must run as root (sudo make test)" >&2
    exit 1
fi

ROOT=${PYOFFCPU_CHROOT:-/var/cache/pyoffcpu/chroot/forky}
SUITE=forky
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
JOBS=${PYOFFCPU_JOBS:-2}
# python3.14, 3.15 and their -dbg, libpython3.15-dev (the shared library and
# its headers, for the launcher), and what the free-threaded builds need
# (libffi: ctypes).
PACKAGES=(python3.14 python3.14-dbg python3.15 python3.15-dbg libpython3.15-dev
          gcc make libc6-dev libffi-dev zlib1g-dev xz-utils pkgconf)
# Only 3.13t: the archive here holds no source package of python3.14 or
# python3.15 (404), and nothing else may be downloaded.
FT_MINORS=(13)
# --without-ensurepip: the tests need no pip there, and installing it costs a minute.
ft_prefix() { echo "/opt/python3.$1t"; }
ft_configure() {
    local prefix
    prefix=$(ft_prefix "$1")
    echo --disable-gil --enable-shared "--prefix=$prefix" --without-ensurepip \
        "LDFLAGS=-Wl,-rpath,$prefix/lib"
}
SHARED315=/opt/python3.15-shared/bin/python3.15
INTERPRETERS=(/usr/bin/python3.14 /usr/bin/python3.14d /usr/bin/python3.15 /usr/bin/python3.15d
              "$SHARED315")
for m in "${FT_MINORS[@]}"; do INTERPRETERS+=("$(ft_prefix "$m")/bin/python3.${m}t"); done
# What the root is for: the interpreters above (forky), or with the argument
# `bookworm` a plain Debian 12 server (minbase and systemd) into which
# tests/test_packaging.py installs the .deb: on an overlay, so it stays
# fresh. The packages the .deb depends on are downloaded into its apt cache,
# not installed, so that a test installs them without the network.
KIND=${1:-forky}
PREFETCH=()
case $KIND in
    forky) ;;
    bookworm)
        ROOT=${PYOFFCPU_BOOKWORM_CHROOT:-/var/cache/pyoffcpu/chroot/bookworm}
        SUITE=bookworm
        PACKAGES=(systemd)
        PREFETCH=(python3-bpfcc python3-pyelftools python3-click python3-capstone linux-headers-amd64
                  zstd lz4)
        FT_MINORS=()
        INTERPRETERS=()
        ;;
    *) echo "build-chroot: unknown root '$KIND' (forky, bookworm)" >&2; exit 1 ;;
esac

# What each stage's stamp holds: a stage whose settings changed is done again.
KEY_debootstrap="$SUITE minbase"
KEY_packages="${PACKAGES[*]}; downloaded: ${PREFETCH[*]}"
KEY_shared315="Py_BytesMain against libpython3.15.so into $SHARED315"
for m in "${FT_MINORS[@]}"; do
    printf -v "KEY_python3${m}t" '%s' "python3.$m source package; $(ft_configure "$m")"
done
KEY_verify="${INTERPRETERS[*]}"
STAGES=(debootstrap packages shared315 python313t verify)
[ "$KIND" = forky ] || STAGES=(debootstrap packages)

case $ROOT in
    /*) ;;
    *) echo "build-chroot: PYOFFCPU_CHROOT must be an absolute path, not '$ROOT'" >&2; exit 1 ;;
esac
ROOT=$(realpath -m "$ROOT")
if [ "$ROOT" = / ]; then
    echo "build-chroot: PYOFFCPU_CHROOT must not be /" >&2
    exit 1
fi
LOG="$ROOT.log"

stamp() { echo "$ROOT/.pyoffcpu-stage-$1"; }
stage_done() {
    local key="KEY_$1"
    [ -f "$(stamp "$1")" ] && [ "$(<"$(stamp "$1")")" = "${!key}" ]
}
all_done() {
    local s p
    for s in "${STAGES[@]}"; do stage_done "$s" || return 1; done
    for p in "${INTERPRETERS[@]}"; do [ -x "$ROOT$p" ] || return 1; done
}
ready() { echo "build-chroot: ready: $ROOT (${INTERPRETERS[*]})"; }

# The fast path: everything is there.
if all_done; then
    ready
    exit 0
fi

mkdir -p "$(dirname "$ROOT")"
exec 9>"$ROOT.lock"
if ! flock -n 9; then
    echo "build-chroot: another build of $ROOT is running; waiting for it"
    flock 9
    if all_done; then ready; exit 0; fi
fi

STAGE=setup
LOGGED_CMD=
TMP=$(mktemp -d /tmp/build-chroot.XXXXXX)
: >"$LOG"

# Unmounts whatever is mounted at or below ROOT, deepest first. Nothing should
# be (every step runs in its own mount namespace): a safety net.
umount_under() {
    local m
    findmnt -rn -o TARGET | awk -v r="$ROOT" '$0 == r || index($0, r "/") == 1' | sort -r |
        while read -r m; do umount "$m" 2>/dev/null || umount -l "$m"; done
}
cleanup() {
    umount_under || true
    rm -rf "$TMP"
}
on_error() {
    local rc=$1 line=$2 cmd=$3 last=""
    trap - ERR
    if [ "${4:-}" = logged ]; then    # failed inside logged(): name its caller
        line=$5 cmd=$LOGGED_CMD
    fi
    cmd=${cmd%%$'\n'*}
    [ ${#cmd} -le 160 ] || cmd="${cmd:0:160}..."
    [ -s "$LOG" ] && last=$(tail -n 1 "$LOG" | cut -c1-200)
    echo "build-chroot: stage $STAGE failed (exit $rc, line $line: $cmd)${last:+; last log line: $last}; log: $LOG" >&2
    exit "$rc"
}
trap cleanup EXIT
trap 'on_error $? $LINENO "$BASH_COMMAND" "${FUNCNAME[0]:-}" "${BASH_LINENO[0]:-}"' ERR

die() {
    trap - ERR
    echo "build-chroot: $*" >&2
    exit 1
}

# Runs a command with its output in the log; on failure the ERR trap names
# the caller's line and command.
logged() {
    LOGGED_CMD="$*"
    "$@" >>"$LOG" 2>&1
}

# The Debian mirror apt uses here: the first deb source of the host's own
# suite (VERSION_CODENAME), from sources.list, *.list and *.sources (deb822).
apt_mirror() {
    if [ -n "${PYOFFCPU_MIRROR:-}" ]; then
        echo "$PYOFFCPU_MIRROR"
        return
    fi
    local codename files=() f
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    [ -f /etc/apt/sources.list ] && files+=(/etc/apt/sources.list)
    for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && files+=("$f")
    done
    [ ${#files[@]} -gt 0 ] || return 0
    # prints "suite uri" for every enabled binary (deb) source
    awk '
        function flush(   i, j, nu, ns, u, s) {
            if (val["types"] ~ /(^| )deb( |$)/ && tolower(val["enabled"]) != "no") {
                nu = split(val["uris"], u, " "); ns = split(val["suites"], s, " ")
                for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++) print s[j], u[i]
            }
            delete val; field = ""
        }
        FNR == 1 { flush() }
        FILENAME ~ /\.sources$/ {
            if ($0 ~ /^[ \t]*#/) next
            if ($0 ~ /^[ \t]*$/) { flush(); next }
            if ($0 ~ /^[ \t]/) { sub(/^[ \t]+/, ""); val[field] = val[field] " " $0; next }
            field = tolower(substr($0, 1, index($0, ":") - 1))
            v = substr($0, index($0, ":") + 1); sub(/^[ \t]+/, "", v); sub(/[ \t]+$/, "", v)
            val[field] = v
            next
        }
        {
            sub(/#.*/, "")
            if ($1 != "deb") next
            i = 2
            if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
            if (i + 1 <= NF) print $(i + 1), $i
        }
        END { flush() }
    ' "${files[@]}" >"$TMP/sources" 2>/dev/null || true
    awk -v c="$codename" '
        $2 ~ /^(https?|ftp|file):/ && $2 !~ /security/ {
            rank = ($1 == c) ? 1 : ($1 == "stable") ? 2 : ($1 ~ /^(testing|unstable|sid|trixie|forky)$/) ? 3 : 0
            if (rank && (!best || rank < best)) { best = rank; uri = $2 }
        }
        END { if (uri) print uri }
    ' "$TMP/sources"
}

MIRROR=
mirror() {
    if [ -z "$MIRROR" ]; then
        MIRROR=$(apt_mirror)
        [ -n "$MIRROR" ] || die "no Debian mirror for '$(. /etc/os-release && echo "${VERSION_CODENAME:-?}")' in apt's sources; set PYOFFCPU_MIRROR"
        MIRROR=${MIRROR%/}
    fi
}

# A command inside ROOT, in a private mount namespace holding /proc and /dev/shm.
in_root() {
    unshare --mount --propagation private -- /bin/sh -c '
        mount -t proc proc "$0/proc" &&
        { [ ! -d "$0/dev/shm" ] || mount -t tmpfs -o mode=1777 shm "$0/dev/shm"; } &&
        exec chroot "$0" "$@"' "$ROOT" \
        /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"
}

T0=0
stage_begin() {
    STAGE=$1
    T0=$(date +%s)
    echo "build-chroot: $1: $2 (log: $LOG)"
}
stage_end() {
    local key="KEY_$STAGE"
    printf '%s\n' "${!key}" >"$(stamp "$STAGE")"
    echo "build-chroot: $STAGE done in $(($(date +%s) - T0)) s; root is $(du -sh --one-file-system "$ROOT" | cut -f1)"
}

# Unpacks debootstrap into $TMP and sets DEBOOTSTRAP_DIR / DEBOOTSTRAP_BIN.
fetch_debootstrap() {
    local d="$TMP/host" deb
    mkdir -p "$d"
    cd "$d"
    logged apt-get -q -o APT::Sandbox::User=root download debootstrap || true
    cd - >/dev/null
    deb=$(ls "$d"/debootstrap_*_all.deb 2>/dev/null | head -n 1)
    if [ -n "$deb" ]; then
        dpkg-deb -x "$deb" "$d/x"
        if [ -e "$d/x/usr/share/debootstrap/scripts/$SUITE" ]; then
            DEBOOTSTRAP_DIR="$d/x/usr/share/debootstrap" DEBOOTSTRAP_BIN="$d/x/usr/sbin/debootstrap"
            echo "build-chroot: using $(basename "$deb") (the host's)"
            return
        fi
    fi
    # The host's debootstrap does not know forky: take forky's own, through a
    # throw-away apt state (the host's lists and caches are not touched).
    mirror
    [ -f "$KEYRING" ] || die "$KEYRING missing (apt-get install debian-archive-keyring)"
    d="$TMP/$SUITE"
    mkdir -p "$d/lists/partial" "$d/cache/archives/partial" "$d/empty" "$d/dl"
    echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" >"$d/sources.list"
    local opts=(-q -o "Dir::Etc::SourceList=$d/sources.list" -o "Dir::Etc::SourceParts=$d/empty"
                -o "Dir::Etc::Preferences=/dev/null" -o "Dir::Etc::PreferencesParts=$d/empty"
                -o "Dir::State::Lists=$d/lists" -o "Dir::Cache=$d/cache"
                -o Acquire::Check-Valid-Until=false -o Acquire::Languages=none
                -o APT::Sandbox::User=root)
    logged apt-get "${opts[@]}" update
    cd "$d/dl"
    logged apt-get "${opts[@]}" download debootstrap
    cd - >/dev/null
    deb=$(ls "$d"/dl/debootstrap_*_all.deb 2>/dev/null | head -n 1)
    [ -n "$deb" ] || die "no debootstrap .deb in $SUITE at $MIRROR"
    dpkg-deb -x "$deb" "$d/x"
    [ -e "$d/x/usr/share/debootstrap/scripts/$SUITE" ] || die "$(basename "$deb") has no script for $SUITE"
    DEBOOTSTRAP_DIR="$d/x/usr/share/debootstrap" DEBOOTSTRAP_BIN="$d/x/usr/sbin/debootstrap"
    echo "build-chroot: using $(basename "$deb") ($SUITE's; the host's does not know $SUITE)"
}

# Removes ROOT (a half-finished or outdated one) and makes it anew, empty.
reset_root() {
    if [ -e "$ROOT" ] || [ -L "$ROOT" ]; then
        [ -d "$ROOT" ] && [ ! -L "$ROOT" ] || die "$ROOT exists and is not a directory"
        if [ ! -e "$ROOT/.pyoffcpu-root" ] && [ -n "$(ls -A "$ROOT")" ]; then
            die "$ROOT is not empty and was not made by build-chroot: remove it or set PYOFFCPU_CHROOT"
        fi
        echo "build-chroot: removing the unfinished root $ROOT"
        umount_under
        rm -rf --one-file-system "$ROOT"
    fi
    mkdir -p "$ROOT"
    echo "made by pyoffcpu tools/build-chroot.sh" >"$ROOT/.pyoffcpu-root"
}

stage_debootstrap() {
    command -v wget >/dev/null || die "debootstrap downloads with wget: apt-get install wget"
    command -v gpgv >/dev/null || die "debootstrap checks the archive signature with gpgv: apt-get install gpgv"
    [ -f "$KEYRING" ] || die "$KEYRING missing (apt-get install debian-archive-keyring)"
    mirror
    stage_begin debootstrap "minimal Debian $SUITE from $MIRROR into $ROOT"
    reset_root
    fetch_debootstrap
    # In its own mount namespace: the /proc and /sys debootstrap mounts in the
    # target cannot outlive it, even when it dies.
    logged unshare --mount --propagation private -- \
        env DEBOOTSTRAP_DIR="$DEBOOTSTRAP_DIR" "$DEBOOTSTRAP_BIN" --variant=minbase \
        --keyring="$KEYRING" "$SUITE" "$ROOT" "$MIRROR"
    stage_end
}

stage_packages() {
    mirror
    stage_begin packages "apt-get install ${PACKAGES[*]}"
    # The archive here is a frozen snapshot: its Release files are past Valid-Until.
    cat >"$ROOT/etc/apt/apt.conf.d/99pyoffcpu" <<'EOF'
// tools/build-chroot.sh: the archive is a frozen snapshot.
Acquire::Check-Valid-Until "false";
Acquire::Languages "none";
APT::Install-Recommends "false";
EOF
    # for `apt-get source python3.13`
    [ "$KIND" != forky ] || echo "deb-src $MIRROR $SUITE main" >"$ROOT/etc/apt/sources.list.d/pyoffcpu-deb-src.list"
    cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
    logged in_root apt-get -q update
    logged in_root apt-get -q -y install "${PACKAGES[@]}"
    logged in_root apt-get clean
    if [ ${#PREFETCH[@]} -gt 0 ]; then
        logged in_root apt-get -q -y install --download-only "${PREFETCH[@]}"
    fi
    stage_end
}

# A free-threaded CPython 3.$1t, from the upstream tarball of Debian's python3.$1
# source package, into ft_prefix $1.
stage_python3t() {
    local m=$1 prefix
    prefix=$(ft_prefix "$m")
    # shellcheck disable=SC2046
    set -- $(ft_configure "$m")
    stage_begin "python3${m}t" "free-threaded CPython 3.${m}t from Debian's python3.$m upstream tarball into $prefix (make -j$JOBS)"
    rm -rf "$ROOT/build" "$ROOT$prefix"
    mkdir -p "$ROOT/build"
    # shellcheck disable=SC2016
    logged in_root JOBS="$JOBS" MINOR="$m" /bin/sh -c '
        set -e
        cd /build
        apt-get -q -o APT::Sandbox::User=root source --download-only python3.$MINOR
        tarball=$(ls python3.${MINOR}_3.${MINOR}.*.orig.tar.xz | head -n 1)
        echo "build-chroot: building from $tarball"
        tar -xf "$tarball"
        cd Python-3.$MINOR.*/
        ./configure "$@"
        make -j"$JOBS"
        make install
    ' sh "$@"
    echo "build-chroot: built from $(cd "$ROOT/build" && ls python3."$m"_3."$m".*.orig.tar.xz)"
    rm -rf "$ROOT/build"
    stage_end
}

# 3.15 run from Debian's libpython3.15.so: Debian's own python3.15 is static,
# so a shared-libpython 3.15 is a program that embeds it, as uwsgi or a C++
# server does. Py_BytesMain is all of python3.15's main(); the interpreter
# finds its library (/usr/lib/python3.15) from the prefix built into libpython.
stage_shared315() {
    stage_begin shared315 "a launcher of libpython3.15.so at $SHARED315"
    mkdir -p "$ROOT$(dirname "$SHARED315")"
    printf '%s\n' '#include <Python.h>' \
        'int main(int argc, char **argv) { return Py_BytesMain(argc, argv); }' \
        >"$ROOT$(dirname "$SHARED315")/main.c"
    logged in_root gcc -O2 -I/usr/include/python3.15 -o "$SHARED315" \
        "$(dirname "$SHARED315")/main.c" -lpython3.15
    stage_end
}

stage_verify() {
    stage_begin verify "each interpreter runs in the root"
    local check='import sys, sysconfig
print(sys.version.replace("\n", " "), sysconfig.get_config_var("Py_GIL_DISABLED"), sys.flags)
print("gil_enabled", sys._is_gil_enabled(), "debug", hasattr(sys, "gettotalrefcount"))'
    local p out want
    for p in "${INTERPRETERS[@]}"; do
        out=$(in_root "$p" -c "$check" 2>&1) || die "$p does not run in $ROOT: $out"
        echo "build-chroot: $p: ${out//$'\n'/; }"
        case $p in
            */python3.1?t) want="gil_enabled False debug False" ;;
            */python3.1?d) want="gil_enabled True debug True" ;;
            *) want="gil_enabled True debug False" ;;
        esac
        [ "${out##*$'\n'}" = "$want" ] || die "$p: expected '$want', got '${out##*$'\n'}'"
        if [ "$p" = "$SHARED315" ]; then
            in_root "$p" -c 'import sys; sys.exit("libpython3.15.so" not in open("/proc/self/maps").read())' ||
                die "$p does not run from libpython3.15.so"
        fi
        case $p in
            */python3.1?t) [[ $out == *" 1 sys.flags("* ]] || die "$p: Py_GIL_DISABLED is not 1" ;;
            *) [[ $out == *" 0 sys.flags("* ]] || die "$p: Py_GIL_DISABLED is not 0" ;;
        esac
    done
    stage_end
}

if ! stage_done debootstrap; then
    rm -f "$ROOT"/.pyoffcpu-stage-* 2>/dev/null || true
    stage_debootstrap
fi
if ! stage_done packages; then
    rm -f "$(stamp verify)"
    stage_packages
fi
if [ "$KIND" = forky ]; then
    if ! stage_done shared315; then
        rm -f "$(stamp verify)"
        stage_shared315
    fi
    for m in "${FT_MINORS[@]}"; do
        if ! stage_done "python3${m}t"; then
            rm -f "$(stamp verify)"
            stage_python3t "$m"
        fi
    done
    stage_done verify || stage_verify
fi
STAGE=done
ready
