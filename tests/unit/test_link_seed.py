"""P's link seed (issue 45 item 3): the file `bpdkv apply` writes after measuring each P↔D link, watched by P
(bpdkv/vllm_plugin/seedfile.py), applied as the prior of what P has not measured (cost.Book.apply_seed): with a fresh
seed P's first decisions on a link are pulled/recomputed by the seeded estimate, never a probe."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bpdkv.vllm_plugin import cost, seedfile

BLOCK = 32
BYTES_PER_BLOCK = 32 * 2048.0  # the tiny model's KV: 2 KiB per token


def write_seed(path: Path, links: dict[str, dict[str, float]], rate: float = 1000.0, age_s: float = 0.0) -> None:
    doc = {
        "version": 1,
        "measured_at": time.time() - age_s,
        "prefill": "prefill-0",
        "pairs": {},
        "seed": {"prefill_tokens_per_s": rate, "links": links},
    }
    path.write_text(json.dumps(doc))


def request(tokens: int) -> cost.Request:
    return cost.Request(tokens, BLOCK, BYTES_PER_BLOCK, 16)


def decide(book: cost.Book, tokens: int, engine: str = "e1") -> cost.Choice:
    return book.decide("10.0.0.2:5600", request(tokens), now=100.0, engine=engine)


def test_without_a_seed_the_first_offers_probe_or_recompute() -> None:
    book = cost.Book()
    first = decide(book, 640)
    assert (first.outcome, first.reason) == (cost.Outcome.RECOMPUTED, cost.Reason.NO_ESTIMATE)


@pytest.mark.parametrize(
    ("rate", "outcome", "reason"),
    [
        (1e9, cost.Outcome.PULLED, cost.Reason.FIRST_CONTACT),  # a fast link: the whole offer, at first contact
        (1e5, cost.Outcome.RECOMPUTED, cost.Reason.LINK_SLOWER),  # a slow one: computed, by the estimate
    ],
)
def test_a_fresh_seed_decides_the_first_offer(tmp_path: Path, rate: float, outcome: cost.Outcome, reason: cost.Reason) -> None:
    path = tmp_path / "link-seed.json"
    write_seed(path, {"10.0.0.2": {"bytes_per_s": rate, "overhead_s": 0.002}})
    loaded = seedfile.SeedFile(str(path)).poll(now=0.0)
    assert loaded is not None
    book = cost.Book()
    book.apply_seed(loaded.seed, "seed")
    first = decide(book, 640)
    assert (first.outcome, first.reason) == (outcome, reason)
    assert first.outcome is not cost.Outcome.PROBE
    if first.outcome is cost.Outcome.PULLED:  # once pulled (the handshake paid): the next offer by the estimate too
        nbytes = 640 / BLOCK * BYTES_PER_BLOCK
        book.observe_pull("10.0.0.2:5600", "e1", nbytes, 0.002 + nbytes / rate, 101.0, False)
        later = decide(book, 640)
        assert (later.outcome, later.reason) == (cost.Outcome.PULLED, cost.Reason.LINK_FASTER)


def test_a_seed_arriving_later_seeds_links_p_met_but_never_overrides_measurements() -> None:
    book = cost.Book()
    decide(book, 640)  # P met the link: no estimate yet
    other = book.link("10.0.0.3:5600")
    other.estimate.observe(65536.0, 0.5)  # P measured this one itself: 131 KB/s
    book.apply_seed({"prefill_tokens_per_s": 1000.0, "links": {"*": {"bytes_per_s": 1e9, "overhead_s": 0.001}}}, "seed")
    assert book.link("10.0.0.2:5600").bytes_per_s == pytest.approx(1e9)
    assert book.link("10.0.0.3:5600").bytes_per_s != pytest.approx(1e9)  # measured wins
    assert book.compute.fit is not None and 1 / book.compute.fit.slope == pytest.approx(1000.0)


def test_exact_side_channel_beats_host_and_wildcard() -> None:
    book = cost.Book()
    book.apply_seed({"links": {"*": {"bytes_per_s": 1.0}, "10.0.0.2": {"bytes_per_s": 2.0}, "10.0.0.2:5601": {"bytes_per_s": 3.0}}}, "seed")
    assert book.link("10.0.0.2:5601").bytes_per_s == pytest.approx(3.0)
    assert book.link("10.0.0.2:5600").bytes_per_s == pytest.approx(2.0)
    assert book.link("10.0.0.9:5600").bytes_per_s == pytest.approx(1.0)


def test_the_file_is_read_once_per_change_and_at_most_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "link-seed.json"
    watcher = seedfile.SeedFile(str(path))
    assert watcher.poll(now=0.0) is None  # not written yet
    write_seed(path, {"*": {"bytes_per_s": 5e8}})
    assert watcher.poll(now=0.5) is None  # within the check interval
    assert watcher.poll(now=1.5) is not None
    assert watcher.poll(now=3.0) is None  # unchanged
    write_seed(path, {"*": {"bytes_per_s": 7e8, "overhead_s": 0.01}})
    os.utime(path, (time.time() + 5, time.time() + 5))
    loaded = watcher.poll(now=4.5)
    assert loaded is not None and loaded.seed["links"]["*"]["bytes_per_s"] == 7e8


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{", "not JSON"),
        ('{"version": 2}', "not a version-1 link seed"),
        ('{"version": 1, "seed": {}}', "needs a seed mapping and measured_at"),
        ('{"version": 1, "seed": {}, "measured_at": true}', "needs a seed mapping and measured_at"),
    ],
)
def test_bad_files_say_why_and_are_not_used(text: str, why: str) -> None:
    got = seedfile.parse(text, time.time(), seedfile.DEFAULT_MAX_AGE_S)
    assert isinstance(got, str) and got.startswith(why)


def test_a_stale_seed_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "link-seed.json"
    write_seed(path, {"*": {"bytes_per_s": 5e8}}, age_s=7200)
    assert seedfile.SeedFile(str(path), max_age_s=3600).poll(now=0.0) is None
    assert seedfile.SeedFile(str(path), max_age_s=10_000).poll(now=0.0) is not None


@pytest.mark.parametrize(
    "links",
    [{"h": {"bytes_per_s": 0}}, {"h": {"bytes_per_s": -1}}, {"h": {"overhead_s": 1}}, {"h": "fast"}, {"h": {"bytes_per_s": "nan"}}],
)
def test_bad_seed_values_raise_naming_where(links: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"^where\.links\.h"):
        cost.Book().apply_seed({"links": links}, "where")


# ---- the deploy side: what apply runs on P's node (bpdkv/deploy/linkseed.py) ------------------------------------


def test_probe_sizes_are_whole_blocks_above_the_threshold_within_the_model() -> None:
    from bpdkv.deploy import linkseed

    assert linkseed.probe_sizes(128, 64, 32768) == [256, 1024, 4096]
    assert linkseed.probe_sizes(32, 16, 1024) == [64, 256]  # the tiny model: 1,024 tokens
    small = linkseed.probe_sizes(128, 64, 300)
    assert len(small) >= 1 and all(n % 128 == 0 and n <= 300 for n in small)


def test_the_command_and_its_output_line(tmp_path: Path) -> None:
    from bpdkv.deploy import linkseed

    cmd = linkseed.command(
        "/opt/v/bin/python", "prefill-0", "http://127.0.0.1:8100", [("decode-0", "http://10.0.0.2:8200")], "m", [64, 256], 120
    )
    assert cmd.split() == [
        "/opt/v/bin/python", "-m", "bpdkv.deploy.linkseed", "prefill-0", "http://127.0.0.1:8100",
        "/var/lib/bpdkv/prefill-0/link-seed.json", "m", "64,256", "120", "decode-0=http://10.0.0.2:8200",
    ]  # fmt: skip
    assert linkseed.parse_output('noise\n{"written": true, "pairs": {}}\n') == {"written": True, "pairs": {}}
    assert isinstance(linkseed.parse_output("Traceback ..."), str)
    doc = {"version": 1, "measured_at": time.time(), "seed": {"links": {"10.0.0.2": {"bytes_per_s": 1e8, "overhead_s": 0.01}}}}
    path = tmp_path / "state" / "link-seed.json"
    linkseed.write(str(path), doc)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".link-seed.")]  # no temp file left
    loaded = seedfile.SeedFile(str(path)).poll(now=0.0)  # what apply writes is what P reads
    assert loaded is not None and loaded.seed == doc["seed"]


def test_apply_and_status_lines_say_rate_overhead_age_or_why_not() -> None:
    from bpdkv.deploy import linkseed

    now = time.time()
    doc = {
        "version": 1,
        "measured_at": now - 300,
        "pairs": {"decode-0": {"bytes_per_s": 1.0364e9, "overhead_s": 0.0275}, "decode-1": {"url": "u", "error": "ConnectError: refused"}},
        "seed": {"prefill_tokens_per_s": 1120.0, "links": {}},
    }
    assert linkseed.report_lines("prefill-0", ("decode-0", "decode-1"), doc) == [
        "link prefill-0→decode-0: 1,036.4 MB/s + 27.5 ms per pull, P computes 1,120 tokens/s (seed written for prefill-0)",
        "link prefill-0→decode-1: not measured (ConnectError: refused); P learns it from live pulls",
    ]
    assert linkseed.report_lines("prefill-0", ("decode-0",), "ssh: timed out") == [
        "link prefill-0→decode-0: not measured (ssh: timed out); P learns it from live pulls"
    ]
    assert linkseed.status_lines(json.dumps(doc), now) == [
        "→decode-0: 1,036.4 MB/s + 27.5 ms per pull, measured 5 min ago",
        "→decode-1: not measured (ConnectError: refused), 5 min ago",
    ]
    assert linkseed.status_lines("", now) == ["links: not measured (no seed yet: apply measures them after its gates)"]
    assert linkseed.status_lines("{", now) == ["links: the seed file is not JSON (apply rewrites it)"]
