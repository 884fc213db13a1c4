"""Deterministic multi-turn conversations (same seed → same requests).

Two shapes: `uniform` (every turn adds new_tokens) and `agentic` — an agent loop: a long first prompt (a history of
4–16k tokens: instructions, earlier work), then tool results of 50–500 tokens per turn and now and then a document of
2–8k tokens (doc_share of the turns), with think time between turns. `scale` multiplies every agentic size (the CPU
lab's tiny model has a 1024-token context: scale 0.05)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

WORDS = (
    "cache block token prefill decode transfer router reuse history turn answer question data layer head value "
    "key network node engine request stream agent tool call result system user plan file code test build"
).split()


@dataclass(frozen=True)
class WorkloadSpec:
    conversations: int = 8
    turns: int = 6
    system_tokens: int = 200  # shared system prompt
    start_history_tokens: int = 0  # extra history in the first user message
    new_tokens: int = 150  # new user tokens per turn
    output_tokens: int = 64  # per turn (ignore_eos)
    think_time: float = 0.0  # seconds between a reply and the next turn
    concurrency: int = 4
    mode: str = "tokens"  # tokens (token-id /v1/completions) | chat
    stream: bool = True
    seed: int = 0
    vocab: int = 2000  # token ids drawn from [10, vocab)
    model: str | None = None
    # Send X-Bpdkv-Last-Turn on each conversation's final turn (a client that knows no turn follows): D holds nothing
    # for it and the router stores nothing. Off by default: an agent loop rarely knows its last turn in advance.
    mark_last_turn: bool = False
    shape: str = "uniform"  # uniform | agentic
    tool_tokens: tuple[int, int] = (50, 500)  # agentic: a tool result's size (uniform between)
    doc_tokens: tuple[int, int] = (2000, 8000)  # agentic: a document's size
    doc_share: float = 0.1  # agentic: share of turns >= 2 that bring a document
    history_tokens: tuple[int, int] = (4000, 16000)  # agentic: the first prompt's size
    scale: float = 1.0  # agentic: every size above times this

    def sized(self, span: tuple[int, int], rng: random.Random) -> int:
        low, high = (max(1, round(v * self.scale)) for v in span)
        return rng.randint(low, max(low, high))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Conversation:
    """One conversation's requests; the next turn appends what the server answered."""

    def __init__(self, spec: WorkloadSpec, index: int) -> None:
        self.spec = spec
        self.index = index
        self.rng = random.Random(spec.seed * 1_000_003 + index)
        self.new_tokens, self.kind = 0, "first"  # of the turn last requested
        shared = random.Random(spec.seed)  # the system prompt is the same for every conversation
        if spec.mode == "tokens":
            self.tokens: list[int] = [shared.randrange(10, spec.vocab) for _ in range(spec.system_tokens)]
            self.tokens += [self.rng.randrange(10, spec.vocab) for _ in range(spec.start_history_tokens)]
        else:
            system = " ".join(shared.choice(WORDS) for _ in range(spec.system_tokens))
            self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
            self.pending_history = " ".join(self.rng.choice(WORDS) for _ in range(spec.start_history_tokens))

    def turn_size(self, turn: int) -> tuple[int, str]:
        """(new tokens, kind) of this turn: kind first | tool | doc (agentic) or turn (uniform)."""
        spec = self.spec
        if spec.shape != "agentic":
            return spec.new_tokens, "first" if turn == 0 else "turn"
        if turn == 0:
            return spec.sized(spec.history_tokens, self.rng), "first"
        if self.rng.random() < spec.doc_share:
            return spec.sized(spec.doc_tokens, self.rng), "doc"
        return spec.sized(spec.tool_tokens, self.rng), "tool"

    def next_request(self, turn: int) -> dict[str, Any]:
        spec = self.spec
        self.new_tokens, self.kind = self.turn_size(turn)
        body: dict[str, Any] = {"max_tokens": spec.output_tokens, "ignore_eos": True, "temperature": 0, "stream": spec.stream}
        if spec.model:
            body["model"] = spec.model
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        if spec.mode == "tokens":
            self.tokens += [self.rng.randrange(10, spec.vocab) for _ in range(self.new_tokens)]
            body["prompt"] = list(self.tokens)
            body["return_token_ids"] = True
        else:
            text = " ".join(self.rng.choice(WORDS) for _ in range(self.new_tokens))
            if turn == 0 and self.pending_history:
                text = self.pending_history + " " + text
            self.messages.append({"role": "user", "content": f"[{self.index}:{turn}] {text}"})
            body["messages"] = list(self.messages)
        return body

    def record_answer(self, text: str, token_ids: list[int] | None) -> None:
        if self.spec.mode == "tokens":
            if token_ids:
                self.tokens += token_ids
            else:  # servers that do not return token ids: keep the history growing the same way for every run
                self.tokens += [11] * self.spec.output_tokens
        else:
            self.messages.append({"role": "assistant", "content": text})

    @property
    def history_tokens(self) -> int:
        if self.spec.mode == "tokens":
            return len(self.tokens)
        return sum(len(m["content"].split()) for m in self.messages)
