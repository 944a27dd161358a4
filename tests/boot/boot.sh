#!/bin/bash
# Boot the cached root with a real systemd as PID 1 of a systemd-nspawn container and let
# vaccel-boot-test.service (inside.sh) run the scenario; it powers the container off.
#
#   boot.sh ROOT_TARBALL DEBS_DIR OUT_DIR [TIMEOUT_S]
#
# The recipe (measured on these machines, ../shared/notes/systemd-boot-test.md): a private
# mount namespace with a tmpfs over /run (the host's /run is on disk and nspawn keeps
# state there), a cgroup of our own that is removed afterwards, --register=no with
# --keep-unit (there is no host bus), --private-network (the container has only lo).
# The console log lands in OUT_DIR/console.log.
set -euo pipefail

tarball=${1:?usage: boot.sh ROOT_TARBALL DEBS_DIR OUT_DIR [TIMEOUT_S]}
debs=$(realpath "${2:?}")
out=$(realpath "${3:?}")
timeout_s=${4:-300}
here=$(dirname "$(realpath "$0")")
machine=vaccel-boot-$$

work=$(mktemp -d /var/tmp/vaccel-boot.XXXXXX)
cgroups=()

cleanup() {
    local dir
    # Depth first: nspawn leaves payload/ and supervisor/ below our cgroup.
    for dir in "${cgroups[@]}"; do
        [[ -d $dir ]] && find "$dir" -depth -type d -exec rmdir {} + 2>/dev/null || true
    done
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT

# A fresh copy of the cached root per run: the cache itself is never booted.
mkdir "$work/root"
zstd -dcq "$tarball" | tar -C "$work/root" --numeric-owner --xattrs -xf -

# Our own cgroup in every hierarchy that tracks processes (v2, or hybrid/v1 name=systemd).
add_cgroup() {  # MOUNTPOINT FIELD VALUE: the cgroup named in /proc/self/cgroup, plus ours
    local path
    path=$(awk -F: -v f="$2" -v v="$3" '$f == v { print $3 }' /proc/self/cgroup)
    cgroups+=("$1${path%/}/$machine")
    mkdir -p "${cgroups[-1]}"
}
if [[ $(stat -fc %T /sys/fs/cgroup) == cgroup2fs ]]; then
    add_cgroup /sys/fs/cgroup 1 0
else
    [[ -d /sys/fs/cgroup/systemd ]] && add_cgroup /sys/fs/cgroup/systemd 2 name=systemd
    [[ -d /sys/fs/cgroup/unified ]] && add_cgroup /sys/fs/cgroup/unified 1 0
fi

start=$(date +%s%N)
status=0
(
    for dir in "${cgroups[@]}"; do echo "$BASHPID" >"$dir/cgroup.procs"; done
    exec timeout --kill-after=15 "$timeout_s" \
        unshare --mount --propagation private -- bash -c '
            mount -t tmpfs -o mode=755 tmpfs /run
            exec "$@"' nspawn \
        systemd-nspawn -D "$work/root" -b -M "$machine" \
            --private-network --register=no --keep-unit --console=read-only \
            --bind-ro="$debs:/mnt/debs" \
            --bind-ro="$here:/mnt/boot" \
            --bind-ro="$here/../../scripts/install.sh:/mnt/install.sh" \
            --bind-ro="$here/../../scripts/launcher.sh:/mnt/launcher.sh" \
            --bind="$out:/mnt/out" \
            --bind-ro="$here/vaccel-boot-test.service:/etc/systemd/system/vaccel-boot-test.service" \
            systemd.wants=vaccel-boot-test.service
) </dev/null >"$out/console.log" 2>&1 || status=$?
end=$(date +%s%N)
echo "nspawn_exit=$status container_ms=$(((end - start) / 1000000))" >"$out/boot.txt"
exit "$status"
