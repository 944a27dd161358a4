#!/bin/bash
# The boot test's scenario, run by vaccel-boot-test.service inside the booted container.
#
#   inside.sh OUT_DIR
#
# Each step is logged to OUT_DIR/steps.log as "ok NAME SECONDS" or "FAIL NAME rc=N"; the
# first failure ends the scenario. Whatever happened, the broker's journal (text and
# JSON) and the service's properties are written to OUT_DIR for the pytest side to check.
# The container has no network: the project is installed from the bound wheelhouse.
set -uo pipefail

out=${1:?usage: inside.sh OUT_DIR}
venv=/opt/vaccel
user=alice
: >"$out/steps.log"

step() {  # NAME COMMAND...: run one step, record it, stop the scenario on failure
    local name=$1 started rc
    shift
    started=$(date +%s%N)
    echo "== $name: $*" >>"$out/scenario.log"
    "$@" >>"$out/scenario.log" 2>&1
    rc=$?
    if ((rc != 0)); then
        echo "FAIL $name rc=$rc" >>"$out/steps.log"
        finish 1
    fi
    echo "ok $name $((($(date +%s%N) - started) / 1000000))ms" >>"$out/steps.log"
}

collect() {
    journalctl -u vaccel-brokerd --no-pager -o short-iso >"$out/journal.txt" 2>&1
    journalctl -u vaccel-brokerd --no-pager -o json >"$out/journal.json" 2>&1
    systemctl status vaccel-brokerd --no-pager -l >"$out/status.txt" 2>&1
    journalctl -b --no-pager -p warning >"$out/warnings.txt" 2>&1
}

finish() {
    collect
    echo "done $1" >>"$out/steps.log"
    exit "$1"
}

wait_for() {  # SECONDS COMMAND...: poll until COMMAND succeeds
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

system_up() {
    local state
    state=$(systemctl is-system-running --wait)
    echo "system: $state" | tee "$out/system-state.txt"
    # degraded is acceptable in a minimal container; starting/stopping/offline are not.
    [[ $state == running || $state == degraded ]]
}

install_project() {
    # The lab's install, as README says (sudo make install = scripts/install.sh), from the
    # wheelhouse: the container has no network. It runs install-units itself.
    bash /mnt/install.sh --wheels /mnt/wheels "$venv" | tee "$out/install.txt"
}

install_units() {
    # The unit runs the installed copy: a wheel in the venv, no checkout anywhere in the
    # container, and `vaccel` on every user's PATH.
    grep -qx "ExecStart=$venv/bin/vaccel-brokerd" /etc/systemd/system/vaccel-brokerd.service &&
        getent group vaccel-admin &&
        "$venv/bin/python" -c 'import brokerd, vaccel; print(brokerd.__file__, vaccel.__file__)' |
            tee "$out/installed-from.txt" &&
        grep -q "^$venv/lib/python3[.0-9]*/site-packages/brokerd/__init__.py $venv/lib/" "$out/installed-from.txt" &&
        test "$(readlink /usr/local/bin/vaccel)" = "$venv/bin/vaccel" &&
        runuser -u nobody -- vaccel --version | tee "$out/version.txt" | grep -q "$venv/lib"
}

configure() {
    cat >/etc/vaccel/inventory.yaml <<'EOF'
devices:
  - vendor: nvidia
    name: NVIDIA A100-SXM4-80GB
    uuid: GPU-6f1a0c2e-0000-0000-0000-000000000001
    pci_bus_id: "0000:07:00.0"
    memory_mib: 81920
    compute_capability: "8.0"
    driver_version: "535.54.03"
  - vendor: nvidia
    name: NVIDIA A100-SXM4-80GB
    uuid: GPU-6f1a0c2e-0000-0000-0000-000000000002
    pci_bus_id: "0000:0a:00.0"
    memory_mib: 81920
    compute_capability: "8.0"
    driver_version: "535.54.03"
EOF
    # The example config install-units wrote, with its documented inventory line enabled.
    sed -i 's|^# inventory = |inventory = |' /etc/vaccel/brokerd.toml &&
        grep -q '^inventory = "/etc/vaccel/inventory.yaml"' /etc/vaccel/brokerd.toml
}

start_broker() {
    systemctl daemon-reload &&
        systemctl start vaccel-brokerd &&
        systemctl is-active vaccel-brokerd &&
        test -S /run/vaccel/brokerd.sock &&
        systemctl show vaccel-brokerd -p MainPID --value >"$out/mainpid-before.txt" &&
        systemctl show vaccel-brokerd -p StatusText -p WatchdogUSec -p NotifyAccess \
            -p Type >"$out/props-started.txt"
}

lease_listed() {  # FILE: the lease id from alice's output is in `vaccel leases --all --json`
    local id
    id=$(head -n 1 "$out/client.out" 2>/dev/null)
    [[ -n $id ]] && "$venv/bin/vaccel" leases --all --json >"$1" && grep -q "$id" "$1"
}

start_client() {
    useradd --create-home --shell /bin/bash "$user" || return 1
    # An ordinary user, no environment from root: the client finds /run/vaccel/brokerd.sock
    # on its own. It holds the lease until the scenario creates the go file.
    runuser -u "$user" -- "$venv/bin/vaccel" run --gpus 1 -- sh -c \
        'echo "$VACCEL_LEASE_ID"; until [ -e /tmp/vaccel-boot-go ]; do sleep 0.2; done; echo done' \
        >"$out/client.out" 2>"$out/client.err" &
    echo $! >"$out/client.pid"
    wait_for 60 lease_listed "$out/leases-before-reload.json"
}

reload_broker() {
    systemctl reload vaccel-brokerd &&
        sleep 1 &&
        systemctl is-active vaccel-brokerd &&
        systemctl show vaccel-brokerd -p MainPID --value >"$out/mainpid-after.txt" &&
        cmp "$out/mainpid-before.txt" "$out/mainpid-after.txt" &&
        lease_listed "$out/leases-after-reload.json"
}

reload_invalid_config() {
    # A broken file is rejected with a log line; the broker keeps serving the old config.
    cp /etc/vaccel/brokerd.toml /etc/vaccel/brokerd.toml.good &&
        echo 'not_a_key = 1' >>/etc/vaccel/brokerd.toml &&
        systemctl reload vaccel-brokerd &&
        wait_for 30 journalctl -u vaccel-brokerd -q --no-pager --grep 'configuration rejected' &&
        systemctl is-active vaccel-brokerd &&
        lease_listed "$out/leases-after-bad-reload.json" &&
        mv /etc/vaccel/brokerd.toml.good /etc/vaccel/brokerd.toml
}

restart_broker() {
    # SIGTERM and a fresh process: the lease is on disk and comes back with its holder.
    systemctl restart vaccel-brokerd &&
        systemctl is-active vaccel-brokerd &&
        wait_for 30 lease_listed "$out/leases-after-restart.json"
}

end_lease() {
    local rc
    touch /tmp/vaccel-boot-go
    wait "$(cat "$out/client.pid")"
    rc=$?
    echo "$rc" >"$out/client.rc"
    ((rc == 0)) && grep -qx done "$out/client.out" &&
        wait_for 30 lease_gone
}

lease_gone() {
    "$venv/bin/vaccel" leases --all --json >"$out/leases-after-release.json" &&
        ! grep -q "$(head -n 1 "$out/client.out")" "$out/leases-after-release.json"
}

stop_broker() {
    systemctl stop vaccel-brokerd
    systemctl show vaccel-brokerd -p Result -p ExecMainStatus -p NRestarts >"$out/props-stopped.txt"
    grep -qx Result=success "$out/props-stopped.txt" &&
        grep -qx ExecMainStatus=0 "$out/props-stopped.txt" &&
        grep -qx NRestarts=0 "$out/props-stopped.txt"
}

step system-up system_up
step install-project install_project
step install-units install_units
step configure configure
step start start_broker
step lease start_client
step reload reload_broker
step reload-invalid reload_invalid_config
step restart restart_broker
step release end_lease
step stop stop_broker
finish 0
