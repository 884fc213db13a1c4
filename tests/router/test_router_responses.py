"""OpenAI Responses (`/v1/responses`) through the router, with the real `openai` SDK as the client, against emulated P
and D (test doubles) and a single emulated server as the reference: multi-turn tool use (two parallel calls),
streamed and not, stateless (whole input) and chained (`previous_response_id`, kept by the router: in memory, and in
Redis across two routers and a restart), reuse from turn 2, OpenAI's error shape for every refusal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from bpdkv.router import sessions
from bpdkv.router.responses import items_to_messages
from bpdkv.testing.record_vllm import hermes_call_text, literal_regex
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.conftest import Fleet, make_fleet, stop_fleet

INSTRUCTIONS = "You answer questions about the model cache, and you may call tools. " * 3
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
]
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
RESULTS = {"get_weather": "sunny, 21 degrees", "get_time": "14:05"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Fleet, str]]:
    f = make_fleet()
    reference = VllmEmulator(EmulatorSettings(role="both"))
    group = ServerGroup([reference.app])
    [ref_url] = group.start()
    try:
        yield f, ref_url
    finally:
        group.stop()
        stop_fleet(f)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="test-key", max_retries=0, timeout=30)


def forced(calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {"structured_outputs": {"regex": literal_regex(hermes_call_text(calls))}}


def ask(c: openai.OpenAI, stream: bool, **kwargs: Any) -> dict[str, Any]:
    kwargs = {"model": "emulated", "max_output_tokens": 60, "instructions": INSTRUCTIONS, "tools": TOOLS, **kwargs}
    if stream:
        with c.responses.stream(**kwargs) as s:
            kinds = [event.type for event in s]
            response = s.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"], kinds
        assert kinds[-1] == "response.completed" and kinds.count(kinds[-1]) == 1, kinds
        return response.model_dump()
    return c.responses.create(**kwargs).model_dump()


def comparable(response: dict[str, Any]) -> list[Any]:
    out: list[Any] = [response["status"]]
    for item in response["output"]:
        if item["type"] == "message":
            out.append(("text", "".join(p["text"] for p in item["content"])))
        elif item["type"] == "function_call":
            out.append(("call", item["name"], json.loads(item["arguments"])))
    return out


def results_for(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"type": "function_call_output", "call_id": i["call_id"], "output": RESULTS[i["name"]]}
        for i in response["output"]
        if i["type"] == "function_call"
    ]


def replayable(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as a client sends them back (the SDK's dump has nulls the input item types do not take)."""
    return [{k: v for k, v in item.items() if v is not None} for item in items]


def stateless(url: str, stream: bool, tag: str) -> list[dict[str, Any]]:
    """Four turns, the whole input every turn (store false)."""
    c = client(url)
    items: list[dict[str, Any]] = [{"role": "user", "content": f"What is the weather in Paris and the time in CET?{tag}"}]
    answers = []
    for extra in ({}, {"max_output_tokens": 200, "extra_body": forced(TWO_CALLS)}, {}, {}):
        answer = ask(c, stream, input=items, store=False, **extra)
        answers.append(answer)
        items += replayable(answer["output"])
        items += results_for(answer) or [{"role": "user", "content": f"go on ({len(answers)})"}]
    return answers


def chained(urls: list[str], stream: bool, tag: str) -> list[dict[str, Any]]:
    """The same four turns, each sending only its new input and the previous response's id (turn i on urls[i % n])."""
    previous = None
    new: list[dict[str, Any]] = [{"role": "user", "content": f"What is the weather in Paris and the time in CET?{tag}"}]
    answers = []
    for turn, extra in enumerate(({}, {"max_output_tokens": 200, "extra_body": forced(TWO_CALLS)}, {}, {})):
        c = client(urls[turn % len(urls)])
        answer = ask(c, stream, input=new, previous_response_id=previous, **extra) if previous else ask(c, stream, input=new, **extra)
        answers.append(answer)
        previous = answer["id"]
        new = results_for(answer) or [{"role": "user", "content": f"go on ({len(answers)})"}]
    return answers


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_stateless_equals_single_server_and_reuses(fleet: tuple[Fleet, str], stream: bool) -> None:
    f, ref_url = fleet
    hits = f.metric("bpdkv_router_api_turns_total", api="responses", path="prefill_pull", reuse="hit")
    pulled = sum(p.counters.get("prompt_tokens:external_kv_transfer", 0) for p in f.prefill)
    through = stateless(f.url, stream, f" (stateless {stream})")
    reference = stateless(ref_url, stream, f" (stateless {stream})")
    assert [comparable(r) for r in through] == [comparable(r) for r in reference]
    assert [i["name"] for i in through[1]["output"] if i["type"] == "function_call"] == ["get_weather", "get_time"]
    assert f.metric("bpdkv_router_api_turns_total", api="responses", path="prefill_pull", reuse="hit") - hits == 3
    assert sum(p.counters.get("prompt_tokens:external_kv_transfer", 0) for p in f.prefill) > pulled


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chain_equals_stateless_and_reuses(fleet: tuple[Fleet, str], stream: bool) -> None:
    """previous_response_id gets the prompt the whole input would (function calls included, unlike vLLM's store)."""
    f, _ = fleet
    hits = f.metric("bpdkv_router_api_turns_total", api="responses", path="prefill_pull", reuse="hit")
    through = chained([f.url], stream, f" (chained {stream})")
    whole = stateless(f.url, stream, f" (chained {stream})")
    assert [comparable(r) for r in through] == [comparable(r) for r in whole]
    assert through[1]["previous_response_id"] == through[0]["id"]
    # 3 continued turns of the chain and 3 of the stateless run, whose history the chain's D locations do not cover
    # (turn 1 of each is its own conversation start): at least the chain's three pulled D's KV.
    assert f.metric("bpdkv_router_api_turns_total", api="responses", path="prefill_pull", reuse="hit") - hits >= 3
    got = client(f.url).responses.retrieve(through[-1]["id"])
    assert got.id == through[-1]["id"] and comparable(got.model_dump()) == comparable(through[-1])
    # Deleted, the middle of the chain ends every chain through it; deleted again (or never stored): 404.
    client(f.url).responses.delete(through[1]["id"])
    with pytest.raises(openai.BadRequestError):
        client(f.url).responses.create(model="emulated", input="more", previous_response_id=through[-1]["id"])
    with pytest.raises(openai.NotFoundError):
        client(f.url).responses.delete(through[1]["id"])


def test_stream_event_sequence(fleet: tuple[Fleet, str]) -> None:
    f, _ = fleet
    body = {"model": "emulated", "input": "weather?", "tools": TOOLS, "max_output_tokens": 200, "stream": True, **forced(TWO_CALLS)}
    with httpx.stream("POST", f.url + "/v1/responses", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    datas = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names == [d["type"] for d in datas]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    added = [d["item"] for d in datas if d["type"] == "response.output_item.added"]
    assert [a["type"] for a in added] == ["function_call", "function_call"]
    for index, item in enumerate(added):
        deltas = [d["delta"] for d in datas if d["type"] == "response.function_call_arguments.delta" and d["output_index"] == index]
        done = next(d for d in datas if d["type"] == "response.function_call_arguments.done" and d["output_index"] == index)
        assert "".join(deltas) == done["arguments"] and json.loads(done["arguments"]) == dict(TWO_CALLS)[item["name"]]
    final = datas[-1]["response"]
    assert final["status"] == "completed" and [o["type"] for o in final["output"]] == ["function_call", "function_call"]
    assert "kv_transfer_params" not in raw

    body = {"model": "emulated", "input": "say something", "max_output_tokens": 5, "stream": True}
    with httpx.stream("POST", f.url + "/v1/responses", json=body, timeout=30) as resp:
        raw = resp.read().decode()
    names = [e.split("\n")[0].removeprefix("event: ") for e in raw.split("\n\n") if e]
    assert "response.output_text.delta" in names and names[-1] == "response.completed" and names.count("response.completed") == 1
    assert json.loads(raw.split("\n\n")[-2].split("\n")[1][5:])["response"]["status"] == "incomplete"


def test_unknown_previous_response_id_is_400(fleet: tuple[Fleet, str]) -> None:
    f, _ = fleet
    with pytest.raises(openai.BadRequestError) as caught:
        client(f.url).responses.create(model="emulated", input="hi", previous_response_id="resp_nope")
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    # store false: not continued either; another tenant's id is not found
    first = client(f.url).responses.create(model="emulated", input="hi", store=False, max_output_tokens=5)
    with pytest.raises(openai.BadRequestError):
        client(f.url).responses.create(model="emulated", input="more", previous_response_id=first.id)
    kept = client(f.url).responses.create(model="emulated", input="hi", max_output_tokens=5)
    other = openai.OpenAI(base_url=f.url + "/v1", api_key="another-key", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        other.responses.create(model="emulated", input="more", previous_response_id=kept.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(kept.id)


HOSTILE: list[tuple[str, dict[str, Any]]] = [
    ("no input", {"model": "emulated"}),
    ("input a number", {"model": "emulated", "input": 5}),
    ("unknown item type", {"model": "emulated", "input": [{"type": "item_reference", "id": "x"}]}),
    ("bad role", {"model": "emulated", "input": [{"role": "tool", "content": "x"}]}),
    ("orphan function_call_output", {"model": "emulated", "input": [{"type": "function_call_output", "call_id": "nope", "output": "r"}]}),
    ("function_call without call_id", {"model": "emulated", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
    ("arguments an object", {"model": "emulated", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}),
    ("encrypted reasoning", {"model": "emulated", "input": [{"type": "reasoning", "encrypted_content": "zz", "summary": []}]}),
    ("content part unknown", {"model": "emulated", "input": [{"role": "user", "content": [{"type": "input_audio", "x": 1}]}]}),
    ("stream a string", {"model": "emulated", "input": "x", "stream": "true"}),
    ("max_output_tokens zero", {"model": "emulated", "input": "x", "max_output_tokens": 0}),
    ("max_output_tokens huge", {"model": "emulated", "input": "x", "max_output_tokens": 1 << 70}),
    ("web search tool", {"model": "emulated", "input": "x", "tools": [{"type": "web_search"}]}),
    ("tool_choice unknown", {"model": "emulated", "input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}),
    ("background", {"model": "emulated", "input": "x", "background": True}),
    ("previous id a number", {"model": "emulated", "input": "x", "previous_response_id": 7}),
    ("unknown previous id", {"model": "emulated", "input": "x", "previous_response_id": "resp_0"}),
    ("nested deep", {"model": "emulated", "input": "x", "metadata": json.loads('{"a":' * 70 + "1" + "}" * 70)}),
    ("unknown model", {"model": "no-such-model", "input": "x"}),
]


@pytest.mark.parametrize("name,body", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_bad_bodies_get_openai_4xx(fleet: tuple[Fleet, str], name: str, body: dict[str, Any]) -> None:
    f, _ = fleet
    resp = httpx.post(f.url + "/v1/responses", json=body, timeout=30)
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_output_items_become_the_assistant_message() -> None:
    """Output sent back as input: one assistant message (reasoning, text, then the calls), as vLLM merges them."""
    items = [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ]
    assert items_to_messages(items, []) == [
        {
            "role": "assistant",
            "reasoning": "think",
            "content": "calling",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "r1", "tool_call_id": "c1"},
        {"role": "user", "content": "a\nb"},
    ]


# ---- previous_response_id across routers sharing Redis, and after a restart ------------------------------------------
def test_chain_across_routers_and_restart_with_redis(redis_server: dict[str, Any]) -> None:
    redis_url = redis_server["url"]
    f = make_fleet(n_routers=2, store_factory=lambda: sessions.RedisStore(redis_url))
    try:
        through = chained(f.router_urls, False, " (redis)")  # turns alternate between the two routers
        assert [r["previous_response_id"] for r in through[1:]] == [r["id"] for r in through[:-1]]
        assert [i["name"] for i in through[1]["output"] if i["type"] == "function_call"] == ["get_weather", "get_time"]
        whole = stateless(f.router_urls[0], False, " (redis)")
        assert [comparable(r) for r in through] == [comparable(r) for r in whole]
    finally:
        stop_fleet(f)
    # A new router process (same Redis): the chain goes on from the last response.
    again = make_fleet(store_factory=lambda: sessions.RedisStore(redis_url))
    try:
        more = client(again.url).responses.create(
            model="emulated", input="and after the restart?", previous_response_id=through[-1]["id"], max_output_tokens=5
        )
        assert more.previous_response_id == through[-1]["id"] and more.status in ("completed", "incomplete")
    finally:
        stop_fleet(again)


def _record(parent: str | None) -> bytes:
    return json.dumps({"parent": parent, "messages": [{"role": "user", "content": "m"}]}).encode()


async def _chain_checks(store: Any, advance: Any) -> None:
    """A chain is read whole, newest first; reading it keeps every record of it longer; a missing record breaks it."""
    await store.put_record("p:a", _record(None), 10)
    await store.put_record("p:b", _record("a"), 10)
    await store.put_record("p:c", _record("b"), 10)
    values, complete = await store.get_chain("p:", "c", 10)
    assert complete and [json.loads(v)["parent"] for v in values] == ["b", "a", None]
    await advance(6)
    assert (await store.get_chain("p:", "c", 10))[1]  # read at 6 s: every record kept 10 s from now
    await advance(6)  # 12 s after they were written, 6 s after the read
    values, complete = await store.get_chain("p:", "c", 10)
    assert complete and len(values) == 3
    await store.put_record("p:b", _record("a"), 0.001)  # the middle record expires
    await advance(0.05)
    values, complete = await store.get_chain("p:", "c", 10)
    assert not complete and len(values) == 1
    assert (await store.get_chain("p:", "nope", 10)) == ([], False)


def test_chain_records_in_memory() -> None:
    import asyncio

    now = [1000.0]
    store = sessions.MemoryStore(clock=lambda: now[0])

    async def advance(seconds: float) -> None:
        now[0] += seconds

    asyncio.run(_chain_checks(store, advance))


def test_chain_records_in_redis(redis_server: dict[str, Any]) -> None:
    import asyncio

    async def main() -> None:
        store = sessions.RedisStore(redis_server["url"])

        async def advance(seconds: float) -> None:
            await asyncio.sleep(seconds)

        # Redis keeps real time: the TTL in these checks is 10 s, read back at 6 s and 12 s (18 s in all would be
        # too slow here); the same checks with a 1 s scale.
        scaled = _Scaled(store, 0.1)
        try:
            await _chain_checks(scaled, lambda s: advance(s * 0.1))
        finally:
            await store.close()

    asyncio.run(main())


class _Scaled:
    """A store whose TTLs are scaled (the Redis check of _chain_checks in a tenth of its time)."""

    def __init__(self, store: Any, factor: float) -> None:
        self.store, self.factor = store, factor

    async def put_record(self, key: str, value: bytes, ttl: float) -> None:
        await self.store.put_record(key, value, ttl * self.factor if ttl > 0.01 else ttl)

    async def get_chain(self, prefix: str, first: str, ttl: float) -> tuple[list[bytes], bool]:
        return await self.store.get_chain(prefix, first, ttl * self.factor)  # type: ignore[no-any-return]


def test_chain_across_the_workers_of_a_real_router(tmp_path: Any) -> None:
    """`bpdkv router` with two worker processes (SO_REUSEPORT) and its own redis-server: a previous_response_id
    chain of 10 turns or more, each on a new connection, is served by both workers, every turn continues the chain and from turn 2
    reuses D's KV."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from tests.router.test_router_workers import _metrics_dir, _start_router, _stop, _worker_pids

    p = VllmEmulator(EmulatorSettings(role="prefill", prefix_caching=False))
    d = VllmEmulator(EmulatorSettings(role="decode"))
    group = ServerGroup([p.app, d.app])
    urls = group.start()
    proc, port, _ = _start_router(tmp_path, urls, workers=2)
    try:
        url = f"http://127.0.0.1:{port}"
        from bpdkv.prometheus_text import metric_value

        def served_by_worker() -> dict[int, float]:
            served: dict[int, float] = {}
            metrics_dir = _metrics_dir(_worker_pids(proc)[0])
            for counter in metrics_dir.glob("counter_*.db"):
                alone = tmp_path / f"worker-{counter.stem}-{len(list(tmp_path.iterdir()))}"
                alone.mkdir()
                (alone / counter.name).write_bytes(counter.read_bytes())
                registry = CollectorRegistry()
                MultiProcessCollector(registry, str(alone))
                served[int(counter.stem.split("_")[1])] = (
                    registry.get_sample_value("bpdkv_router_requests_total", {"route": "/v1/responses", "status": "200"}) or 0
                )
            return served

        # SO_REUSEPORT spreads new connections by a hash: no turn count makes both workers certain. So the chain goes on,
        # 10 turns at a time, until both have served (a bound of 60 turns: 2**-59 to fail by chance).
        previous, turns, served = None, 0, {}
        while turns < 60 and (turns < 10 or len([n for n in served.values() if n > 0]) < 2):
            for _ in range(10):
                kwargs: dict[str, Any] = {"previous_response_id": previous} if previous else {}
                answer = client(url).responses.create(
                    model="emulated", input=f"turn {turns}", max_output_tokens=8, **kwargs
                )  # a new connection
                assert answer.previous_response_id == previous
                previous, turns = answer.id, turns + 1
            served = served_by_worker()
        text = httpx.get(url + "/metrics", timeout=10).text
        assert metric_value(text, "bpdkv_router_api_turns_total", {"api": "responses", "reuse": "hit"}) == turns - 1
        assert len([n for n in served.values() if n > 0]) == 2 and sum(served.values()) == turns, served
    finally:
        _stop(proc)
        group.stop()


def test_reasoning_stream_events() -> None:
    """A thought streams as a reasoning item (reasoning_text deltas), then the message; the final response holds both."""
    import asyncio

    from bpdkv.router.responses import ResponsesSurface, to_chat
    from bpdkv.router.surface import ChatTurn

    chat, history, context = to_chat({"model": "m", "input": "q", "store": False})
    context.update(tenant="t", own=history, previous_response_id=None)
    stream = ResponsesSurface(lambda: sessions.MemoryStore()).translator(ChatTurn(chat, True, None, context))
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "th"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "ink"}}]},
        {"choices": [{"index": 0, "delta": {"content": "done"}, "finish_reason": "stop"}]},
    ]
    raw = stream.feed(chunks) + asyncio.run(stream.finish())
    events = [json.loads(e.split(b"\n")[1][6:]) for e in raw.split(b"\n\n") if e]
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"] and final["output"][0]["content"][0]["text"] == "think"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
