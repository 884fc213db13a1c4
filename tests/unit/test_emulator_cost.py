"""The emulator's P (bpdkv connector on) follows the cost model as the real connector does: it pulls while the link is
fast (after a bounded probe while it is unknown), computes locally once pulls are measured slower than its own compute, lets D's hold go, and tells the
router (`bpdkv_pull_outcome: link_slower`). The real connector's behaviour: tests/e2e/test_slow_link.py."""

from __future__ import annotations

from bpdkv import contracts
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from bpdkv.turn_client import TurnClient

ROUTE = "/v1/completions"


def run(pull_seconds_per_token: float) -> tuple[list[str | None], VllmEmulator]:
    base = {"block_size": 16, "kv_recompute_threshold": 16}
    p = VllmEmulator(EmulatorSettings(role="prefill", prefill_plugin=True, prefill_seconds_per_token=0.0002, prefix_caching=False, **base))  # type: ignore[arg-type]
    p.settings.pull_seconds_per_token = pull_seconds_per_token
    d = VllmEmulator(EmulatorSettings(role="decode", **base))  # type: ignore[arg-type]
    d.settings.pull_seconds_per_token = pull_seconds_per_token  # one link, both ways: D's estimate (its hint to P) agrees
    group = ServerGroup([p.app, d.app])
    p_url, d_url = group.start()
    client = TurnClient(p_url, d_url, timeout=30)
    prompt = [(i * 7) % 200 + 10 for i in range(300)]
    offer = None
    outcomes = []
    try:
        # P's rate comes from what it computes itself: a few first turns of other conversations.
        for c in range(3):
            client.prefill(ROUTE, {"model": "emulated", "prompt": [(i * 3 + c) % 200 + 10 for i in range(300)], "max_tokens": 1}, None)
        for turn in range(5):
            body = {"model": "emulated", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            p_params, _ = client.prefill(ROUTE, body, offer)
            outcomes.append(p_params.get(contracts.PULL_OUTCOME))
            reply, data = client.decode(ROUTE, dict(body, return_token_ids=True), p_params)
            offer = reply.params
            prompt = prompt + list(data["choices"][0]["token_ids"]) + [5] * 16
            assert turn == 0 or offer
    finally:
        group.stop()
    return outcomes, d


def test_a_fast_link_is_pulled_a_slow_one_computed() -> None:
    fast, _ = run(pull_seconds_per_token=0.00001)  # pulls 20x faster than computing
    pulled = {"verified", "cut"}  # cut: D's last block holds its sampled tail, which the next prompt does not repeat
    # No blind pull (issue 34): turn 2 is the first contact with that D and nothing is known of the link (D's first pull
    # of P's blocks paid the handshake, not fitted): P computes. From turn 3 D's answer carries its estimate of the link:
    # fast, the whole offer is pulled (the handshake pull, not fitted); then a bounded probe measures the link for P,
    # then whole pulls. Slow: P computes and lets D's hold go.
    assert fast[0] is None and fast[1] == "no_estimate", fast
    assert fast[2] in pulled and fast[3] == contracts.PULL_PROBE and fast[4] in pulled, fast
    slow, d = run(pull_seconds_per_token=0.002)  # pulls 10x slower
    assert slow[0] is None and slow[1] == "no_estimate", slow
    assert slow[2:] == [contracts.PULL_LINK_SLOWER] * 3, slow
    assert len(d.held) == 1  # D let the declined holds go (the fence's release); the last turn's is held
