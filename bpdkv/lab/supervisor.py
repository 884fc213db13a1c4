"""The test hosts' restart supervisor: what systemd does for a unit whose main process dies, which the lab's service
manager (docker-systemctl-replacement, not PID 1) does not. Runs inside each test host, in its init (bpdkv/lab/hosts.py
INIT), with only the standard library of the host's /usr/bin/python3.

A service's main process is orphaned to the host's init when `systemctl start` returns; the init reaps it and hands the
exit status here (`Supervisor.reaped`). The unit whose status file (/run/<unit>.status, MainPID=) names that pid is
restarted as its unit file says — `Restart=` (no, always, on-success, on-failure, on-abnormal, on-abort), `RestartSec=`,
and the start limit (`StartLimitIntervalSec=`, `StartLimitBurst=`, in [Unit] or [Service]; systemd's defaults 10 s and
5): after RestartSec, and only if the unit is still `failed` (a `systemctl stop` or `restart` meanwhile wins); a unit
started more than StartLimitBurst times within StartLimitIntervalSec stays failed. Before the restart, what is left of
the dead unit's process tree is killed, as systemd's cgroup clean-up would (the lab has no cgroups: the supervisor
remembers each running unit's descendants). Every decision is one line in /var/log/journal/bpdkv-lab-supervisor.log
(journalctl -u bpdkv-lab-supervisor), e.g. `bpdkv-decode-0.service: main process killed by SIGKILL; restarting in 5 s
(restart 1)`.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

UNIT_DIR = "/etc/systemd/system"
STATUS_DIR = "/run"
LOG = "/var/log/journal/bpdkv-lab-supervisor.log"
SYSTEMCTL = "/usr/bin/systemctl"
# systemd: a main process ended by one of these (or exit 0) ended cleanly (Restart=on-failure does not restart it).
CLEAN_SIGNALS = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE})
RESTART_VALUES = ("no", "always", "on-success", "on-failure", "on-abnormal", "on-abort", "on-watchdog")
_SECONDS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0, "": 1.0}
_SECONDS |= {"m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0, "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0}


def parse_seconds(value: str, default: float) -> float:
    """systemd's time spans: "5", "5s", "100ms", "1min 30s"; "infinity" is float('inf'); anything else: `default`."""
    text = value.strip().lower()
    if text == "infinity":
        return float("inf")
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    if not parts or re.sub(r"[\d.\sa-z]", "", text) or any(unit not in _SECONDS for _, unit in parts):
        return default
    return sum(float(n) * _SECONDS[unit] for n, unit in parts)


@dataclass(frozen=True)
class RestartPolicy:
    restart: str = "no"
    restart_sec: float = 0.1  # systemd's default RestartSec
    start_limit_interval: float = 10.0
    start_limit_burst: int = 5

    @staticmethod
    def parse(text: str) -> RestartPolicy:
        """The restart settings of a unit file (last assignment wins, as in systemd)."""
        values: dict[str, str] = {}
        section = ""
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition("=")
            if sep and section in ("Unit", "Service"):
                values[key.strip()] = value.strip()
        restart = values.get("Restart", "no")
        burst = values.get("StartLimitBurst", "5")
        interval = values.get("StartLimitIntervalSec", values.get("StartLimitInterval", "10"))
        return RestartPolicy(
            restart if restart in RESTART_VALUES else "no",
            parse_seconds(values.get("RestartSec", "100ms"), 0.1),
            parse_seconds(interval, 10.0),
            int(burst) if burst.isdigit() else 5,
        )

    def wants_restart(self, exit_code: int | None, signal_number: int | None) -> bool:
        """systemd.service(5)'s table: whether this end of the main process asks for a restart."""
        clean = exit_code == 0 or signal_number in CLEAN_SIGNALS
        abnormal_signal = signal_number is not None and signal_number not in CLEAN_SIGNALS
        return {
            "always": True,
            "on-success": clean,
            "on-failure": not clean,
            "on-abnormal": abnormal_signal,
            "on-abort": abnormal_signal,
        }.get(self.restart, False)


class StartLimit:
    """At most `burst` starts within `interval` seconds (systemd's StartLimitIntervalSec / StartLimitBurst)."""

    def __init__(self) -> None:
        self.starts: dict[str, collections.deque[float]] = {}

    def allow(self, unit: str, policy: RestartPolicy, now: float) -> bool:
        if policy.start_limit_interval <= 0 or policy.start_limit_burst <= 0:
            return True  # 0 turns the limit off
        times = self.starts.setdefault(unit, collections.deque())
        while times and now - times[0] > policy.start_limit_interval:
            times.popleft()
        if len(times) >= policy.start_limit_burst:
            return False
        times.append(now)
        return True


def describe_status(status: int) -> tuple[int | None, int | None, str]:
    """(exit code, signal, words) of a wait status."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        return None, number, f"killed by {signal.Signals(number).name}"
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
    return code, None, f"exited with status {code}"


class Supervisor:
    def __init__(
        self,
        unit_dir: str = UNIT_DIR,
        status_dir: str = STATUS_DIR,
        log: str = LOG,
        systemctl: str = SYSTEMCTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.unit_dir, self.status_dir, self.log_path, self.systemctl, self.clock = unit_dir, status_dir, log, systemctl, clock
        self.limit = StartLimit()
        self.restarts: dict[str, int] = {}
        self.trees: dict[int, dict[int, str]] = {}  # main pid → {descendant pid: its start time} (the unit's "cgroup")
        self.lock = threading.Lock()

    def log(self, line: str) -> None:
        try:
            with open(self.log_path, "a") as fh:
                fh.write(line + "\n")
        except OSError:
            pass

    def main_pids(self) -> dict[int, str]:
        """MainPID → unit, from the service manager's status files."""
        out: dict[int, str] = {}
        for path in glob.glob(os.path.join(self.status_dir, "*.service.status")):
            try:
                with open(path) as fh:
                    for line in fh:
                        key, _, value = line.strip().partition("=")
                        if key == "MainPID" and value.strip().isdigit():
                            out[int(value)] = os.path.basename(path)[: -len(".status")]
            except OSError:
                continue
        return out

    def remember_trees(self) -> None:
        """Each running unit's descendants, so that what outlives its main process can be ended with it."""
        children: dict[int, list[int]] = {}
        started: dict[int, str] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
            started[int(entry)] = fields[19]
        trees: dict[int, dict[int, str]] = {}
        mains = self.main_pids()
        for main in mains:
            seen: dict[int, str] = {}
            todo = list(children.get(main, []))
            while todo:
                pid = todo.pop()
                if pid in seen or pid not in started:
                    continue
                seen[pid] = started[pid]
                todo += children.get(pid, [])
            trees[main] = seen
        with self.lock:
            for main, tree in trees.items():
                self.trees.setdefault(main, {}).update(tree)
            # A main process no status file names any more ended through the service manager (stop): forget it. One
            # still named is left for reaped(), which ends what it left behind.
            for main in [m for m in self.trees if m not in mains and not os.path.exists(f"/proc/{m}")]:
                self.trees.pop(main, None)

    def end_tree(self, main: int) -> int:
        """SIGKILL what is left of a dead main process's tree (only processes with the start time remembered)."""
        with self.lock:
            tree = self.trees.pop(main, {})
        ended = 0
        for pid, started in tree.items():
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[19] != started:
                        continue  # the pid was reused
                os.kill(pid, signal.SIGKILL)
                ended += 1
            except (OSError, IndexError):
                continue
        return ended

    def unit_policy(self, unit: str) -> RestartPolicy | None:
        try:
            with open(os.path.join(self.unit_dir, unit)) as fh:
                return RestartPolicy.parse(fh.read())
        except OSError:
            return None  # removed meanwhile (destroy, a test wiping the host): nothing to restart

    def is_active(self, unit: str) -> str:
        try:
            return subprocess.run([self.systemctl, "is-active", unit], capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "unknown"

    def reaped(self, pid: int, status: int) -> None:
        """The init reaped `pid`: if it was a unit's main process, end its tree and restart the unit as it says."""
        unit = self.main_pids().get(pid)
        if unit is None:
            return
        code, number, how = describe_status(status)
        policy = self.unit_policy(unit)
        if policy is None or not policy.wants_restart(code, number):
            with self.lock:
                self.trees.pop(pid, None)
            return
        left = self.end_tree(pid)
        count = self.restarts.get(unit, 0) + 1
        self.log(
            f"{unit}: main process {pid} {how}; restarting in {policy.restart_sec:g} s (restart {count})"
            + (f"; ended {left} process(es) it left" if left else "")
        )
        threading.Thread(target=self._restart_later, args=(unit, policy, count, self.unit_stamp(unit)), daemon=True).start()

    def unit_stamp(self, unit: str) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.unit_dir, unit))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _restart_later(self, unit: str, policy: RestartPolicy, count: int, stamp: tuple[int, int] | None = None) -> None:
        time.sleep(policy.restart_sec)
        state = self.is_active(unit)
        if state != "failed":
            self.log(f"{unit}: not restarted: it is {state} (stopped or restarted meanwhile)")
            return
        if self.unit_policy(unit) is None:
            self.log(f"{unit}: not restarted: its unit file is gone")
            return
        if stamp is not None and self.unit_stamp(unit) != stamp:
            self.log(f"{unit}: not restarted: its unit file was replaced meanwhile (a new deploy starts it)")
            return
        if not self.limit.allow(unit, policy, self.clock()):
            self.log(
                f"{unit}: start request repeated too quickly ({policy.start_limit_burst} within "
                f"{policy.start_limit_interval:g} s): not restarted, it stays failed"
            )
            return
        self.restarts[unit] = count
        done = subprocess.run([self.systemctl, "start", unit], capture_output=True, text=True)
        if done.returncode == 0:
            self.log(f"{unit}: restarted (restart {count})")
        else:
            self.log(f"{unit}: restart {count} failed: systemctl start exited {done.returncode}")

    def watch(self, interval: float = 1.0) -> None:
        """Forever: remember the running units' process trees."""
        while True:
            try:
                self.remember_trees()
            except Exception:  # noqa: BLE001 - a read racing a process's end; the next round reads again
                pass
            time.sleep(interval)
