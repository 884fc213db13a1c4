"""Generations: the fingerprint, its rendering into the router config, and the router's rules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bpdkv.deploy import planner
from bpdkv.generations import compat_fingerprint, generation_id, router_generation
from bpdkv.render import router_config
from bpdkv.router import generations as rules
from bpdkv.router.config import GenerationSpec, RouterConfig, RouterConfigError, UpstreamSpec, config_from_dict
from bpdkv.router.metrics import RouterMetrics
from bpdkv.router.upstreams import Pool, UpstreamState, build_members
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_one_fingerprint_everywhere(name: str) -> None:
    topology = load_topology(ROOT / "examples" / name).topology
    assert planner.compat_fingerprint(topology) == compat_fingerprint(topology)  # the planner's break is the router's
    rendered = [router_config(topology, i) for _, i in topology.instances("router")]
    gen = router_generation(topology)
    assert gen["id"] == generation_id(compat_fingerprint(topology)) and gen["vllm"] == topology.vllm.version
    for config in rendered:
        assert config["generations"] == [gen]
        assert {u["generation"] for u in config["prefill"] + config["decode"]} == {gen["id"]}
        assert config_from_dict(config).generations[0].id == gen["id"]  # the router reads what render wrote


def test_every_compatibility_break_is_a_new_generation() -> None:
    topology = load_topology(ROOT / "examples" / "local-cpu.yaml").topology
    base = compat_fingerprint(topology)
    for key, other in (("vllm", "0.31.0"), ("block_size", [64]), ("kv_cache_dtype", ["fp8"]), ("model", "m"), ("connector", "nixl")):
        assert generation_id(dict(base, **{key: other})) != generation_id(base), key
    assert generation_id(dict(base)) == generation_id(base)


def test_a_config_cannot_leave_an_upstream_out_of_the_generations() -> None:
    data = {
        "listen": "127.0.0.1",
        "port": 0,
        "prefill": [{"name": "p", "url": "http://a", "generation": "g1"}],
        "decode": [{"name": "d", "url": "http://b", "generation": "g9"}, {"name": "e", "url": "http://c"}],
        "generations": [{"id": "g1"}],
    }
    with pytest.raises(RouterConfigError) as err:
        config_from_dict(data)
    assert str(err.value) == (
        "router config: decode d: generation 'g9' is not in generations; "
        "router config: decode e: no generation (every upstream needs one when generations are listed)"
    )


@dataclass
class Fake:
    name: str
    generation: str
    generation_rank: int
    up: bool
    drained: bool = False
    identity_ok: bool = True

    def available(self, now: float) -> bool:
        return self.up and not self.drained and self.identity_ok


GENS = ["g0", "g1", "g2"]
member = st.builds(
    lambda i, g, up, drained, ok: Fake(f"m{i}", GENS[g], g, up, drained, ok),
    st.integers(0, 99),
    st.integers(0, 2),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)


@given(st.lists(member, max_size=6), st.lists(member, max_size=6), st.one_of(st.none(), st.sampled_from(GENS)))
def test_a_turn_stays_in_one_generation_and_prefers_its_own_then_the_newest(prefill, decode, holder) -> None:  # type: ignore[no-untyped-def]
    serves = rules.serving(prefill, decode, 0.0)
    tried = rules.present(prefill, decode)
    chosen, kind = rules.for_turn(holder, rules.ranks(prefill + decode), serves, tried)
    if holder is not None and holder in serves:
        assert (chosen, kind) == (holder, rules.TurnKind.CONTINUED)  # continues where its D is, while that serves
        return
    assert kind is (rules.TurnKind.NEW if holder is None else rules.TurnKind.MOVED)
    if serves:
        assert chosen == max(serves, key=GENS.index)  # the newest generation that serves
    elif tried:
        assert chosen == max(tried, key=GENS.index)
    # Whatever was chosen has (or had) both roles: P and D of one generation only.
    if chosen is not None and (serves or tried):
        assert any(m.generation == chosen for m in prefill) and any(m.generation == chosen for m in decode)


def pools(available: dict[str, bool]) -> tuple[Pool, Pool]:
    gens = (GenerationSpec("old"), GenerationSpec("new"))
    p = build_members((UpstreamSpec("p-old", "http://p1", "old"), UpstreamSpec("p-new", "http://p2", "new")), "prefill", gens)
    d = build_members((UpstreamSpec("d-old", "http://d1", "old"), UpstreamSpec("d-new", "http://d2", "new")), "decode", gens)
    for m in p + d:
        m.healthy = available.get(m.name, True)
    return Pool("prefill", p), Pool("decode", d)


@pytest.mark.parametrize(
    ("down", "holder", "want", "offered"),
    [
        ((), None, "new", False),  # a new conversation: the newest generation
        ((), "d-old", "old", True),  # an old conversation continues on its D's generation, offered its location
        (("p-old",), "d-old", "new", False),  # the old generation has no P left: computed on the new one
        (("p-new",), None, "old", False),  # the newest cannot serve: the older one does
        (("d-new", "p-old"), None, "new", False),  # neither serves: the newest that may be tried (health catching up)
    ],
)
def test_settle_turn_picks_within_one_generation(down: tuple[str, ...], holder: str | None, want: str, offered: bool) -> None:
    prefill, decode = pools({name: False for name in down})
    params = {"remote_engine_id": "e"} if holder else None
    got_params, got_holder = rules.settle_turn(prefill, decode, params, holder, RouterMetrics(), 0.0)
    assert rules.scope() == want
    assert (got_params is not None) is offered and got_holder == (holder if offered else None)
    picked_p, picked_d = prefill.pick(b"affinity"), decode.pick()
    assert picked_p is not None and picked_d is not None
    assert picked_p.generation == picked_d.generation == want  # both picks of the turn, in its generation
    rules.enter(None)


def test_an_unconfirmed_or_mismatched_engine_is_not_available() -> None:
    gen = GenerationSpec("g", vllm="0.34.0", model_root="m")
    (member_,) = build_members((UpstreamSpec("d", "http://d", "g"),), "decode", (gen,))
    assert member_.expect == gen and not member_.available(0.0)  # not before its engine confirmed its generation
    member_.identity_verified = True
    assert member_.available(0.0)
    member_.identity_problem = "runs vLLM 0.33.0; its generation g is vLLM 0.34.0"
    assert not member_.available(0.0) and member_.state(0.0) is UpstreamState.MISMATCHED
    assert member_.describe(0.0)["problem"] == member_.identity_problem
    (plain,) = build_members((UpstreamSpec("d", "http://d"),), "decode", ())
    assert plain.expect is None and plain.available(0.0)  # a config without generations: as before


def test_a_config_without_generations_is_one_generation() -> None:
    config = RouterConfig(prefill=(UpstreamSpec("p", "http://p"),), decode=(UpstreamSpec("d", "http://d"),))
    prefill, decode = (
        Pool(role, build_members(specs, role, config.generations))
        for role, specs in (("prefill", config.prefill), ("decode", config.decode))
    )
    params, holder = rules.settle_turn(prefill, decode, {"remote_engine_id": "e"}, "d", SimpleNamespace(registry=None), 0.0)
    assert params is not None and holder == "d" and rules.scope() == ""
    rules.enter(None)
    assert dataclasses.asdict(config)["generations"] == ()
