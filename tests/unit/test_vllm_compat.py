"""compat's feature detection against the class shapes of vLLM 0.33.0 and 0.34.0 (names read from the wheels)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bpdkv.vllm_plugin import compat

SHAPES = json.loads((Path(__file__).parent.parent / "data" / "vllm_shapes.json").read_text())["versions"]


def fake(cls: str, version: str, **values: Any) -> Any:
    """An object with exactly the attributes the release's class has (of the ones compat looks for)."""
    names = SHAPES[version][cls]
    obj = SimpleNamespace()
    for name in names:
        if name == "get_skip_reading_prefix_cache":
            setattr(obj, name, lambda: values.get("skip_reading_prefix_cache", False))
        elif name == "may_load_async":
            setattr(obj, name, lambda request: False)
        else:
            setattr(obj, name, values.get(name))
    return obj


def test_the_fixture_records_the_renames() -> None:
    assert "skip_reading_prefix_cache" in SHAPES["0.33.0"]["Request"]
    assert "skip_reading_external_kv" in SHAPES["0.34.0"]["Request"]
    assert "skip_reading_prefix_cache" not in SHAPES["0.34.0"]["Request"]
    assert "_block_hash" in SHAPES["0.33.0"]["KVCacheBlock"] and "_block_hash" not in SHAPES["0.34.0"]["KVCacheBlock"]
    assert {"resumed_req_ids", "all_token_ids"} <= set(SHAPES["0.33.0"]["CachedRequestData"])
    assert not {"resumed_req_ids", "all_token_ids"} & set(SHAPES["0.34.0"]["CachedRequestData"])
    assert "may_load_async" in SHAPES["0.34.0"]["KVConnectorBase_V1"]
    assert "may_load_async" not in SHAPES["0.33.0"]["KVConnectorBase_V1"]
    assert (SHAPES["0.33.0"]["NIXL_CONNECTOR_VERSION"], SHAPES["0.34.0"]["NIXL_CONNECTOR_VERSION"]) == (15, 16)
    assert "all_token_ids" in SHAPES["0.34.0"]["Request"]  # what the plugin reads a finished request's tokens from


@pytest.mark.parametrize(
    ("version", "values"),
    [("0.33.0", {"skip_reading_prefix_cache": True}), ("0.34.0", {"skip_reading_external_kv": True})],
)
def test_a_request_that_skips_external_kv_is_seen_on_both(version: str, values: dict[str, Any]) -> None:
    assert compat.skips_external_kv(fake("Request", version, **values)) is True
    off = {k: False for k in values}
    assert compat.skips_external_kv(fake("Request", version, **off)) is False


def test_a_request_without_either_attribute_reads() -> None:
    assert compat.skips_external_kv(SimpleNamespace(num_tokens=3)) is False


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_block_hash_on_both(version: str) -> None:
    block = fake("KVCacheBlock", version, block_hash=b"h", _block_hash=b"h")
    assert compat.block_hash(block) == b"h"
    only_private = SimpleNamespace(_block_hash=b"p")  # 0.33 without its property
    assert compat.block_hash(only_private) == b"p"


def test_resumed_ids_are_empty_where_the_field_is_gone() -> None:
    old = fake("CachedRequestData", "0.33.0", resumed_req_ids={"a"}, all_token_ids={})
    new = fake("CachedRequestData", "0.34.0", req_ids=["a"])
    assert compat.resumed_req_ids(old) == {"a"}
    assert compat.resumed_req_ids(new) == set()


def test_may_load_async_by_feature() -> None:
    assert compat.has_may_load_async(fake("KVConnectorBase_V1", "0.34.0"))
    assert not compat.has_may_load_async(fake("KVConnectorBase_V1", "0.33.0"))


def test_kv_cache_sizing_and_utilization() -> None:
    extensible = fake("CacheConfig", "0.34.0", enable_extensible_kv_cache=True, resolved_gpu_memory_utilization=1.0)
    assert compat.kv_cache_sizing(extensible) == "extensible"
    assert compat.gpu_memory_utilization(extensible) == 1.0
    by_bytes = fake("CacheConfig", "0.34.0", kv_cache_memory_bytes=1 << 30, enable_extensible_kv_cache=False)
    assert compat.kv_cache_sizing(by_bytes) == "bytes"
    old = fake("CacheConfig", "0.33.0", gpu_memory_utilization=0.45)
    assert compat.kv_cache_sizing(old) == "profiled"
    assert compat.gpu_memory_utilization(old) == 0.45


def test_notes_name_inflight_loads_only_where_vllm_has_may_load_async(caplog: pytest.LogCaptureFixture) -> None:
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_inflight_kv_loads=4),
        cache_config=fake("CacheConfig", "0.34.0", enable_extensible_kv_cache=True, resolved_gpu_memory_utilization=1.0),
    )
    lines = compat.notes(config, fake("KVConnectorBase_V1", "0.34.0"))
    assert len(lines) == 2 and lines[0].startswith("--max-num-inflight-kv-loads 4")
    assert "extensible KV cache (gpu_memory_utilization 1.0)" in lines[1]
    assert compat.notes(config, fake("KVConnectorBase_V1", "0.33.0"))[0].startswith("extensible")
    plain = SimpleNamespace(scheduler_config=SimpleNamespace(), cache_config=fake("CacheConfig", "0.33.0"))
    assert compat.notes(plain, fake("KVConnectorBase_V1", "0.33.0")) == []
    log = logging.getLogger("test.compat")
    with caplog.at_level(logging.INFO, logger="test.compat"):
        compat.log_notes(config, log)
    assert "extensible KV cache" in caplog.text
