#!/bin/bash
# The lab's service test, run by vaccel-boot-test.service inside the booted container: the
# project installed from its Debian package as a lab installs it, then every feature under
# the shipped unit, an upgrade holding leases, remove and purge.
#
#   inside.sh OUT_DIR        (/mnt/debs holds vaccel_*.deb and the upgrade, vaccel_*+boot1_*.deb)
#
# Each step is logged to OUT_DIR/steps.log as "ok NAME MS" or "FAIL NAME rc=N"; the first
# failure ends the scenario. Whatever happened, the broker's journal (text and JSON) and the
# service's properties are written to OUT_DIR for the pytest side to check. The container
# has no network: apt installs the package offline.
set -uo pipefail

out=${1:?usage: inside.sh OUT_DIR}
deb=$(ls /mnt/debs/vaccel_*.deb | grep -v +boot1)
upgrade=$(ls /mnt/debs/vaccel_*+boot1_*.deb)
user=alice
other=bob
nodes=/dev/vaccel-sim
mapping=/var/lib/dcgm-exporter/job-mapping
dropin=/etc/systemd/system/vaccel-brokerd.service.d/50-features.conf
export DEBIAN_FRONTEND=noninteractive
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
    [[ -f $out/holder.pid ]] && kill "$(cat "$out/holder.pid")" 2>/dev/null
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

as() {  # USER COMMAND...: an ordinary user's login-like run, no environment from root
    local who=$1
    shift
    runuser -u "$who" -- env -i PATH=/usr/bin:/bin HOME="/home/$who" "$@"
}

mainpid() { systemctl show vaccel-brokerd -p MainPID --value; }
this_broker() {  # the journal of the running broker process only
    journalctl -u vaccel-brokerd --no-pager -o cat _PID="$(mainpid)"
}

system_up() {
    local state
    state=$(systemctl is-system-running --wait)
    echo "system: $state" | tee "$out/system-state.txt"
    [[ $state == running || $state == degraded ]]
}

install_package() {
    # As the README says: apt installs the local file, offline (no package lists here).
    apt-get install -y --no-install-recommends "$deb" | tee "$out/install.txt"
}

installed() {
    # The service runs, enabled; everything the package promises is where it says.
    systemctl is-active vaccel-brokerd && systemctl is-enabled vaccel-brokerd &&
        test "$(command -v vaccel)" = /usr/bin/vaccel && test -x /usr/bin/vaccel-brokerd &&
        getent group vaccel &&
        test -f /usr/share/man/man1/vaccel.1.gz && test -f /usr/share/man/man8/vaccel-brokerd.8.gz &&
        test -f /usr/share/vaccel/proto/vaccel/v1/broker.proto &&
        compgen -G '/usr/share/vaccel/wheels/vaccel-*.whl' &&
        dpkg-query -W -f='${Conffiles}\n' vaccel | grep -q '/etc/vaccel/brokerd.toml' &&
        test -f "$dropin" && grep -q '^admin_group = "vaccel"' /etc/vaccel/brokerd.toml &&
        /opt/vaccel/bin/python3 -c 'import pynvml, posix1e; print("bindings: nvidia-ml-py, pylibacl")' &&
        test -d /opt/vaccel/lib/python3.11/site-packages/amdsmi &&
        bash -c 'source /usr/share/bash-completion/completions/vaccel; COMP_WORDS=(vaccel sta); COMP_CWORD=1;
                 _vaccel; echo "completion: ${COMPREPLY[*]}"; [[ ${COMPREPLY[*]} == status ]]' &&
        { vaccel-brokerd --probe >"$out/probe.txt" 2>&1 || true; } && grep -q 'libnvidia-ml.so.1' "$out/probe.txt" &&
        useradd --create-home --shell /bin/bash "$user" && useradd --create-home --shell /bin/bash "$other" &&
        as "$user" vaccel --version | tee "$out/version.txt" | grep -q /opt/vaccel/lib &&
        as "$user" vaccel status >"$out/status-first.txt"
}

client_wheel() {
    # An ordinary user's own environment: the shipped client wheel, offline, pulls only what the
    # client needs (no aiohttp, no prometheus-client) and talks to the system broker.
    as "$user" python3 -m venv "/home/$user/env" &&
        as "$user" "/home/$user/env/bin/pip" install --quiet --no-index --find-links /mnt/debs/wheels \
            /usr/share/vaccel/wheels/vaccel-*.whl &&
        as "$user" "/home/$user/env/bin/pip" list --format=freeze | tee "$out/client-env.txt" &&
        ! grep -qiE '^(aiohttp|prometheus.client|grpcio.health|grpcio.reflection)==' "$out/client-env.txt" &&
        as "$user" "/home/$user/env/bin/vaccel" status | tee "$out/status-client-env.txt" | grep -q 'No devices\|GPU'
}

configure() {
    # Simulated GPUs with real character nodes (the numbers of /dev/full, /dev/zero and
    # /dev/random), still open to everyone as before enforcement; every feature turned on.
    mkdir -p "$nodes" &&
        mknod -m 0666 "$nodes/gpu0" c 1 7 && mknod -m 0666 "$nodes/gpu1" c 1 5 &&
        mknod -m 0666 "$nodes/gpu2" c 1 8 || return 1
    {
        echo "devices:"
        for n in 0 1 2; do
            echo "  - {vendor: nvidia, name: NVIDIA A100-SXM4-80GB, uuid: GPU-6f1a0c2e-0000-0000-0000-00000000000$n,"
            echo "     memory_mib: 81920, compute_capability: \"8.0\", device_nodes: [$nodes/gpu$n]}"
        done
    } >/etc/vaccel/inventory.yaml
    sed -i -e 's|^# inventory = |inventory = |' \
        -e 's|^mode = "off"|mode = "acl"|' \
        -e 's|^listen = "" *# e.g. "127.0.0.1:9464".*|listen = "127.0.0.1:9464"|' \
        -e "s|^hpc_job_mapping_dir = \"\" .*|hpc_job_mapping_dir = \"$mapping\"|" \
        -e 's|^listen = "" *# e.g. "127.0.0.1:8642".*|listen = "127.0.0.1:8642"|' /etc/vaccel/brokerd.toml &&
        grep -c -e '^inventory = ' -e '^mode = "acl"' -e '^listen = "127' -e "^hpc_job_mapping_dir = \"$mapping\"" \
            /etc/vaccel/brokerd.toml | grep -qx 5
}

hold_before() {
    # bob opens gpu1 while its node is still open to all, and keeps it; then the admin closes
    # the nodes (docs/enforcement.md: 0660 root:root).
    as "$other" python3 -c "import os, time; fd = os.open('$nodes/gpu1', os.O_RDWR); print('open', flush=True);
time.sleep(600)" >"$out/holder.out" &
    echo $! >"$out/holder.pid"
    wait_for 30 grep -qx open "$out/holder.out" && chmod 0660 "$nodes"/gpu*
}

refused_four() { [[ $(this_broker | grep -c ' refused at reload: ') -ge 4 ]]; }

reload_refuses() {
    # The running unit (no drop-in for these yet) blocks all four: each is refused in one line
    # naming the setting, and ExecReload= wrote the drop-in that grants them.
    systemctl reload vaccel-brokerd && wait_for 30 refused_four || return 1
    this_broker | grep ' refused at ' | tee "$out/refusals.txt"
    grep -q 'web.listen refused at reload: .*(RestrictAddressFamilies= lacks AF_INET AF_INET6 AF_NETLINK)' "$out/refusals.txt" &&
        grep -q 'metrics.listen refused at reload: .*RestrictAddressFamilies= lacks AF_INET' "$out/refusals.txt" &&
        grep -q 'enforce.mode refused at reload: .*(CapabilityBoundingSet= lacks CAP_SYS_PTRACE CAP_DAC_READ_SEARCH)' \
            "$out/refusals.txt" &&
        grep -q "metrics.hpc_job_mapping_dir refused at reload: .*(ReadWritePaths= lacks $mapping)" "$out/refusals.txt" &&
        ! this_broker | grep -q 'dashboard on' &&
        cp "$dropin" "$out/dropin.conf" &&
        grep -qx 'PrivateNetwork=no' "$dropin" && grep -qx "ReadWritePaths=$mapping" "$dropin" &&
        grep -qx 'CapabilityBoundingSet=CAP_SYS_PTRACE CAP_DAC_READ_SEARCH' "$dropin"
}

started_with_features() {
    this_broker >"$out/journal-features.txt"
    grep -q 'dashboard on http://127.0.0.1:8642/' "$out/journal-features.txt" &&
        grep -q 'metrics served on http://127.0.0.1:9464/metrics' "$out/journal-features.txt" &&
        grep -q 'enforcement on: 3 device(s) gated' "$out/journal-features.txt"
}

restart_granted() {
    # What the reload said to do: the drop-in applies, every feature starts, none is refused.
    systemctl daemon-reload && systemctl restart vaccel-brokerd && systemctl is-active vaccel-brokerd &&
        wait_for 30 started_with_features && ! grep -q ' refused at ' "$out/journal-features.txt" &&
        systemctl show vaccel-brokerd -p CapabilityBoundingSet -p RestrictAddressFamilies -p PrivateNetwork \
            >"$out/props-features.txt"
}

web_metrics() {
    # Both answer an ordinary user over TCP.
    as "$user" python3 -c "
import urllib.request
page = urllib.request.urlopen('http://127.0.0.1:8642/', timeout=10)
print('dashboard', page.status)
metrics = urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=10).read().decode()
print('metrics', len(metrics), 'bytes')
assert page.status == 200 and 'vaccel_' in metrics
" | tee "$out/web-metrics.txt"
}

delegate_unit() {  # NAME: the installed unit's sandbox, running tests/boot/delegate_check.py once
    sed -e "s|^ExecStart=.*|ExecStart=/opt/vaccel/bin/python3 /mnt/boot/delegate_check.py $user 8642|" \
        -e 's/^Type=notify/Type=oneshot/' -e '/^ExecReload=/d' -e '/^WatchdogSec=/d' -e '/^NotifyAccess=/d' \
        -e '/^Restart/d' -e '/^RuntimeDirectory/d' -e '/^StateDirectory/d' -e '/^ConfigurationDirectory/d' \
        /lib/systemd/system/vaccel-brokerd.service >"/etc/systemd/system/$1.service"
}

delegate_needs() {
    # Slurm's delegate mode without a Slurm: the shipped unit's sandbox blocks what it does
    # (the daemon's detection names all three settings), the drop-in written for
    # `[slurm] mode = "delegate"` grants it: a command runs as alice as salloc would, and a
    # TCP port answers. The broker itself is not touched.
    local granted=vaccel-delegate-granted
    delegate_unit vaccel-delegate-bare && delegate_unit "$granted" && mkdir -p "/etc/systemd/system/$granted.service.d" &&
        /opt/vaccel/bin/python3 -c 'from brokerd.config.loader import Config
from brokerd.daemon.unit_needs import render_dropin
print(render_dropin(Config(slurm_mode="delegate")), end="")' >"/etc/systemd/system/$granted.service.d/50-features.conf" &&
        systemctl daemon-reload || return 1
    systemctl start vaccel-delegate-bare && return 1  # blocked: it must fail
    systemctl start "$granted" || true
    journalctl -u vaccel-delegate-bare -o cat --no-pager | tee "$out/delegate-bare.txt"
    journalctl -u "$granted" -o cat --no-pager | tee "$out/delegate-granted.txt"
    grep -qF "detected: ['CapabilityBoundingSet= lacks CAP_SETUID CAP_SETGID', 'RestrictAddressFamilies= lacks AF_INET AF_INET6', 'SystemCallFilter= blocks @setuid capset']" \
        "$out/delegate-bare.txt" &&
        grep -qx "detected: \[\]" "$out/delegate-granted.txt" &&
        grep -qx "as $user: $user" "$out/delegate-granted.txt" &&
        grep -qx "tcp 127.0.0.1:8642: connected" "$out/delegate-granted.txt" &&
        [[ $(systemctl show -p Result --value "$granted") == success ]]
}

gpu1_busy() {
    as "$user" vaccel status >"$out/status-busy.txt" && grep '^gpu1 ' "$out/status-busy.txt" | grep -q ' busy'
}

enforce_busy() {
    # bob's process holds gpu1 without a lease: busy; a request for it is refused naming
    # the holder's pid, and the journal names bob. Nobody is granted it.
    local pid
    pid=$(pgrep -u "$other" -f 'vaccel-sim/gpu1') || return 1
    wait_for 30 gpu1_busy || return 1
    if as "$user" vaccel run --device gpu1 --no-wait -- true >"$out/busy-refused.out" 2>"$out/busy-refused.err"; then
        return 1
    fi
    cat "$out/busy-refused.err"
    grep -q "pid $pid" "$out/busy-refused.err" &&
        this_broker | grep "pid $pid" | grep -q "$other's pid $pid .* holds $nodes/gpu1 without a lease"
}

lease_listed() {  # FILE: the lease id from alice's output is in `vaccel leases --all --json`
    local id
    id=$(head -n 1 "$out/client.out" 2>/dev/null)
    [[ -n $id ]] && vaccel leases --all --json >"$1" && grep -q "$id" "$1"
}

lease() {
    # alice holds gpu0 through `vaccel run`: its node opens for her (the ACL), not for bob.
    as "$user" vaccel run --gpus 1 -- sh -c "echo \"\$VACCEL_LEASE_ID\";
        python3 -c 'import os; os.close(os.open(\"$nodes/gpu0\", os.O_RDWR)); print(\"opened gpu0\")';
        until [ -e /tmp/vaccel-boot-go ]; do sleep 0.2; done; echo done" >"$out/client.out" 2>"$out/client.err" &
    echo $! >"$out/client.pid"
    wait_for 60 lease_listed "$out/leases-before-reload.json" &&
        wait_for 30 grep -qx 'opened gpu0' "$out/client.out" &&
        as "$other" python3 -c "import os
try:
    os.open('$nodes/gpu0', os.O_RDWR)
except PermissionError:
    print('bob: gpu0 refused')
else:
    raise SystemExit('bob opened gpu0')"
}

mapping_written() { [[ "$(cat "$mapping/0" 2>/dev/null)" == "$(head -n 1 "$out/client.out")" ]]; }

job_mapping() {
    # dcgm-exporter's folder: gpu0's file names alice's lease.
    wait_for 30 mapping_written && ls -l "$mapping" | tee "$out/job-mapping.txt"
}

queued() { vaccel status --json >"$out/status-queue.json" && grep -q "\"$other\"" "$out/status-queue.json" &&
               python3 -c "import json, sys; q = json.load(open(sys.argv[1]))['queue']; sys.exit(len(q) != 1)" \
                   "$out/status-queue.json"; }

reserve_and_queue() {
    # A reservation (alice, gpu2) and a queued request (bob: every device is taken).
    as "$user" vaccel reserve --device gpu2 --time 1h --json >"$out/reservation.json" &&
        python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['lease_id'])" "$out/reservation.json" \
            >"$out/reservation.id" || return 1
    as "$other" vaccel run --gpus 1 -- true >"$out/queued.out" 2>"$out/queued.err" &
    echo $! >"$out/queued.pid"
    wait_for 60 queued
}

reload_broker() {
    systemctl show vaccel-brokerd -p MainPID --value >"$out/mainpid-before.txt" &&
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

kept_across_upgrade() {
    lease_listed "$out/leases-after-upgrade.json" &&
        grep -q "$(cat "$out/reservation.id")" "$out/leases-after-upgrade.json" && queued
}

upgrade_package() {
    # A newer version over the running service, with a lease, a reservation and a queued
    # request held: the restart is invisible to all three.
    apt-get install -y --no-install-recommends "$upgrade" | tee "$out/upgrade.txt" &&
        dpkg-query -W -f='${Version}\n' vaccel | tee "$out/version-upgraded.txt" | grep -q '+boot1$' &&
        systemctl is-active vaccel-brokerd && wait_for 30 kept_across_upgrade &&
        kill -0 "$(cat "$out/queued.pid")"
}

end_lease() {
    local rc
    touch /tmp/vaccel-boot-go
    wait "$(cat "$out/client.pid")"
    rc=$?
    echo "$rc" >"$out/client.rc"
    ((rc == 0)) && grep -qx done "$out/client.out" || return 1
    # bob's queued request, kept across the upgrade, gets gpu0 and runs.
    wait "$(cat "$out/queued.pid")"
    rc=$?
    echo "$rc" >"$out/queued.rc"
    ((rc == 0)) && as "$user" vaccel release "$(cat "$out/reservation.id")" && wait_for 30 lease_gone
}

lease_gone() {
    vaccel leases --all --json >"$out/leases-after-release.json" &&
        ! grep -q "$(head -n 1 "$out/client.out")" "$out/leases-after-release.json"
}

stop_broker() {
    kill "$(cat "$out/holder.pid")"
    systemctl stop vaccel-brokerd
    systemctl show vaccel-brokerd -p Result -p ExecMainStatus -p NRestarts >"$out/props-stopped.txt"
    grep -qx Result=success "$out/props-stopped.txt" &&
        grep -qx ExecMainStatus=0 "$out/props-stopped.txt" &&
        grep -qx NRestarts=0 "$out/props-stopped.txt"
}

remove_package() {
    # Remove: the service is gone and disabled; state, config and the drop-in stay.
    systemctl start vaccel-brokerd && collect && apt-get remove -y vaccel | tee "$out/remove.txt" &&
        ! systemctl is-active vaccel-brokerd && ! test -e /usr/bin/vaccel &&
        test -f /var/lib/vaccel/leases.db -o -d /var/lib/vaccel && test -f /etc/vaccel/brokerd.toml &&
        test -f "$dropin" && ls -A /var/lib/vaccel | tee "$out/state-after-remove.txt" | grep -q .
}

purge_package() {
    apt-get purge -y vaccel | tee "$out/purge.txt" &&
        ! test -e /var/lib/vaccel && ! test -e /etc/vaccel && ! test -e "$dropin" && ! test -e /opt/vaccel
}

make_install() {
    # A host without dpkg: `sudo make install` (scripts/install.sh), offline from the same
    # wheels (/mnt/debs/wheels: the dependencies' and the package's own vaccel wheel).
    bash /mnt/install.sh --wheels /mnt/debs/wheels /opt/vaccel | tee "$out/make-install.txt" &&
        grep -qx 'ExecStart=/opt/vaccel/bin/vaccel-brokerd' /etc/systemd/system/vaccel-brokerd.service &&
        test -f "$dropin" && getent group vaccel-admin &&
        test "$(readlink /usr/local/bin/vaccel)" = /opt/vaccel/bin/vaccel &&
        /opt/vaccel/bin/python3 -c 'import pynvml' && test -d /opt/vaccel/lib/python3.11/site-packages/amdsmi &&
        systemctl daemon-reload && systemctl enable --now vaccel-brokerd && systemctl is-active vaccel-brokerd &&
        as "$user" /usr/local/bin/vaccel status | tee "$out/status-make-install.txt"
}

step system-up system_up
step install-package install_package
step installed installed
step client-wheel client_wheel
step configure configure
step hold-before hold_before
step reload-refuses reload_refuses
step restart-granted restart_granted
step web-metrics web_metrics
step delegate-needs delegate_needs
step enforce-busy enforce_busy
step lease lease
step job-mapping job_mapping
step reserve-and-queue reserve_and_queue
step reload reload_broker
step reload-invalid reload_invalid_config
step restart restart_broker
step upgrade upgrade_package
step release end_lease
step stop stop_broker
step remove remove_package
step purge purge_package
step make-install make_install
finish 0
