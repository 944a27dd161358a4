#!/usr/bin/env bash
# Install vaccel for a lab on a host without dpkg (on Debian and Ubuntu, `make deb` builds a
# package: docs/service.md): a wheel built from this checkout, installed (not editable) into
# a system venv that belongs to no clone, with the NVIDIA and AMD management bindings, the
# broker's systemd unit pointing at it, and `vaccel` on every user's PATH. Run as root:
#
#   sudo make install                       (= scripts/install.sh /opt/vaccel)
#   scripts/install.sh [--wheels DIR] [--extras LIST] [--no-units] [VENV]
#
#   VENV           where it goes (default /opt/vaccel); made from /usr/bin/python3 with the
#                  system's site-packages, so Debian's python3-systemd gives the journal fields
#   --wheels DIR   install from the wheels in DIR, offline (vaccel's and its dependencies'),
#                  instead of building vaccel's from this checkout and fetching the rest
#   --extras LIST  vaccel's extras besides nvidia,amd (the management bindings, always in):
#                  enforce (device-node ACLs, builds against libacl1-dev), systemd (journal
#                  fields without Debian's python3-systemd), jupyter
#   --no-units     do not run `vaccel-brokerd install-units`
#   DESTDIR=DIR    (environment) stage everything under DIR, for a package: the venv is made
#                  there and its scripts name VENV; nothing outside DIR is written and
#                  systemd-sysusers does not run
#
# The development venv that `make demo` / `make test` build (/opt/vaccel-venv as root) is an
# editable install of the clone that built it: never run the service from it (install-units
# refuses to). Running this again replaces the installed version; the configuration in
# /etc/vaccel is kept.
set -euo pipefail

venv=/opt/vaccel
wheels=""
extras=""
units=1
while (($#)); do
    case $1 in
        --wheels) wheels=$(realpath "${2:?--wheels needs a folder}"); shift 2 ;;
        --extras) extras=${2:?--extras needs a list, e.g. enforce}; shift 2 ;;
        --no-units) units=0; shift ;;
        -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) venv=$1; shift ;;
    esac
done
destdir=${DESTDIR:-}
destdir=${destdir%/}
[[ -z $destdir ]] || destdir=$(realpath -m "$destdir")
if [[ $(id -u) != 0 && -z $destdir ]]; then
    echo "install.sh: run it as root: it installs a system service (sudo make install)" >&2
    exit 2
fi
# The management bindings always: pure Python, they load the driver's library only where it is.
requirement="vaccel[nvidia,amd${extras:+,$extras}]"
target=$destdir$venv  # where the files go; $venv is where they will be run from

# The wheels become code that root runs (the broker, install-units): take them only from a
# folder nobody else can write into or swap (issue 43). The folder and its wheels are root's
# and not group- or world-writable; each folder above it is root's and not writable by
# others, or sticky (/tmp: nobody else may rename what is root's there).
refuse_wheels() {
    echo "install.sh: refusing the wheels in $wheels: $1; use a folder only root can write (chown -R root:" \
         "$wheels && chmod -R go-w $wheels)" >&2
    exit 2
}
if [[ -n $wheels ]]; then
    [[ -d $wheels ]] || refuse_wheels "it is not a folder"
    for file in "$wheels" "$wheels"/*.whl; do
        [[ -e $file ]] || continue
        read -r owner mode < <(stat -c '%u %a' "$file")
        ((owner == 0)) || refuse_wheels "$file belongs to uid $owner"
        ((8#$mode & 8#022)) && refuse_wheels "$file is writable by its group or by everyone (mode $mode)"
    done
    above=$(dirname "$wheels")
    while :; do
        read -r owner mode < <(stat -c '%u %a' "$above")
        ((owner == 0)) || refuse_wheels "the folder above it, $above, belongs to uid $owner"
        if ((8#$mode & 8#022)) && ! ((8#$mode & 8#1000)); then
            refuse_wheels "the folder above it, $above, is writable by others (mode $mode)"
        fi
        [[ $above == / ]] && break
        above=$(dirname "$above")
    done
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ -z $wheels ]]; then
    # Built from a copy of the working tree, never in place: a stale build/ folder would
    # put removed modules into the wheel.
    repo=$(cd "$(dirname "$0")/.." && pwd)
    /usr/bin/python3 - "$repo" "$work/src" <<'EOF'
import shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2], ignore=shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", ".venv", ".cache"))
EOF
fi

echo "install.sh: installing into $target"
/usr/bin/python3 -m venv --system-site-packages "$target"
# A pip config may name local wheel folders that are absent: pip warns once per package
# about them (as in scripts/setup.sh). Real errors still show.
quiet_pip() { "$target/bin/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
pip=(quiet_pip install --quiet --disable-pip-version-check --no-cache-dir)
if [[ -n $wheels ]]; then
    pip+=(--no-index --find-links "$wheels")
else
    quiet_pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$work" "$work/src"
    wheels=$work
fi
wheel=$(compgen -G "$wheels/vaccel-*.whl" | sort -V | tail -n 1 || true)
if [[ -z $wheel ]]; then
    echo "install.sh: no vaccel wheel in $wheels" >&2
    exit 1
fi
# The same version number may carry other code (a newer commit): replace it, then add what it needs.
"${pip[@]}" --force-reinstall --no-deps "$wheel"
# --ignore-installed: every dependency goes into the venv, even one the build host's system
# site-packages happen to have (python3-yaml here, absent on the host that installs it).
"${pip[@]}" --ignore-installed "$requirement @ file://$wheel"
bash "$(dirname "$0")/launcher.sh" "$target"
"$target/bin/vaccel" --version
if ((units)); then
    if [[ -n $destdir ]]; then
        "$target/bin/vaccel-brokerd" install-units --destdir "$destdir"
    else
        "$venv/bin/vaccel-brokerd" install-units
    fi
fi

if [[ -n $destdir ]]; then
    # Staged: the scripts and the venv's own record name where it will run, not the stage;
    # the bytecode is compiled again with the final paths (tracebacks name real files).
    grep -rlF --null "$target" "$target/bin" "$target/pyvenv.cfg" | xargs -0 -r sed -i "s|$target|$venv|g"
    find "$target" -name __pycache__ -type d -prune -exec rm -rf {} +
    /usr/bin/python3 -m compileall -q -j 0 -s "$destdir" -p / "$target/lib" >/dev/null
fi
chmod -R a+rX "$target"

# Every user's `vaccel`; an existing file of another origin is left alone.
link=$destdir/usr/local/bin/vaccel
mkdir -p "$(dirname "$link")"
if [[ ! -e $link || -L $link ]]; then
    ln -sfn "$venv/bin/vaccel" "$link"
    echo "install.sh: $link -> $venv/bin/vaccel"
else
    echo "install.sh: kept $link (not a link); users can run $venv/bin/vaccel"
fi
