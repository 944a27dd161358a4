"""The main job: a broker on a simulated 4-GPU lab server, with several students' training
scripts contending for its GPUs, so a newcomer sees what vaccel does on a shared server.

    python scripts/demo.py            # about half a minute on a 2-core machine
    python scripts/demo.py --quick    # fewer epochs
    python scripts/demo.py --web 127.0.0.1:8642   # and watch it on the web dashboard
    python scripts/demo.py --quick --screenshot docs/dashboard.png   # the README's picture

Everything is real except the devices: a real vaccel-brokerd on a real Unix socket, real
`vaccel run` clients, real torch training (on the CPU, since the GPUs are simulated). Run
as root, every student is a real Unix user (demo-alice, ...), created for the demo and
removed after it, so `vaccel status` and the queue show their names and the kernel, not
the client, says who is asking. Run as anyone else, every student is you.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_cast import ROOT, Cast

INVENTORY = ROOT / "examples" / "lab-server.yaml"
CONFIG = """
[leases]
heartbeat_ttl = "10s"
[probe]
refresh_interval = "5s"
"""
# What grace's job needs: a Hopper-class GPU. The lab server has none, so the broker
# refuses her at once instead of letting her wait for a device that can never come.
NEEDS_H100 = "required_features:\n  - gpu_compute_capability: sm_90\n"


@dataclass
class Job:
    """One student's command. `start` is seconds after the broker came up."""

    name: str
    start: float
    args: list[str]
    command: list[str]
    submitted: float = 0.0
    granted: float = 0.0
    finished: float = 0.0
    exit_code: int | None = None
    proc: subprocess.Popen[str] | None = None
    lease_id: str = ""
    result: str = ""
    lines: list[str] = field(default_factory=list)


def jobs(epochs: int, stage: Path) -> list[Job]:
    py = sys.executable
    train = [py, str(stage / "examples" / "train.py"), "--epochs", str(epochs)]
    ddp = [py, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(stage / "examples" / "train_ddp.py"),
           "--epochs", str(epochs)]
    return [
        Job("alice", 0.0, ["--gpus", "2"], ddp),
        # bob trains longest: the demo kills him half-way to show the hand-over.
        Job("bob", 0.5, ["--gpus", "1"], [*train[:-1], str(epochs * 4), "--seed", "1"]),
        Job("carol", 1.0, ["--gpus", "1", "--min-memory", "60GiB"], [*train, "--seed", "2"]),
        Job("dave", 1.5, ["--gpus", "2"], [*train, "--seed", "3"]),
        Job("erin", 2.0, ["--gpus", "1"], [*train, "--seed", "4"]),
        Job("frank", 3.0, ["--gpus", "1", "--no-wait"], [*train, "--seed", "5"]),
        Job("grace", 3.5, ["--gpus", "1", "--contract", str(stage / "needs-h100.yaml")], [*train, "--seed", "6"]),
    ]


class Demo:
    def __init__(self, cast: Cast, socket: Path, web_url: str = "") -> None:
        self.cast = cast
        self.socket = socket
        self.web_url = web_url
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def say(self, who: str, text: str) -> None:
        with self.lock:
            print(f"{time.monotonic() - self.t0:6.1f}s  {who:<10} {text}", flush=True)

    def label(self, name: str) -> str:
        """A student as the broker names them: the real Unix user (demo-alice) when there is one."""
        return self.cast.user(name) if self.cast.real_users else name

    def vaccel(self, who: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vaccel.cli", *args], capture_output=True, text=True,
                              timeout=60, **self.cast.popen_args(who, self.socket))  # type: ignore[arg-type]

    def run_job(self, job: Job) -> None:
        time.sleep(job.start)
        job.submitted = time.monotonic()
        shown = " ".join(Path(c).name if "/" in c else c for c in job.command[:4])
        who = self.label(job.name)
        self.say(who, f"$ vaccel run {' '.join(Path(a).name for a in job.args)} -- {shown} ...")
        job.proc = subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", *job.args, "--", *job.command],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    **self.cast.popen_args(job.name, self.socket))  # type: ignore[arg-type]
        assert job.proc.stdout is not None
        for line in job.proc.stdout:
            line = line.rstrip()
            job.lines.append(line)
            if line.startswith("vaccel: lease") and ": gpu" in line and not job.granted:
                job.granted = time.monotonic()
                job.lease_id = line.split()[2].rstrip(":")
                self.say(who, line.removeprefix("vaccel: "))
            elif line.startswith(("vaccel: waiting", "[ERROR]")):
                self.say(who, line.removeprefix("vaccel: "))
            elif line.startswith("vaccel:") and "warning" not in line and "simulated" not in line:
                self.say(who, line.removeprefix("vaccel: "))
            elif "loss" in line and "->" in line:
                job.result = line.split(";")[-1].strip()
        returncode = job.proc.wait()
        job.finished = time.monotonic()
        # As a shell reports it (and the README): 128+N for a process a signal N killed.
        job.exit_code = 128 - returncode if returncode < 0 else returncode
        killed = f" (killed by {signal.Signals(-returncode).name})" if returncode < 0 else ""
        self.say(who, f"exit {job.exit_code}{killed}" + (f" ({job.result})" if job.result else ""))

    def board(self, names: dict[int, str]) -> None:
        r = self.vaccel("alice", "status", "--json")
        if r.returncode != 0:
            return
        data = json.loads(r.stdout)

        def who(holder: dict) -> str:
            if self.cast.real_users:
                return str(holder["user"])  # as the queue lines name them: demo-alice
            return names.get(holder["pid"], f"pid {holder['pid']}")  # one user: name holders by job

        cells = [f"gpu{d['index']}({d['name'].split()[-1]})={who(d['holder']) if d['holder'] else d['state']}"
                 for d in data["devices"]]
        queue = ", ".join(who(q["requester"]) for q in data["queue"]) or "empty"
        self.say("status", "  ".join(cells) + f"  | queue: {queue}")

    def screenshot(self, path: Path) -> None:
        """The dashboard in a headless Chromium (scripts/browser.py), as the lab's screen shows it."""
        from browser import Chromium

        try:
            with Chromium(1280, 800) as chromium:
                chromium.open(self.web_url)
                chromium.wait_for("document.querySelector('#timeline rect[fill^=\"hsl\"]') !== null"
                                  " && document.body.dataset.report", timeout=10)
                chromium.screenshot(path)
        except Exception as exc:  # no chromium, or it failed: the demo itself goes on
            self.say("demo", f"(no dashboard screenshot: {exc})")
            return
        self.say("demo", f"dashboard screenshot saved to {path}")

    def try_foreign_release(self, thief: str, victim: Job) -> None:
        if not self.cast.real_users:
            self.say(thief, "(skipped: releasing another student's lease needs real users; run the demo as root)")
            return
        r = self.vaccel(thief, "release", victim.lease_id)
        self.say(self.label(thief), f"$ vaccel release {victim.lease_id}   ({self.label(victim.name)}'s lease)")
        self.say(self.label(thief), f"exit {r.returncode}: {r.stderr.strip().removeprefix('vaccel: ')}")

    def kill_holder(self, victim: Job, heir: Job) -> float | None:
        """SIGKILL a holder's `vaccel run`; return the ms until the next student's grant."""
        name, heir_name = self.label(victim.name), self.label(heir.name)
        if victim.proc is None or victim.proc.poll() is not None or heir.granted:
            self.say("demo", f"(skipped the kill: {name} is not holding while {heir_name} waits)")
            return None
        self.say("demo", f"kill -9 {name}'s vaccel run (pid {victim.proc.pid}), as a crash would")
        killed = time.monotonic()
        victim.proc.send_signal(signal.SIGKILL)
        deadline = killed + 30
        while not heir.granted and time.monotonic() < deadline:
            time.sleep(0.001)
        if not heir.granted:
            return None
        handover_ms = (heir.granted - killed) * 1000
        self.say("demo", f"{name}'s GPU went to {heir_name} {handover_ms:.0f} ms after the kill")
        return handover_ms


def summary(all_jobs: list[Job], log: Path, label: Callable[[str], str]) -> None:
    print("\nsummary")
    print(f"  {'job':<10} {'asked':<36} {'waited':>7} {'ran':>6}  exit  result")
    for j in all_jobs:
        waited = f"{j.granted - j.submitted:.1f}s" if j.granted else "-"
        ran = f"{j.finished - j.granted:.1f}s" if j.granted else "-"
        result = j.result or next((ln.removeprefix("vaccel: ") for ln in j.lines if ln.startswith("vaccel:")
                                   and "lease" not in ln and "warning" not in ln and "files read" not in ln), "")
        asked = " ".join(Path(a).name for a in j.args)
        print(f"  {label(j.name):<10} {asked:<36} {waited:>7} {ran:>6}  {j.exit_code!s:>4}  {result}")
    print("\nbroker log (grants, refusals, ends):")
    for line in log.read_text().splitlines():
        if any(word in line for word in (" grant ", " refuse ", " exit ", " released ")):
            print("  " + line.split(": ", 1)[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs per job")
    parser.add_argument("--keep", action="store_true", help="keep the broker's work dir (log, state)")
    parser.add_argument("--web", metavar="HOST:PORT", default="",
                        help="serve the web dashboard there too, e.g. 127.0.0.1:8642")
    parser.add_argument("--screenshot", metavar="PNG", type=Path,
                        help="save a screenshot of the dashboard mid-demo (headless chromium; implies --web)")
    args = parser.parse_args(argv)
    if args.screenshot and not args.web:
        with socket.socket() as probe:  # any free loopback port
            probe.bind(("127.0.0.1", 0))
            args.web = f"127.0.0.1:{probe.getsockname()[1]}"
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-demo-"))
    workdir.chmod(0o755)  # the students reach the socket inside
    (workdir / "brokerd.toml").write_text(CONFIG + (f'[web]\nlisten = "{args.web}"\n' if args.web else ""))
    sock = workdir / "brokerd.sock"
    log_path = workdir / "brokerd.log"
    with Cast(["alice", "bob", "carol", "dave", "erin", "frank", "grace"]) as cast, log_path.open("w") as log:
        (cast.stage / "needs-h100.yaml").write_text(NEEDS_H100)
        (cast.stage / "needs-h100.yaml").chmod(0o644)
        broker = subprocess.Popen([sys.executable, "-m", "brokerd", "--config", str(workdir / "brokerd.toml"),
                                   "--socket", str(sock), "--state-dir", str(workdir / "state"),
                                   "--inventory", str(INVENTORY)], stdout=log, stderr=subprocess.STDOUT,
                                  cwd=ROOT)
        try:
            demo = Demo(cast, sock, f"http://{args.web}/" if args.web else "")
            return run(demo, broker, log_path, 2 if args.quick else 4, args.screenshot)
        finally:
            broker.terminate()
            broker.wait(10)
            if args.keep:
                print(f"broker work dir kept: {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)


def run(demo: Demo, broker: subprocess.Popen[bytes], log: Path, epochs: int, screenshot: Path | None = None) -> int:
    while not Path(f"{demo.socket}.id").exists():
        if broker.poll() is not None:
            print(log.read_text(), file=sys.stderr)
            return 1
        time.sleep(0.05)
    who = ("real Unix users demo-alice ... demo-grace" if demo.cast.real_users
           else "one Unix user (you); run as root to see each student as a real user")
    print(f"vaccel demo: broker up on {demo.socket} with the simulated lab server {INVENTORY.name}; "
          f"the students are {who}")
    if demo.web_url:
        print(f"web dashboard: {demo.web_url}")
    print(demo.vaccel("alice", "status").stdout)
    all_jobs = jobs(epochs, demo.cast.stage)
    by_name = {j.name: j for j in all_jobs}
    threads = [threading.Thread(target=demo.run_job, args=(j,)) for j in all_jobs]
    for t in threads:
        t.start()
    # The crash comes once dave waits behind bob (he asks at 1.9 s), long before alice's
    # two-rank job can end: at a later fixed moment a loaded machine could have let alice
    # finish first, dave would then hold without bob's GPU, and there would be no crash to show.
    events = [(2.5, lambda: handover.append(demo.kill_holder(by_name["bob"], by_name["dave"]))),
              (4.5, lambda: demo.try_foreign_release("erin", by_name["alice"]))]
    if screenshot is not None:  # every GPU held and students waiting: the busy lab
        events.append((6.5, lambda: demo.screenshot(screenshot)))
    handover: list[float | None] = []
    while any(t.is_alive() for t in threads):
        now = time.monotonic() - demo.t0
        while events and events[0][0] <= now:
            events.pop(0)[1]()
        demo.board({j.proc.pid: j.name for j in all_jobs if j.proc is not None})
        time.sleep(1.0 if events else 2.0)
    for t in threads:
        t.join()
    summary(all_jobs, log, demo.label)
    refused = {"frank", "grace"}
    trained = [j.name for j in all_jobs if j.result]
    ok = (set(trained) == set(by_name) - refused - {"bob"}
          and all(by_name[n].exit_code not in (0, None) for n in refused) and bool(handover and handover[0]))
    print("\ndemo " + ("finished: every job that could run trained, the impossible ones were refused at once, "
                       "and a crashed holder's GPU went to the next student" if ok
                       else "FAILED: see the job output above"))
    if not ok:
        for j in all_jobs:
            print(f"--- {j.name}\n" + "\n".join(j.lines[-15:]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
