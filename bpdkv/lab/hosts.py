"""Real OpenSSH test hosts on one Linux machine, each in its own network namespace (root only).

Each host: a network namespace on a private bridge (10.213.0.0/24, no default route inside, and an
`unreachable` route outside so test traffic can never leave), new mount/PID/UTS/IPC namespaces, a tiny init as
PID 1 that runs sshd, reaps orphans and restarts units whose main process died as their Restart= says
(bpdkv/lab/supervisor.py: systemd's part the service manager lacks), per-host directories bind-mounted over the paths a deploy writes
(/etc/bpdkv, /opt/bpdkv, /etc/systemd/system, /var/lib/bpdkv, /var/log) and docker-systemctl-replacement
bound over /usr/bin/systemctl so `systemctl` really runs units. Never real systemd as PID 1 (it would clean the
machine's shared /tmp). Everything started here is ended by PID on stop(), which also removes the hosts' own
directories (the SSH key and known_hosts stay in the lab's cache directory).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bpdkv.lab import CACHE_DIR

BASE = CACHE_DIR / "lab"  # root-owned and not world-writable: sshd StrictModes accepts it
BRIDGE = "bpdkv-br0"
BRIDGE_MAC = "02:62:70:64:00:fe"  # the hosts' eth0 are 02:62:70:64:00:<n>
NET = "10.213.0"
# Paths a deploy writes; each host gets its own copy (bind mounts), so hosts really differ.
PER_HOST_DIRS = ("/etc/bpdkv", "/opt/bpdkv", "/etc/systemd/system", "/var/lib/bpdkv", "/var/log")

INIT = r"""#!/usr/bin/python3
# PID 1 of a test host: start sshd, reap every orphan (services started by systemctl end up here), and stamp the
# journal. The service manager appends each unit's output to /var/log/journal/<unit>.log with no time; like journald,
# which stamps an entry when it receives it, a thread notes every 0.1 s the arrival time of each new line
# (<unit>.log.times: one line per log line, microseconds since the epoch). journalctl reads them.
import glob, os, signal, subprocess, sys, threading, time

# What systemd would do for a unit whose main process dies (Restart=, RestartSec=, the start limit): bpdkv/lab/supervisor.py.
sys.path.insert(0, os.environ["BPDKV_LAB"])
import supervisor as restart_supervisor

SUPERVISOR = restart_supervisor.Supervisor()
threading.Thread(target=SUPERVISOR.watch, daemon=True).start()


def stamp_journal():
    seen = {}  # log path -> (inode, bytes stamped)
    while True:
        for log in glob.glob("/var/log/journal/*.log"):
            try:
                inode, size = os.stat(log).st_ino, os.path.getsize(log)
                known, offset = seen.get(log, (None, 0))
                with open(log, "rb") as fh:
                    if known != inode or size < offset:  # first sight, or a new file: resume after what is stamped
                        try:
                            with open(log + ".times") as times:
                                stamped = len(times.read().splitlines())
                        except FileNotFoundError:
                            stamped = 0
                        lines = fh.read().split(b"\n")[:-1]
                        if stamped > len(lines):  # stamps of another file: start over
                            open(log + ".times", "w").close()
                            stamped = 0
                        offset = sum(len(line) + 1 for line in lines[:stamped])
                    fh.seek(offset)
                    data = fh.read()
                complete = data[: data.rfind(b"\n") + 1]
                if complete:
                    now = str(int(time.time() * 1e6))
                    with open(log + ".times", "a") as times:
                        times.write((now + "\n") * complete.count(b"\n"))
                seen[log] = (inode, offset + len(complete))
            except OSError:
                seen.pop(log, None)  # removed meanwhile (a test wiping the host): looked at afresh next time
        time.sleep(0.1)


threading.Thread(target=stamp_journal, daemon=True).start()
sshd = subprocess.Popen(sys.argv[1:])
signal.signal(signal.SIGTERM, lambda *a: (sshd.terminate(), sys.exit(0)))
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        sys.exit(0)
    if pid == sshd.pid:
        sys.exit(0)
    try:
        SUPERVISOR.reaped(pid, status)
    except Exception as exc:  # never let the supervisor take the host's init down
        SUPERVISOR.log(f"supervisor error: {type(exc).__name__}: {exc}")
"""

HOST_SETUP = r"""set -e
H=$1; shift
hostname "$(basename "$H")"
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -m 755 /run/sshd
for d in "$@"; do mkdir -p "$d"; mount --bind "$H/fs$d" "$d"; done
mount --bind "$BPDKV_LAB/systemctl" /usr/bin/systemctl
mount --bind "$BPDKV_LAB/journalctl" /usr/bin/journalctl
# This machine's root shell rc files run `pyenv init` (~0.12 s of CPU per SSH command, since bash reads ~/.bashrc for
# sshd's commands); a node's root shell does not. The hosts get a one-line rc instead: the same python3 first on PATH
# (this machine's CPython, which the wheelhouses here are built for), without the per-command cost.
for f in /root/.bashrc /root/.profile; do [ ! -f "$f" ] || mount --bind "$BPDKV_LAB/shellrc" "$f"; done
exec /usr/bin/python3 "$BPDKV_LAB/init.py" /usr/sbin/sshd -D -e -f "$H/sshd_config"
"""


JOURNALCTL = r"""#!/usr/bin/python3
# journalctl of a test host. The service manager here (docker-systemctl-replacement) appends each unit's output to
# /var/log/journal/<unit>.log; the host's init stamps each line's arrival in <unit>.log.times (a line not stamped yet
# has no time and counts as newer than any --since). The cursor is the line number. Supports what `bpdkv logs` and
# people use: -u UNIT (repeatable), -o json|short-iso-precise|cat|short, -n N, --since (journalctl's forms: "now",
# "today", "yesterday", "@EPOCH", "-5min", "5 min ago", "YYYY-MM-DD [HH:MM[:SS[.ffffff]]] [UTC]", "HH:MM[:SS]";
# local time unless UTC), --after-cursor, --no-pager, -q.
import argparse, datetime, json, os, re, sys
UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1, "sec": 1, "second": 1, "seconds": 1, "m": 60,
         "min": 60, "minute": 60, "minutes": 60, "h": 3600, "hr": 3600, "hour": 3600, "hours": 3600, "d": 86400,
         "day": 86400, "days": 86400, "w": 604800, "week": 604800, "weeks": 604800}


def since_us(text):
    t = text.strip()
    now = datetime.datetime.now().astimezone()
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    named = {"now": now, "today": midnight, "yesterday": midnight - datetime.timedelta(days=1),
             "tomorrow": midnight + datetime.timedelta(days=1)}
    if t in named:
        return int(named[t].timestamp() * 1e6)
    if re.fullmatch(r"@\d+(\.\d+)?", t):
        return int(float(t[1:]) * 1e6)
    relative = re.fullmatch(r"([-+]?)\s*((?:\d+\s*[a-z]+\s*)+?)\s*(ago)?", t)
    if relative and (relative.group(1) or relative.group(3)) and not (relative.group(1) and relative.group(3)):
        parts = re.findall(r"(\d+)\s*([a-z]+)", relative.group(2))
        if all(unit in UNITS for _, unit in parts):
            seconds = sum(int(n) * UNITS[unit] for n, unit in parts)
            sign = 1 if relative.group(1) == "+" else -1
            return int((now.timestamp() + sign * seconds) * 1e6)
    utc = t.endswith(" UTC")
    body = t[: -len(" UTC")] if utc else t
    for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%H:%M:%S", "%H:%M"):
        try:
            when = datetime.datetime.strptime(body, fmt)
        except ValueError:
            continue
        if not fmt.startswith("%Y"):
            when = datetime.datetime.combine(now.date(), when.time())
        when = when.replace(tzinfo=datetime.timezone.utc) if utc else when.astimezone()
        return int(when.timestamp() * 1e6)
    sys.exit(f"Failed to parse timestamp: {text}")


ap = argparse.ArgumentParser()
ap.add_argument("-u", "--unit", action="append", default=[])
ap.add_argument("-o", "--output", default="short")
ap.add_argument("-n", "--lines", type=int)
ap.add_argument("-S", "--since")
ap.add_argument("--after-cursor")
ap.add_argument("-f", "--follow", action="store_true")
ap.add_argument("--no-pager", action="store_true")
ap.add_argument("-q", "--quiet", action="store_true")
argv = sys.argv[1:]
for i, arg in enumerate(argv[:-1]):  # getopt takes the next word as the value, even "-1h"; argparse would not
    if arg in ("-S", "--since"):
        argv[i : i + 2] = ["--since=" + argv[i + 1]]
        break
args = ap.parse_args(argv)
if args.follow:
    sys.exit("journalctl (test host): --follow is not supported; poll with --after-cursor")
cutoff = since_us(args.since) if args.since else None
for unit in args.unit or []:
    unit = unit if "." in unit else unit + ".service"
    try:
        with open(f"/var/log/journal/{unit}.log", errors="replace", newline="") as fh:
            lines = fh.read().split("\n")  # newlines only, as the stamps count them (no \r, \f, ... splits)
        lines = lines[:-1] if lines[-1] == "" else lines
    except FileNotFoundError:
        lines = []
    try:
        with open(f"/var/log/journal/{unit}.log.times") as fh:
            stamps = [int(s) for s in fh.read().split()]
    except FileNotFoundError:
        stamps = []
    numbered = [(n, stamps[n - 1] if n <= len(stamps) else None, text) for n, text in enumerate(lines, 1)]
    if args.after_cursor:
        numbered = numbered[int(args.after_cursor.rsplit("=", 1)[1]):]
    elif cutoff is not None:
        numbered = [entry for entry in numbered if entry[1] is None or entry[1] >= cutoff]
    if args.lines is not None:
        numbered = numbered[-args.lines:] if args.lines else []
    for n, stamp, text in numbered:
        if args.output == "json":
            record = {"__CURSOR": f"lab;line={n}", "_SYSTEMD_UNIT": unit, "_HOSTNAME": os.uname().nodename, "MESSAGE": text}
            if stamp is not None:
                record["__REALTIME_TIMESTAMP"] = str(stamp)
            print(json.dumps(record))
        elif args.output == "cat":
            print(text)
        else:
            when = "-" if stamp is None else datetime.datetime.fromtimestamp(stamp / 1e6).astimezone().isoformat(timespec="microseconds")
            print(f"{when} {os.uname().nodename} {unit}: {text}")
"""


class TestHostsUnavailable(Exception):
    """Not root, or the namespace tools are missing: say why, so tests can skip with that reason."""

    __test__ = False  # an error of the lab, not a pytest test class


@dataclass
class TestHost:
    __test__ = False  # a lab host, not a pytest test class
    name: str
    address: str
    dir: Path
    pid: int | None = None

    @property
    def fs(self) -> Path:
        """The host's own view of PER_HOST_DIRS, seen from outside (e.g. fs/etc/bpdkv)."""
        return self.dir / "fs"


@dataclass
class TestHosts:
    __test__ = False  # a fixture, not a pytest test class
    count: int = 3
    base: Path = BASE
    hosts: list[TestHost] = field(default_factory=list)

    @property
    def key(self) -> Path:
        return self.base / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.base / "known_hosts"

    @staticmethod
    def check() -> None:
        if os.geteuid() != 0:
            raise TestHostsUnavailable("test hosts need root (network namespaces, bind mounts)")
        for tool in ("ip", "unshare", "ssh-keygen", "/usr/sbin/sshd", "/usr/bin/python3"):
            if shutil.which(tool) is None and not Path(tool).exists():
                raise TestHostsUnavailable(f"{tool} missing (apt-get install -y openssh-server iproute2 util-linux)")
        if _systemctl_replacement() is None:
            raise TestHostsUnavailable(
                "the test hosts' service manager (docker-systemctl-replacement) is missing: pip install 'bpdkv[lab]'"
            )

    def start(self) -> TestHosts:
        self.check()
        self.stop(quiet=True)  # leftovers of a crashed run
        self.base.mkdir(parents=True, exist_ok=True)
        self.base.chmod(0o755)
        if not self.key.exists():
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bpdkv-testhosts", "-f", str(self.key)])
        (self.base / "init.py").write_text(INIT)
        (self.base / "supervisor.py").write_text((Path(__file__).parent / "supervisor.py").read_text())
        (self.base / "host-setup.sh").write_text(HOST_SETUP)
        replacement = _systemctl_replacement()
        assert replacement is not None
        (self.base / "systemctl").write_text("#!/usr/bin/python3\n" + replacement.read_text().split("\n", 1)[1])
        (self.base / "journalctl").write_text(JOURNALCTL)
        (self.base / "shellrc").write_text(f'# test host: root\'s shell rc\nexport PATH="{Path(sys.base_prefix) / "bin"}:$PATH"\n')
        for name in ("systemctl", "journalctl"):
            (self.base / name).chmod(0o755)
        self.known_hosts.write_text("")
        # A set MAC: a bridge otherwise takes its lowest port's, so a host going away (its veth removed) or coming back
        # could change this machine's MAC on the test network, and every other host would send to a MAC nobody owns
        # until its ARP entry aged out (up to a minute of silence: SSH keepalives failing on hosts nobody touched).
        _run(["ip", "link", "add", BRIDGE, "address", BRIDGE_MAC, "type", "bridge"])
        _run(["ip", "addr", "add", f"{NET}.1/24", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        _run(["ip", "route", "add", "unreachable", f"{NET}.0/24", "metric", "4000"])
        for i in range(1, self.count + 1):
            self.hosts.append(self._start_host(i))
        for host in self.hosts:
            self._wait_sshd(host)
        return self

    def _start_host(self, i: int) -> TestHost:
        name = f"host{i}"
        host = TestHost(name, f"{NET}.{10 + i}", self.base / name)
        if host.dir.exists():
            shutil.rmtree(host.dir)
        for d in PER_HOST_DIRS:
            (host.fs / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
        host.dir.chmod(0o755)
        auth = host.dir / "authorized_keys"
        auth.write_text(Path(str(self.key) + ".pub").read_text())
        auth.chmod(0o600)
        hostkey = host.dir / "ssh_host_ed25519_key"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(hostkey)])
        (host.dir / "sshd_config").write_text(
            "\n".join(
                [
                    "ListenAddress 0.0.0.0:22",
                    f"HostKey {hostkey}",
                    "PidFile /run/sshd.pid",
                    f"AuthorizedKeysFile {auth}",
                    "PubkeyAuthentication yes",
                    "AuthenticationMethods publickey",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "UsePAM no",
                    "StrictModes yes",
                    "MaxStartups 100:30:200",
                    "MaxSessions 100",
                    "Subsystem sftp /usr/lib/openssh/sftp-server",
                ]
            )
            + "\n"
        )
        with self.known_hosts.open("a") as fh:
            fh.write(f"{host.address} {' '.join(Path(str(hostkey) + '.pub').read_text().split()[:2])}\n")
        self._plumb(i, host)
        self._launch(host, "wb")
        return host

    def _wait_sshd(self, host: TestHost, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["ip", "netns", "exec", host.name, "ss", "-Hltn", "sport = :22"], capture_output=True, text=True)
            if "LISTEN" in out.stdout:
                return
            time.sleep(0.05)
        raise RuntimeError(f"sshd on {host.name} did not start: {(host.dir / 'host.log').read_text()[-500:]}")

    def kill_host(self, host: TestHost) -> None:
        """Take one host down (all its processes), keeping its files: it becomes unreachable."""
        _kill_netns(host.name)
        subprocess.run(["ip", "netns", "del", host.name], capture_output=True)

    def restart_host(self, host: TestHost) -> None:
        i = int(host.name.removeprefix("host"))
        subprocess.run(["ip", "link", "del", f"bpdkv-h{i}"], capture_output=True)
        self._plumb(i, host)
        self._launch(host, "ab")
        subprocess.run(["ip", "neigh", "flush", "to", host.address], capture_output=True)
        self._wait_sshd(host)

    def _plumb(self, i: int, host: TestHost) -> None:
        """Namespace + veth into the bridge; no default route inside, so nothing can leave the test subnet."""
        veth, name = f"bpdkv-h{i}", host.name
        _run(["ip", "netns", "add", name])
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p"])
        _run(["ip", "link", "set", veth, "master", BRIDGE, "up"])
        _run(["ip", "link", "set", f"{veth}p", "netns", name])
        _run(["ip", "-n", name, "link", "set", f"{veth}p", "name", "eth0"])
        # A fixed MAC per host: after a host restart the machine's ARP cache is still right.
        _run(["ip", "-n", name, "link", "set", "eth0", "address", f"02:62:70:64:00:{i:02x}"])
        _run(["ip", "-n", name, "addr", "add", f"{host.address}/24", "dev", "eth0"])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        _run(["ip", "-n", name, "link", "set", "eth0", "up"])

    def _launch(self, host: TestHost, log_mode: str) -> None:
        log = open(host.dir / "host.log", log_mode)  # noqa: SIM115 - handed to the child process
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                host.name,
                "unshare",
                "--mount",
                "--pid",
                "--fork",
                "--mount-proc",
                "--uts",
                "--ipc",
                "--propagation",
                "private",
                "sh",
                str(self.base / "host-setup.sh"),
                str(host.dir),
                *PER_HOST_DIRS,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=dict(os.environ, BPDKV_LAB=str(self.base)),
        )
        host.pid = proc.pid

    def shape(self, host: TestHost, rate: str | None, burst: str = "32kb", latency: str = "10s") -> None:
        """Throttle what the host sends (its eth0's egress) with a token bucket (`tc` tbf), e.g. rate "4mbit"; None
        removes it. A slow link between P and D for the tests and the slow-link benchmark."""
        if rate is None:
            subprocess.run(["ip", "netns", "exec", host.name, "tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
            return
        _run(
            [
                "ip",
                "netns",
                "exec",
                host.name,
                "tc",
                "qdisc",
                "replace",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                latency,
            ]
        )

    def exec(self, host: TestHost, command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a command inside the host's namespaces (for test assertions), without SSH."""
        if host.pid is None:
            raise RuntimeError(f"{host.name} is not running")
        children = subprocess.run(["pgrep", "-P", str(host.pid)], capture_output=True, text=True).stdout.split()
        target = children[0] if children else str(host.pid)
        return subprocess.run(["nsenter", "-t", target, "-a", "sh", "-c", command], capture_output=True, text=True, timeout=timeout)

    def main_pid(self, host: TestHost, unit: str) -> int | None:
        """The unit's main process as the service manager recorded it (MainPID in /run/<unit>.status), if running."""
        out = self.exec(host, f"sed -n 's/^MainPID=//p' /run/{unit}.status 2>/dev/null").stdout.strip()
        pid = int(out) if out.isdigit() else None
        if pid is None or self.exec(host, f"kill -0 {pid}").returncode != 0:
            return None
        return pid

    def kill_unit(self, host: TestHost, unit: str) -> int:
        """SIGKILL a unit's main process and its whole tree, as the kernel's OOM killer and systemd's cgroup clean-up
        would; returns the killed main pid. The host's supervisor then restarts it as its Restart= says."""
        pid = self.main_pid(host, unit)
        if pid is None:
            raise RuntimeError(f"{host.name}: {unit} has no running main process")
        tree = f"p={pid}; all=$p; while [ -n \"$p\" ]; do p=$(pgrep -P \"$(echo $p | tr ' ' ',')\" | tr '\\n' ' '); all=\"$all $p\"; done; kill -9 $all"
        self.exec(host, tree)
        return pid

    def stop(self, quiet: bool = False) -> None:
        names = [h.name for h in self.hosts] or [f"host{i}" for i in range(1, self.count + 9)]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for name in names:
            if any(line.split()[0] == name for line in listed.splitlines() if line.strip()):
                _kill_netns(name)
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for i in range(1, max(self.count, len(self.hosts)) + 9):
            subprocess.run(["ip", "link", "del", f"bpdkv-h{i}"], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        subprocess.run(["ip", "route", "del", "unreachable", f"{NET}.0/24", "metric", "4000"], capture_output=True)
        for name in names:
            # Only once no process of the host is left: its bind mounts died with its mount namespace.
            shutil.rmtree(self.base / name, ignore_errors=True)
        self.hosts = []

    def __enter__(self) -> TestHosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_netns(name: str) -> None:
    for sig in ("-TERM", "-KILL"):
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        if not pids:
            return
        subprocess.run(["kill", sig, *pids], capture_output=True)
        for _ in range(40):
            if not subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                return
            time.sleep(0.05)


def _systemctl_replacement() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("systemctl2")  # a namespace package: no __file__
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "systemctl3.py"
        if path.exists():
            return path
    return None


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


if __name__ == "__main__":  # manual use: python -m bpdkv.lab.hosts up|down
    lab = TestHosts()
    if sys.argv[1:] == ["down"]:
        lab.stop()
    else:
        lab.start()
        print(f"hosts: {[(h.name, h.address) for h in lab.hosts]}; key {lab.key}; known_hosts {lab.known_hosts}")
