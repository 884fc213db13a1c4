"""The node plugin's digest and cut logic, and its streaming wrapper, without vLLM."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bpdkv.vllm_plugin import decide, digests, handshake, streaming

BS = 16


def d_params(tokens: list[int], remote_num: int, expires_at: float = 1e12, grouped: bool = True) -> dict[str, Any]:
    blocks = list(range(100, 100 + (remote_num + BS - 1) // BS))
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_block_ids": [blocks] if grouped else blocks,
        "remote_engine_id": "d",
        "remote_request_id": "r",
        "remote_host": "10.0.0.2",
        "remote_port": 5600,
        "remote_num_tokens": remote_num,
        decide.DIGESTS_KEY: digests.encode(digests.block_digests(tokens, BS, remote_num)),
        decide.BLOCK_SIZE_KEY: BS,
        decide.EXPIRES_AT_KEY: expires_at,
    }


def test_digest_chain_prefix_property() -> None:
    a = digests.block_digests(list(range(100)), BS)
    b = digests.block_digests(list(range(64)) + [999] + list(range(65, 100)), BS)
    assert len(a) == 6 and digests.matching_blocks(a, b) == 4  # block 4 holds token 64
    assert digests.decode(digests.encode(a)) == a and len(digests.encode(a)) == 6 * 16


@given(st.lists(st.integers(0, 5000), min_size=0, max_size=300), st.integers(0, 300))
def test_matching_blocks_is_the_common_prefix(tokens: list[int], cut: int) -> None:
    other = tokens[:cut] + [t + 1 for t in tokens[cut:]]
    k = digests.matching_blocks(digests.block_digests(tokens, BS), digests.block_digests(other, BS))
    assert k == min(cut, len(tokens)) // BS


def test_full_match_pulls_block_aligned_prefix() -> None:
    d_seq = list(range(200))
    prompt = d_seq[:180] + [7, 7, 7]  # the next turn repeats D's sequence, then adds tokens
    decision = decide.decide_pull(d_params(d_seq, 199), prompt, BS, now=0)
    assert decision.outcome == "verified"
    assert decision.params["remote_num_tokens"] == 176  # 11 full blocks of the 180 shared tokens
    assert decision.params["remote_block_ids"] == [list(range(100, 111))]


def test_divergence_cuts_at_the_first_different_block() -> None:
    d_seq = list(range(200))
    prompt = d_seq[:70] + [9999] + d_seq[71:190]  # re-tokenised assistant text differs at token 70
    decision = decide.decide_pull(d_params(d_seq, 199, grouped=False), prompt, BS, now=0)
    assert decision.outcome == "cut"
    assert decision.params["remote_num_tokens"] == 64 and decision.params["remote_block_ids"] == [100, 101, 102, 103]


def test_no_common_block_means_no_pull() -> None:
    decision = decide.decide_pull(d_params(list(range(100)), 99), [5] * 100, BS, now=0)
    assert decision.outcome == "mismatch" and decision.params["remote_block_ids"] is None
    assert decision.params["do_remote_decode"] is True  # P still prefills for the remote decode


def test_unverified_params_refused_or_allowed() -> None:
    params = d_params(list(range(100)), 99)
    del params[decide.DIGESTS_KEY]
    refused = decide.decide_pull(params, list(range(120)), BS, "refuse", now=0)
    assert refused.outcome == "unverified_refused" and refused.params["remote_engine_id"] is None
    allowed = decide.decide_pull(params, list(range(120)), BS, "allow", now=0)
    assert allowed.outcome == "unverified_allowed" and allowed.params == params


def test_expiring_blocks_are_not_pulled() -> None:
    params = d_params(list(range(100)), 99, expires_at=1000.0)
    assert decide.decide_pull(params, list(range(120)), BS, expiry_guard=10, now=995.0).outcome == "expiring"
    assert decide.decide_pull(params, list(range(120)), BS, expiry_guard=10, now=980.0).outcome == "verified"


def test_block_size_mismatch_is_refused() -> None:
    assert decide.decide_pull(d_params(list(range(100)), 99), list(range(120)), 32, now=0).outcome == "mismatch"


def test_params_of_p_or_turn_one_untouched() -> None:
    template = {"do_remote_decode": True, "remote_block_ids": None}
    assert decide.decide_pull(template, [1, 2, 3], BS).outcome == "none"


# ---- streaming wrapper: a stand-in with vLLM's generator signature -------------------------------------------
@dataclass
class FakeOutput:
    request_id: str
    kv_transfer_params: dict[str, Any] | None


@dataclass
class FakeRequest:
    kv_transfer_params: dict[str, Any] | None


class FakeServing:
    async def chat_completion_stream_generator(self, request: Any, result_generator: Any, request_id: str, model_name: str) -> Any:
        async for out in result_generator:
            yield f"data: {json.dumps({'id': out.request_id, 'choices': [{'delta': {'content': 'x'}}]})}\n\n"
        yield "data: [DONE]\n\n"


async def _collect(gen: Any) -> list[str]:
    return [chunk async for chunk in gen]


async def _results(params: dict[str, Any] | None) -> Any:
    yield FakeOutput("r1", None)
    yield FakeOutput("r1", params)


def test_stream_wrapper_adds_final_params_chunk() -> None:
    wrapped = streaming._wrap(FakeServing.chat_completion_stream_generator, "chat.completion.chunk")
    params = {"remote_block_ids": [[1]], "do_remote_decode": True}
    chunks = asyncio.run(_collect(wrapped(FakeServing(), FakeRequest({"do_remote_prefill": True}), _results(params), "cmpl-1", "tiny")))
    assert chunks[-1] == "data: [DONE]\n\n"
    final = json.loads(chunks[-2][6:])
    assert final["kv_transfer_params"] == params and final["choices"] == [] and final["id"] == "cmpl-1"


def test_stream_wrapper_leaves_plain_requests_byte_identical() -> None:
    wrapped = streaming._wrap(FakeServing.chat_completion_stream_generator, "chat.completion.chunk")
    plain = asyncio.run(_collect(FakeServing().chat_completion_stream_generator(FakeRequest(None), _results(None), "c", "m")))
    generator = wrapped(FakeServing(), FakeRequest(None), _results(None), "c", "m")
    assert generator.ag_code is FakeServing.chat_completion_stream_generator.__code__  # vLLM's own generator, unwrapped
    assert asyncio.run(_collect(generator)) == plain


# ---- NIXL handshake retry -------------------------------------------------------------------------------------
class Again(Exception):  # the name zmq gives its receive timeout
    pass


def test_handshake_retried_on_timeout_only() -> None:
    calls: list[int] = []

    def flaky(host: str, port: int) -> str:
        calls.append(port)
        if len(calls) < 3:
            raise Again()
        return f"{host}:{port}"

    assert handshake.retrying(flaky, 3)("d", 5600) == "d:5600" and calls == [5600, 5600, 5600]
    calls.clear()
    with pytest.raises(Again):
        handshake.retrying(flaky, 2)("d", 1)  # attempts used up: upstream's failure path takes over
    assert len(calls) == 2

    def refused() -> None:
        calls.append(0)
        raise RuntimeError("NIXL compatibility hash mismatch")

    calls.clear()
    with pytest.raises(RuntimeError):
        handshake.retrying(refused, 5)()
    assert calls == [0]
