#!/usr/bin/env bash
# Build the Debian 12 package of this checkout: dist/vaccel_VERSION_ARCH.deb (make deb), and
# beside it the wheel of the whole project it installed.
#
#   scripts/build_deb.sh [--wheels DIR] [--out DIR]
#
#   --wheels DIR   the dependencies' wheels (offline build); else pip fetches and builds them
#   --out DIR      where the .deb goes (default dist/)
#
# The daemon and the client live in a venv of their own, /opt/vaccel, built here from wheels
# (scripts/install.sh with DESTDIR=: the NVIDIA and AMD management bindings and pylibacl for
# [enforce] included), made from Debian's python3 with its site-packages (python3-systemd
# gives the journal fields). Everything else comes from the checkout: the unit, the
# sysusers snippet (group `vaccel`, the admins), /etc/vaccel/brokerd.toml as a conffile, man
# pages and bash completion generated from the parsers (scripts/gen_docs.py), the proto and
# the project's wheel for users' own environments. The package depends on Debian packages
# only and installs offline. Maintainer scripts: packaging/debian/.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
out=$repo/dist
deps=""
while (($#)); do
    case $1 in
        --wheels) deps=$(realpath "${2:?--wheels needs a folder}"); shift 2 ;;
        --out) out=$(realpath -m "${2:?--out needs a folder}"); shift 2 ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build_deb.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
command -v dpkg-deb >/dev/null || { echo "build_deb.sh: needs dpkg-deb (a Debian host)" >&2; exit 2; }

version=$(/usr/bin/python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
    "$repo/pyproject.toml")
arch=$(dpkg --print-architecture)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stage=$work/stage
wheels=$work/wheels
mkdir -p "$wheels" "$out"
log() { echo "build_deb: $*" >&2; }

# 1. The project's wheel, from a copy of the working tree (never in place: a stale build/
#    folder would put removed modules into it), and its dependencies' wheels.
log "building the vaccel wheel"
/usr/bin/python3 - "$repo" "$work/src" <<'EOF'
import shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2], ignore=shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", ".venv", ".cache"))
EOF
builder=$work/builder
/usr/bin/python3 -m venv "$builder"
# pylibacl is an sdist with a setup.py only: pip builds it with the builder's own setuptools and wheel.
"$builder/bin/pip" install --quiet --disable-pip-version-check setuptools wheel 2>&1 |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
"$builder/bin/pip" wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$wheels" "$work/src" 2>&1 |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
project_wheel=$(compgen -G "$wheels/vaccel-*.whl")
# The client's wheel for users' own environments (/usr/share/vaccel/wheels): the same name and
# version, only the client and the shared code, and only what they import (no daemon's aiohttp,
# prometheus-client, ...): scripts/client_wheel.py rewrites the copy's pyproject.toml.
cp -r "$work/src" "$work/client-src"
/usr/bin/python3 "$repo/scripts/client_wheel.py" "$work/client-src"
"$builder/bin/pip" wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$work/client-wheel" \
    "$work/client-src" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
client_wheel=$(compgen -G "$work/client-wheel/vaccel-*.whl")
if [[ -n $deps ]]; then
    cp "$deps"/*.whl "$wheels/"
else
    log "fetching and building the dependencies' wheels"
    "$builder/bin/pip" wheel --quiet --disable-pip-version-check --find-links "$wheels" --wheel-dir "$wheels" \
        "vaccel[nvidia,amd,enforce] @ file://$project_wheel" 2>&1 |
        { grep -v "is ignored: it is neither a file nor a directory" || true; }
fi

# 2. The venv, staged under $stage (scripts/install.sh relocates it to /opt/vaccel).
log "staging /opt/vaccel"
DESTDIR=$stage bash "$repo/scripts/install.sh" --no-units --wheels "$wheels" --extras enforce /opt/vaccel >&2
rm -rf "$stage/usr/local"  # install.sh's link for hosts without a package; here /usr/bin has them
# pip and setuptools only built the venv (a third of its size): dpkg owns it, nothing installs into it later.
site=$(compgen -G "$stage/opt/vaccel/lib/python3*/site-packages")
rm -rf "$site"/pip "$site"/pip-*.dist-info "$site"/setuptools "$site"/setuptools-*.dist-info \
    "$site"/pkg_resources "$site"/_distutils_hack "$site"/distutils-precedence.pth "$stage"/opt/vaccel/bin/pip*
install -d "$stage/usr/bin"
ln -s /opt/vaccel/bin/vaccel "$stage/usr/bin/vaccel"
ln -s /opt/vaccel/bin/vaccel-brokerd "$stage/usr/bin/vaccel-brokerd"

# 3. The service, the group and the configuration.
install -D -m 644 "$repo/systemd/vaccel-brokerd.service" "$stage/lib/systemd/system/vaccel-brokerd.service"
install -D -m 644 "$repo/packaging/debian/vaccel.sysusers" "$stage/usr/lib/sysusers.d/vaccel.conf"
install -d "$stage/etc/vaccel"
sed 's|^admin_group = "vaccel-admin"|admin_group = "vaccel"   # the group the package makes|' \
    "$repo/examples/brokerd.toml" >"$stage/etc/vaccel/brokerd.toml"
grep -q '^admin_group = "vaccel" ' "$stage/etc/vaccel/brokerd.toml"

# 4. What users read and use: man pages and completion from the parsers, the proto, the wheel.
"$stage/opt/vaccel/bin/python3" "$repo/scripts/gen_docs.py" "$work/docs" >/dev/null
install -D -m 644 "$work/docs/vaccel.bash-completion" "$stage/usr/share/bash-completion/completions/vaccel"
install -d "$stage/usr/share/man/man1" "$stage/usr/share/man/man8"
gzip -9n <"$work/docs/vaccel.1" >"$stage/usr/share/man/man1/vaccel.1.gz"
gzip -9n <"$work/docs/vaccel-brokerd.8" >"$stage/usr/share/man/man8/vaccel-brokerd.8.gz"
install -D -m 644 "$repo/proto/vaccel/v1/broker.proto" "$stage/usr/share/vaccel/proto/vaccel/v1/broker.proto"
install -D -m 644 "$client_wheel" "$stage/usr/share/vaccel/wheels/$(basename "$client_wheel")"
install -D -m 644 "$repo/packaging/debian/copyright" "$stage/usr/share/doc/vaccel/copyright"

# 5. Control files.
install -d "$stage/DEBIAN"
for script in postinst prerm postrm; do
    install -m 755 "$repo/packaging/debian/$script" "$stage/DEBIAN/$script"
done
echo /etc/vaccel/brokerd.toml >"$stage/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@SIZE@/$size/" \
    "$repo/packaging/debian/control" >"$stage/DEBIAN/control"

cp "$project_wheel" "$out/"  # the whole project's wheel, beside: `make install --wheels` takes it
deb=$out/vaccel_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zgzip --build "$stage" "$deb" >&2
log "built $deb ($(du -h "$deb" | cut -f1), installed size ${size} KiB)"
echo "$deb"
