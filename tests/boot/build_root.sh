#!/bin/bash
# Build (once) the container root the boot test boots: Debian bookworm minbase with
# systemd as init, python3 and python3-systemd, cached as a zstd tarball.
#
#   build_root.sh CACHE_DIR        prints the tarball's path on stdout
#
# Exit status 3 means the package mirror cannot be reached (the test then skips, loudly);
# any other failure is a real failure. VACCEL_BOOT_MIRROR overrides the mirror, which is
# otherwise the one apt already uses.
set -euo pipefail

cache=${1:?usage: build_root.sh CACHE_DIR}
suite=bookworm
# procps: /bin/kill for ExecReload=; passwd: useradd for the test's ordinary user.
packages=systemd,systemd-sysv,dbus,python3,python3-venv,python3-systemd,procps,passwd
key=$(printf '%s %s v1' "$suite" "$packages" | sha256sum | cut -c1-12)
tarball=$cache/root-$suite-$key.tar.zst

log() { echo "build_root: $*" >&2; }

mirror() {
    if [[ -n ${VACCEL_BOOT_MIRROR:-} ]]; then echo "$VACCEL_BOOT_MIRROR"; return; fi
    local uri
    uri=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    if [[ -z $uri ]]; then
        uri=$(awk '$1 == "deb" && $0 !~ /security/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

mirror_reachable() {
    # The Release file of the suite: small, and exactly what debootstrap fetches first.
    /usr/bin/python3 - "$1/dists/$suite/Release" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=20).read(64)
except OSError as exc:
    print(f"build_root: cannot reach {sys.argv[1]}: {exc}", file=sys.stderr)
    sys.exit(1)
EOF
}

host_tools() {
    local missing=()
    command -v systemd-nspawn >/dev/null || missing+=(systemd-container)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v zstd >/dev/null || missing+=(zstd)
    if ((${#missing[@]})); then
        log "installing host tools: ${missing[*]}"
        # Without recommends: a recommended package rewrites nsswitch.conf.
        apt-get update -qq >&2 || return 3
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >&2 || return 3
    fi
}

host_tools || exit 3

if [[ -s $tarball ]]; then
    log "cached root $tarball"
    echo "$tarball"
    exit 0
fi

url=$(mirror)
mirror_reachable "$url" || exit 3

mkdir -p "$cache"
work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf --one-file-system "$work"' EXIT
root=$work/root
log "debootstrap $suite from $url (about a minute)"
if ! debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$url" >"$work/debootstrap.log" 2>&1; then
    tail -n 30 "$work/debootstrap.log" >&2
    # A mirror that vanished mid-way is still "unreachable"; anything else is a failure.
    if grep -qiE 'Failed getting release file|Temporary failure|Could not resolve|Connection (refused|timed out)' "$work/debootstrap.log"; then
        exit 3
    fi
    exit 1
fi

# Trim what a test never reads, and make the root boot quietly and fast.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
find "$root"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'C*' -exec rm -rf {} +
echo vaccel-boot >"$root/etc/hostname"
: >"$root/etc/machine-id"
# No getty on the container's console: the test drives everything from a unit.
ln -sf /dev/null "$root/etc/systemd/system/console-getty.service"

tar -C "$root" --numeric-owner --xattrs -cf - . | zstd -q -T0 -10 -o "$work/root.tar.zst"
mv "$work/root.tar.zst" "$tarball"
log "cached $(du -h "$tarball" | cut -f1) in $tarball"
echo "$tarball"
