#!/usr/bin/env bash
# The GPU checks of issues 3 and 5, as one script for a lent GPU machine (run from the
# repository root; writes results under ${OUT:-./gpu-check-out}):
#   1. install the project into a fresh venv (torch from the machine's index: a GPU build),
#   2. `vaccel-brokerd --probe --json` on the real devices -> probe.json (keep it as a fixture:
#      tests/fixtures/probes/nvml_<gpu>_real.json),
#   3. start the daemon on real probing, lease one GPU with `vaccel run`, and show that torch
#      sees exactly the leased device (its UUID matches the lease),
#   4. the accelerator check: fp32 / fp16+GradScaler / bf16 step time and peak memory,
#   5. containers (issue 34), where the machine has them: `vaccel run -- docker run` gives the
#      container exactly the leased GPU with Docker's `--gpus "device=UUID"` (the NVIDIA
#      Container Toolkit's runtime), `vaccel run -- podman run` with its CDI name
#      (nvidia.com/gpu=UUID, a spec from `nvidia-ctk cdi generate`), and a plain
#      `docker run --gpus 1` that reaches no broker takes the GPU it was given as its lease.
#      An engine or toolkit the machine lacks is skipped and said so; nothing is installed for it.
#      Then (issue 42) the next-morning `docker start` of a container of an ended lease, while
#      another lease holds its GPU: the broker stops it (the time is printed), and
#      `vaccel run -- docker start NAME` runs it again on its own GPU under a new lease.
#   6. memory shares (issue 35): the daemon again with gpu0 shared by memory; two processes
#      with 8 GiB shares of it, one within its share, one allocating past it through torch
#      (scripts/gpu_check_share.py): the allocator refuses past the cap, and the one that
#      bypasses the cap is warned, then stopped, its lease ended over_budget; the other
#      finishes untouched. Also measures the CUDA context outside the allocator.
#   0. the package (issue 41), where the machine has dpkg and one was built in this checkout
#      (`make deb` before the run: the machine reaches nothing): installed with apt, offline,
#      `vaccel-brokerd --probe` from the package on the real GPU -> package-probe.txt/.json (the
#      packaged NVML binding against the real driver), then purged, leaving the machine as found.
# Never changes GPU settings (MIG mode included: a GPU in MIG mode is leased by instance,
# and step 3 then leases an instance). Exits non-zero when a check fails.
set -euo pipefail
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
deb=$(compgen -G "$PWD/dist/vaccel_*.deb" | sort -V | tail -n 1 || true)
if [[ -n $deb ]] && command -v dpkg >/dev/null && [[ $(id -u) == 0 ]]; then
    if DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$deb" >"$OUT/package-install.txt" 2>&1
    then
        /usr/bin/vaccel-brokerd --probe | tee "$OUT/package-probe.txt"
        /usr/bin/vaccel-brokerd --probe --json >"$OUT/package-probe.json"
        DEBIAN_FRONTEND=noninteractive apt-get purge -y vaccel >>"$OUT/package-install.txt" 2>&1
    else
        echo "package: $deb does not install here (see package-install.txt); the checks go on without it"
    fi
else
    echo "package: skipped (needs dpkg, root and a dist/vaccel_*.deb from make deb)"
fi

VENV=$(mktemp -d /tmp/vaccel-gpu-venv.XXXX)
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch nvidia-ml-py "$PWD" 2>&1 | tail -2
export PATH="$VENV/bin:$PATH"

vaccel-brokerd --probe --json | tee "$OUT/probe.json"
vaccel-brokerd --probe | tee "$OUT/probe.txt"

WORK=$(mktemp -d /tmp/vaccel-gpu-broker.XXXX)
export VACCEL_SOCKET=$WORK/brokerd.sock
vaccel-brokerd --socket "$VACCEL_SOCKET" --state-dir "$WORK/state" >"$OUT/brokerd.log" 2>&1 &
BROKER=$!
trap 'kill $BROKER 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$VACCEL_SOCKET.id" ] && break; sleep 0.1; done
vaccel status | tee "$OUT/status.txt"

vaccel run --gpus 1 -- python - <<'PY' | tee "$OUT/lease.txt"
import os, torch, pynvml
leased = os.environ["CUDA_VISIBLE_DEVICES"]
assert torch.cuda.device_count() == 1, torch.cuda.device_count()
props = torch.cuda.get_device_properties(0)
uuid = "GPU-" + str(props.uuid)
print("lease", os.environ["VACCEL_LEASE_ID"], "CUDA_VISIBLE_DEVICES", leased)
print("torch sees", torch.cuda.device_count(), "device:", props.name, uuid)
assert uuid == leased, (uuid, leased)
x = torch.randn(4096, 4096, device="cuda"); print("matmul ok", float((x @ x).abs().mean()))
PY

vaccel run --gpus 1 -- python scripts/gpu_check_accelerator.py --markdown | tee "$OUT/accelerator.md"

# 5. Containers. The image borrows the host's /usr read-only (as the tests' image does: no
# registry), so the driver's libraries and nvidia-smi are the host's; the venv is mounted at
# its own path. What a container sees of the GPUs: nvidia-smi's list and torch's count.
SEEN='import os, subprocess, torch; print(torch.cuda.device_count(), subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU "), os.environ.get("VACCEL_LEASE_ID", ""))'
skeleton_image() {  # $1: the engine's program; imports vaccel-hostusr:latest
    local skel; skel=$(mktemp -d /tmp/vaccel-gpu-skel.XXXX)
    mkdir -p "$skel"/{usr,etc,proc,sys,dev,run,root,sbin,tmp}; chmod 1777 "$skel/tmp"
    for d in bin lib lib64; do ln -s "usr/$d" "$skel/$d"; done
    printf 'root:x:0:0:root:/root:/bin/sh\n' >"$skel/etc/passwd"; printf 'root:x:0:\n' >"$skel/etc/group"
    tar --numeric-owner -C "$skel" -c . | "$1" import --change 'CMD ["/bin/sh"]' - vaccel-hostusr:latest >/dev/null
    rm -rf "$skel"
}
check_seen() {  # $1: what the container printed, $2: the lease expected ("" none)
    read -r torch_count smi_count lease_id <<<"$1"
    [ "$torch_count" = 1 ] && [ "$smi_count" = 1 ] && [ "${lease_id:-}" = "$2" ] \
        || { echo "containers: expected 1 GPU seen by torch and nvidia-smi, lease '$2'; got: $1" >&2; exit 1; }
}
MOUNTS=(-v /usr:/usr:ro -v "$VENV:$VENV:ro" --network none)
if command -v docker >/dev/null && docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q nvidia; then
    skeleton_image docker
    WORK_CT=$(mktemp -d /tmp/vaccel-gpu-ct.XXXX)
    printf '[containers]\ndocker = "/run/docker.sock"\n' >"$WORK_CT/brokerd.toml"
    kill $BROKER; wait $BROKER 2>/dev/null || true
    vaccel-brokerd --config "$WORK_CT/brokerd.toml" --socket "$VACCEL_SOCKET" --state-dir "$WORK/state" \
        >>"$OUT/brokerd.log" 2>&1 &
    BROKER=$!
    for _ in $(seq 100); do [ -S "$VACCEL_SOCKET.id" ] && break; sleep 0.1; done
    out=$(vaccel run --gpus 1 -- docker run --rm "${MOUNTS[@]}" vaccel-hostusr:latest "$VENV/bin/python" -c "$SEEN" \
          2>"$OUT/docker-run.err")
    lease=$(sed -n 's/^vaccel: lease \(l-[0-9a-f]*\).*/\1/p' "$OUT/docker-run.err" | head -1)
    echo "vaccel run -- docker run: $out" | tee "$OUT/containers.txt"
    check_seen "$out" "$lease"
    out=$(docker run --rm --gpus 1 "${MOUNTS[@]}" -e VACCEL_SOCKET=/nonexistent.sock vaccel-hostusr:latest \
          "$VENV/bin/python" -c "import vaccel
with vaccel.lease() as held:
    print(held.id, len(held.devices), held.simulated)")
    echo "docker run --gpus 1, no broker: $out" | tee -a "$OUT/containers.txt"
    case "$out" in container-*" 1 False") ;; *) echo "containers: the GPU given is not the lease: $out" >&2; exit 1;; esac
    # 5b. Containers after their lease (issue 42): a container made under a lease (its GPU baked in
    # as --gpus "device=UUID"), its lease ended, started again the next morning while another lease
    # holds that GPU, is stopped by the broker; `vaccel run -- docker start NAME` is the way back.
    docker rm -f vaccel-nb >/dev/null 2>&1 || true
    vaccel run --gpus 1 -- docker run -d --name vaccel-nb "${MOUNTS[@]}" vaccel-hostusr:latest sleep 600 \
        >/dev/null 2>"$OUT/nb.err"
    old=$(sed -n 's/^vaccel: lease \(l-[0-9a-f]*\).*/\1/p' "$OUT/nb.err" | head -1)
    uuid=$(docker inspect --format '{{index .Config.Labels "org.vaccel.devices"}}' vaccel-nb)
    docker inspect --format '{{json .HostConfig.DeviceRequests}}' vaccel-nb | grep -q "$uuid" \
        || { echo "containers: vaccel-nb was not given $uuid with --gpus" >&2; exit 1; }
    docker stop vaccel-nb >/dev/null
    vaccel run --device "$uuid" -- sleep 600 2>/dev/null & OTHER=$!
    for _ in $(seq 100); do vaccel status --json | grep -q "\"lease_id\": \"l-" && break; sleep 0.1; done
    began=$(date +%s.%N); docker start vaccel-nb >/dev/null; docker wait vaccel-nb >/dev/null; ended=$(date +%s.%N)
    sleep 1  # the status cache
    vaccel status --json | python3 -c "import json, sys
stops = [c for c in json.load(sys.stdin)['stopped_containers'] if c['name'] == 'vaccel-nb']
assert stops and stops[0]['lease_id'] == '$old', stops" \
        || { echo "containers: the next-morning start of vaccel-nb was not stopped as lease $old's" >&2; exit 1; }
    kill -0 $OTHER || { echo "containers: the other lease on $uuid did not survive" >&2; exit 1; }
    echo "next-morning docker start on $uuid: stopped $(python3 -c "print(round($ended - $began, 3))") s after" \
         "docker start was called; the other lease untouched" | tee -a "$OUT/containers.txt"
    kill $OTHER; wait $OTHER 2>/dev/null || true
    vaccel run -- docker start vaccel-nb 2>"$OUT/nb-again.err"
    again=$(sed -n 's/^vaccel: lease \(l-[0-9a-f]*\).*/\1/p' "$OUT/nb-again.err" | head -1)
    out=$(docker exec vaccel-nb "$VENV/bin/python" -c "$SEEN")
    echo "vaccel run -- docker start vaccel-nb: lease $again, inside: $out" | tee -a "$OUT/containers.txt"
    check_seen "$out" "$old"  # the old lease's id is baked into the container's variables; the GPU is its own
    vaccel release "$again" >/dev/null; docker wait vaccel-nb >/dev/null; docker rm vaccel-nb >/dev/null
else
    echo "containers: no docker with the NVIDIA runtime here: --gpus not checked" | tee "$OUT/containers.txt"
fi
if command -v podman >/dev/null && grep -qs 'nvidia.com/gpu' /etc/cdi/*.yaml /var/run/cdi/*.yaml; then
    skeleton_image podman
    out=$(vaccel run --gpus 1 -- podman run --rm "${MOUNTS[@]}" localhost/vaccel-hostusr:latest "$VENV/bin/python" \
          -c "$SEEN" 2>"$OUT/podman-run.err")
    lease=$(sed -n 's/^vaccel: lease \(l-[0-9a-f]*\).*/\1/p' "$OUT/podman-run.err" | head -1)
    echo "vaccel run -- podman run (CDI): $out" | tee -a "$OUT/containers.txt"
    check_seen "$out" "$lease"
else
    echo "containers: no podman with an NVIDIA CDI spec here: CDI names not checked" | tee -a "$OUT/containers.txt"
fi
# 6. Memory shares: gpu0 shared by memory, one share within, one past its budget.
kill "$BROKER"; wait "$BROKER" || true
rm -f "$VACCEL_SOCKET" "$VACCEL_SOCKET.id"
cat >"$WORK/share.toml" <<'TOML'
[probe]
refresh_interval = "2s"
[sharing]
devices = ["gpu0"]
over_budget_grace = "10s"
TOML
vaccel-brokerd --config "$WORK/share.toml" --socket "$VACCEL_SOCKET" --state-dir "$WORK/state" \
  >>"$OUT/brokerd.log" 2>&1 &
BROKER=$!
for _ in $(seq 100); do [ -S "$VACCEL_SOCKET.id" ] && break; sleep 0.1; done
vaccel run --memory 8GiB -- python scripts/gpu_check_share.py --role within --hold 60 >"$OUT/share-within.txt" 2>&1 &
WITHIN=$!
vaccel run --memory 8GiB --signal none -- python scripts/gpu_check_share.py --role past >"$OUT/share-past.txt" 2>&1 &
PAST=$!
sleep 8
vaccel status | tee "$OUT/share-status.txt"
set +e
wait "$PAST"; PAST_RC=$?
wait "$WITHIN"; WITHIN_RC=$?
set -e
cat "$OUT/share-within.txt" "$OUT/share-past.txt"
vaccel leases --ended --json >"$OUT/share-leases.json"
grep -q "capped as it should be" "$OUT/share-past.txt"
grep -q "over its share" "$OUT/share-past.txt"
[ "$PAST_RC" -eq 143 ] || { echo "share past its budget: exit $PAST_RC, expected 143 (stopped)"; exit 1; }
[ "$WITHIN_RC" -eq 0 ] || { echo "share within its budget: exit $WITHIN_RC, expected 0"; exit 1; }
python - "$OUT/share-leases.json" <<'PY'
import json, sys
states = sorted(lease["state"] for lease in json.load(open(sys.argv[1]))["leases"])
print("share leases ended:", states)
assert "over_budget" in states, states
PY
echo "gpu check: all passed; results in $OUT"
