"""Streaming responses carry the final kv_transfer_params (a last SSE chunk before [DONE]).

Wraps the chat and completions stream generators of vLLM's OpenAI server. Requests without
kv_transfer_params pass through untouched (byte-identical). Skipped where vLLM already streams them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

log = logging.getLogger("bpdkv.vllm_plugin")

# (module, class, stream method, response-chunk model module, model name) across vLLM layouts.
TARGETS = [
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "chat_completion_stream_generator", "chat.completion.chunk"),
    ("vllm.entrypoints.openai.serving_chat", "OpenAIServingChat", "chat_completion_stream_generator", "chat.completion.chunk"),
    ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion", "completion_stream_generator", "text_completion"),
    ("vllm.entrypoints.openai.serving_completion", "OpenAIServingCompletion", "completion_stream_generator", "text_completion"),
]
STREAM_MODELS = [
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionStreamResponse"),
    ("vllm.entrypoints.openai.protocol", "ChatCompletionStreamResponse"),
]
DONE = "data: [DONE]\n\n"


async def _with_final_params(original: Any, bound: inspect.BoundArguments, object_type: str) -> AsyncIterator[str]:
    seen: dict[str, Any] = {}

    async def tap(results: Any) -> AsyncIterator[Any]:
        async for item in results:
            output = item[1] if isinstance(item, tuple) else item
            params = getattr(output, "kv_transfer_params", None)
            if params is not None:
                seen["params"] = params
            seen.setdefault("id", getattr(output, "request_id", None))
            yield item

    bound.arguments["result_generator"] = tap(bound.arguments["result_generator"])
    async for chunk in original(*bound.args, **bound.kwargs):
        if chunk == DONE and "params" in seen:
            final = {
                "id": bound.arguments.get("request_id") or seen.get("id"),
                "object": object_type,
                "created": int(time.time()),
                "model": bound.arguments.get("model_name"),
                "choices": [],
                "kv_transfer_params": seen["params"],
            }
            yield f"data: {json.dumps(final, separators=(',', ':'))}\n\n"
        yield chunk


def native_support() -> bool:
    """True if this vLLM's stream chunks already have a kv_transfer_params field."""
    for module, name in STREAM_MODELS:
        try:
            model = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        return "kv_transfer_params" in getattr(model, "model_fields", {})
    return False


def _wrap(original: Any, object_type: str) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[str]:
        # A plain function returning the generator: requests without kv_transfer_params get vLLM's own generator
        # object, not a wrapped one, so nothing about them changes (not even one more await per chunk).
        bound = signature.bind(self, *args, **kwargs)
        request = bound.arguments.get("request")
        if getattr(request, "kv_transfer_params", None) is None or "result_generator" not in bound.arguments:
            return original(self, *args, **kwargs)  # type: ignore[no-any-return]
        return _with_final_params(original, bound, object_type)

    wrapper._bpdkv_wrapped = True  # type: ignore[attr-defined]
    return wrapper


def install() -> list[str]:
    """Patch what this vLLM has; return what was patched (for logs and tests)."""
    if native_support():
        log.info("bpdkv: this vLLM streams kv_transfer_params itself; streaming patch not installed")
        return []
    patched = []
    for module_name, class_name, method, object_type in TARGETS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        original = getattr(cls, method, None)
        if original is None or getattr(original, "_bpdkv_wrapped", False):
            continue
        setattr(cls, method, _wrap(original, object_type))
        patched.append(f"{class_name}.{method}")
    if patched:
        log.info("bpdkv: streaming responses carry kv_transfer_params (%s)", ", ".join(patched))
    return patched
