#!/usr/bin/env bash
# Install everything vaccel's demo and tests need on a fresh Debian machine. Idempotent:
# a second run only checks. Usage: scripts/setup.sh [VENV]   (default: $VACCEL_VENV)
#
# The venv is built from /usr/bin/python3 outside /root, so that the multi-user tests'
# other Unix users can run the same interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${VACCEL_VENV:?give the venv path as an argument or in VACCEL_VENV}}

# Debian packages: libsystemd-dev + pkg-config build systemd-python; systemd gives
# systemd-analyze; systemd-container, debootstrap and zstd run the systemd boot test;
# chromium drives the web dashboard's test headless (tests/test_dashboard.py);
# libacl1-dev builds pylibacl, the device-node ACLs of `[enforce] mode = "acl"` (brokerd/addons/enforce/);
# slurm-wlm (pulls munge) runs tests/test_slurm.py's single-node Slurm (policy-rc.d keeps its services off).
# docker.io, podman (with runc, catatonit for --init, and for rootless: uidmap, slirp4netns, fuse-overlayfs) and acl
# are the container engines tests/container_engine.py starts privately (docs/containers.md); none of their
# services is started here.
# slurmdbd and mariadb-server give bench.lab's slurm-fs its fair share (bench/testbeds/slurm_accounting.py
# starts a private database and slurmdbd; their services are not started here).
# golang-go, golang-google-grpc-dev, golang-goprotobuf-dev and protobuf-compiler build the Go example client
# (examples/go/, tests/test_api_doc_client.py) offline, from the shipped proto.
APT_PACKAGES=(python3-venv libsystemd-dev pkg-config systemd systemd-container debootstrap zstd chromium libacl1-dev
              slurm-wlm slurmdbd mariadb-server docker.io runc podman catatonit uidmap slirp4netns fuse-overlayfs acl
              golang-go golang-google-grpc-dev golang-goprotobuf-dev protobuf-compiler)
# node + npm run the Node example client (examples/node/, tests/test_other_languages.py); a Node that
# brings its own npm (NodeSource's) is kept.
command -v npm >/dev/null 2>&1 || APT_PACKAGES+=(nodejs npm)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [ "$(id -u)" = 0 ]; then
        echo "setup: installing Debian packages: ${missing[*]}"
        # Packages with a daemon (docker.io, slurm-wlm) start it from their postinst unless
        # policy-rc.d says no: the tests start their own, privately. Keep one there meanwhile.
        temp_policy=""
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && temp_policy=1
        fi
        installed=0
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null || installed=$?
        if [ -n "$temp_policy" ]; then rm -f /usr/sbin/policy-rc.d; fi
        if [ "$installed" != 0 ]; then exit "$installed"; fi
    else
        echo "setup: missing Debian packages (run as root to install): ${missing[*]}" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV from /usr/bin/python3"
    /usr/bin/python3 -m venv "$VENV"
    chmod -R a+rX "$VENV"
fi
# This machine's pip config names local wheel folders that may be absent: pip warns once
# per package about them. Keep the log readable; real errors still show.
pip_install() { "$VENV/bin/pip" install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
# torch==2.13.0 is the CPU build on this machine's disk; a bare `torch` would pull CUDA.
"$VENV/bin/python" -c "import torch" 2>/dev/null || pip_install torch==2.13.0
extras="dev,torch"
if pkg-config --exists libsystemd 2>/dev/null; then extras="$extras,systemd"; fi
if [ -e /usr/include/sys/acl.h ]; then extras="$extras,enforce"; fi
# An editable install in setuptools' "compat" mode: plain sys.path entries in a .pth file.
# The default mode installs an import hook that costs every Python process here ~20 ms
# before its first line (a fifth of `vaccel run`); compat maps only the project root, so
# the client's folder (the package `vaccel` lives in client/vaccel) gets its own line.
pip_install -e ".[$extras]" --config-settings editable_mode=compat
site_dir=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$PWD/client" > "$site_dir/__editable__.vaccel-client.pth"
bash scripts/launcher.sh "$VENV"
chmod -R a+rX "$VENV"
# The Node example's packages, exactly as its lock file says, into examples/node/node_modules.
if command -v npm >/dev/null 2>&1; then
    lock=examples/node/package-lock.json installed=examples/node/node_modules/.package-lock.json
    if [ ! -e "$installed" ] || [ "$lock" -nt "$installed" ]; then
        npm ci --prefix examples/node --no-audit --no-fund --loglevel=error
    fi
fi
echo "setup: ready ($VENV, extras $extras)"
