"""bpdkv/vllm_plugin/quiet.py: NIXL agents get a progress-thread poll timeout > 0 (no busy spin); the registration
of bpdkv's connector by name (MultiConnector looks children up by name) and the cache-manager binding inside a
MultiConnector (bpdkv/vllm_plugin/__init__.py)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from bpdkv import vllm_plugin
from bpdkv.vllm_plugin import quiet


class FakeConfig:
    """nixlBind.nixlAgentConfig's fields as NIXL's Python agent sets them."""

    def __init__(self) -> None:
        self.useProgThread = True
        self.pthrDelay = 0


class FakeBindings(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("_bindings")
        self.created: list[tuple[str, int, bool]] = []
        self.nixlAgentConfig = FakeConfig
        self.DRAM_SEG = "dram"

    def nixlAgent(self, name: str, config: FakeConfig) -> str:  # noqa: N802
        self.created.append((name, config.pthrDelay, config.useProgThread))
        return f"agent:{name}"


def fake_api(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, FakeBindings]:
    """A module shaped like NIXL's `_api`: its agent reads the module global `nixlBind` and zeroes pthrDelay."""
    module = types.ModuleType("nixl._api")
    bindings = FakeBindings()
    module.nixlBind = bindings  # type: ignore[attr-defined]

    def make_agent(name: str, prog_thread: bool = True) -> Any:
        config = module.nixlBind.nixlAgentConfig()  # type: ignore[attr-defined]
        config.useProgThread = prog_thread
        config.pthrDelay = 0  # what NIXL's nixl_agent.__init__ always does
        return module.nixlBind.nixlAgent(name, config)  # type: ignore[attr-defined]

    module.make_agent = make_agent  # type: ignore[attr-defined]
    for name in quiet.AGENT_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "nixl._api", module)
    monkeypatch.setattr(quiet, "AGENT_MODULES", ("nixl._api",))
    return module, bindings


def test_agents_get_the_delay_and_everything_else_is_forwarded(monkeypatch: pytest.MonkeyPatch) -> None:
    module, bindings = fake_api(monkeypatch)
    quiet.configure({})
    assert module.make_agent("a") == "agent:a"  # type: ignore[attr-defined]
    assert bindings.created == [("a", quiet.DEFAULT_DELAY_US, True)]
    assert module.nixlBind.DRAM_SEG == "dram"  # type: ignore[attr-defined]  # other names pass through


def test_configured_delay_and_idempotent_install(monkeypatch: pytest.MonkeyPatch) -> None:
    module, bindings = fake_api(monkeypatch)
    quiet.configure({quiet.DELAY_KEY: 2500})
    quiet.configure({quiet.DELAY_KEY: 4000})  # a second connector in the process: one proxy, the newer delay
    assert not isinstance(module.nixlBind._bpdkv_real, quiet._DelayedBindings)  # type: ignore[attr-defined]
    module.make_agent("b")  # type: ignore[attr-defined]
    assert bindings.created == [("b", 4000, True)]


def test_zero_keeps_nixls_busy_poll_and_no_thread_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    module, bindings = fake_api(monkeypatch)
    quiet.configure({quiet.DELAY_KEY: 0})
    module.make_agent("c")  # type: ignore[attr-defined]
    assert bindings.created == [("c", 0, True)]
    quiet.configure({})
    module.make_agent("d", prog_thread=False)  # type: ignore[attr-defined]
    assert bindings.created[-1] == ("d", 0, False)  # no progress thread: nothing to delay


@pytest.mark.parametrize("bad", [-1, "soon", None, 1.5e3j])
def test_bad_delay_is_a_start_up_error_naming_the_key(monkeypatch: pytest.MonkeyPatch, bad: Any) -> None:
    fake_api(monkeypatch)
    with pytest.raises(ValueError, match=quiet.DELAY_KEY):
        quiet.configure({quiet.DELAY_KEY: bad})


def test_a_nixl_without_the_hook_is_reported_not_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("nixl._api")
    monkeypatch.setitem(sys.modules, "nixl._api", module)
    monkeypatch.setattr(quiet, "AGENT_MODULES", ("nixl._api",))
    assert quiet.install(1000) == "nixl._api has no nixlBind.nixlAgent"
    assert not hasattr(module, "nixlBind")


class FakeFactory:
    _registry: dict[str, Any] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")
        cls._registry[name] = (module_path, class_name)


def test_connector_registered_by_name_once(monkeypatch: pytest.MonkeyPatch) -> None:
    factory_module = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.factory")
    factory_module.KVConnectorFactory = FakeFactory  # type: ignore[attr-defined]
    monkeypatch.setattr(FakeFactory, "_registry", {})
    for name in ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, factory_module.__name__, factory_module)
    vllm_plugin._register_connector()
    vllm_plugin._register_connector()  # vLLM may load the plugin twice in a process: no "already registered"
    assert FakeFactory._registry == {"BpdkvNixlConnector": ("bpdkv.vllm_plugin.connector", "BpdkvNixlConnector")}


def test_bpdkv_connectors_found_inside_a_multiconnector() -> None:
    class Bpdkv:
        _bpdkv_unbound = True

    class Offloading:
        pass

    mine = Bpdkv()
    multi = types.SimpleNamespace(_connectors=[mine, Offloading()])
    assert vllm_plugin.bpdkv_connectors(multi) == [mine]
    assert vllm_plugin.bpdkv_connectors(mine) == [mine]
    assert vllm_plugin.bpdkv_connectors(Offloading()) == []
    assert vllm_plugin.bpdkv_connectors(None) == []
