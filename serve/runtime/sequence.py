"""Per-request state: the request, its tokens, status, model state, RNG, counters and incremental text."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dsflash.serve.runtime.sampling import SamplingParams, make_generator
from dsflash.serve.speculative import SpecStats


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class Output:
    """What one scheduler step produced for one request (the streaming unit; a speculative decode may add several
    tokens).

    `text` is the detokenized text added by this output (stop strings and stop tokens excluded; text that could be
    the start of a stop string is held back until it is decided). `logprobs`: one dict per new token,
    {"token_id", "logprob", "top_logprobs": [{"token_id", "logprob"}, ...]}, when the request asked for them."""
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" once finished
    logprobs: list[dict] | None
    prompt_tokens: int
    completion_tokens: int
    text: str = ""
    spec: dict | None = None           # speculative engines: the request's acceptance so far (`Sequence.spec_report`)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"    # waiting again, its cache discarded; it recomputes prompt + generated tokens
    FINISHED = "finished"


class IncrementalText:
    """Detokenize generated ids one at a time (prefix/read offsets, so multi-token UTF-8 characters come out whole)
    and cut the text at the first stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix, self.read = 0, 0
        self.text, self.emitted = "", 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, token: int) -> bool:
        """Add a token; True when a stop string now appears (the text is cut before it)."""
        self.ids.append(token)
        if self.tok is None:
            return False
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return False
        old = len(self.text)
        self.text += now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        hits = [p for p in (self.text.find(s, max(0, old - len(s) + 1)) for s in self.stop) if p >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False

    def take(self, final: bool) -> str:
        """The text not yet emitted (all of it when final, else minus what could still become a stop string)."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out


class Sequence:
    """One request inside the engine. `token_ids` = prompt + generated; `num_computed` of them are in the cache."""

    def __init__(self, req: Request, tokenizer=None, eos_token_id: int | None = None):
        self.request_id, self.params, self.arrival = req.request_id, req.params, req.arrival
        self.token_ids = list(req.prompt_ids)
        self.num_prompt = len(self.token_ids)
        self.num_computed = 0
        self.status = Status.WAITING
        self.state = None                    # the model's per-request state (rank 0; workers mirror it)
        self.generator = make_generator(req.params.seed)
        self.text = IncrementalText(tokenizer, req.params.stop)
        stops = set(req.params.stop_token_ids)
        if eos_token_id is not None and not req.params.ignore_eos:
            stops.add(eos_token_id)
        self.stop_ids = frozenset(stops)
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # speculative engines (rank 0): the batch-1 SpeculativeDecoder over `state`, the last prompt chunk's drafter
        # rows waiting for the sampled token, and the request's acceptance counts (kept across preemptions)
        self.spec = None
        self.spec_pending = None
        self.spec_stats = SpecStats()
        self.spec_simulated = False

    def spec_report(self) -> dict:
        """Per-request AL / DAR (TensorRT-LLM names), for the responses."""
        s = self.spec_stats
        out = {"acceptance_length": s.mean_al, "draft_acceptance_rate": s.dar, "verify_steps": s.steps,
               "draft_tokens": s.drafted, "accepted_draft_tokens": s.accepted}
        if self.spec_simulated:
            out["simulated_acceptance"] = True
        return out

    def remaining(self, max_seq_len: int) -> int:
        """New tokens this request may still emit (max_tokens and max_seq_len)."""
        return min(self.params.max_tokens - self.num_generated, max_seq_len - len(self.token_ids))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def is_decode(self) -> bool:
        """Next step feeds exactly the last sampled token (otherwise it is (re)computing prompt or history)."""
        return self.num_computed >= self.num_prompt and self.num_computed == len(self.token_ids) - 1

    def next_segment(self, start: int, chunk: int) -> tuple[int, int]:
        """[start, end) of the next model call: prompt chunks end at multiples of `chunk`, later tokens go one by
        one. Fixed boundaries make a request's computation independent of its batch and of preemptions."""
        if start < self.num_prompt:
            return start, min((start // chunk + 1) * chunk, self.num_prompt)
        return start, start + 1

    def append(self, token: int, max_tokens: int, max_seq_len: int) -> None:
        """Add a sampled token and decide whether the request is finished."""
        self.token_ids.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.text.push(token):
            self.finish_reason = "stop"
        elif self.num_generated >= max_tokens or len(self.token_ids) >= max_seq_len:
            self.finish_reason = "length"

    def reset_cache(self) -> None:
        """Preempted: drop the model state; the prompt and generated tokens are recomputed later."""
        self.state, self.num_computed, self.status = None, 0, Status.PREEMPTED
        self.spec = self.spec_pending = None
        self.num_preemptions += 1
