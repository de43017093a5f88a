"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Random draws use the exponential race (argmax of p / E with E ~ Exp(1) is a draw from p; nano-vllm, gpt-fast and the
DeepSeek reference do the same), so a GPU sampler needs no host sync. Each request owns a `torch.Generator`; a
request's draws therefore never depend on which other requests share its batch.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20  # OpenAI's bound on top logprobs


@dataclass
class SamplingParams:
    """Per-request decoding controls (validated on construction; ValueError names the field)."""
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 (or -1) = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None       # number of top logprobs per token (0 = only the sampled token's)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        need(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
             and math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be a number >= 0")
        need(is_int(self.top_k) and self.top_k >= -1, "top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if self.top_k == -1:
            self.top_k = 0
        need(isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool)
             and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2 ** 63), "seed",
             "must be null or an integer in [0, 2^63)")
        need(isinstance(self.stop_token_ids, (list, tuple)) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "must be a list of non-negative token ids")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        need(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop), "stop",
             "must be a string or a list of non-empty strings")
        need(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
             f"must be null or an integer in [0, {MAX_LOGPROBS}]")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        self.stop_token_ids, self.stop = list(self.stop_token_ids), list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """The request's own RNG: seeded when asked, else from the OS entropy pool."""
    g = torch.Generator(device=device)
    g.manual_seed(secrets.randbits(63) if seed is None else seed)
    return g


def mask_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already temperature-scaled) -> copy with the tokens outside top-k / the top-p nucleus at -inf.

    top-k keeps the k best by rank (ties by lower id); top-p keeps the smallest best-first prefix whose probability
    reaches p (the best token always stays)."""
    if top_k <= 0 and top_p >= 1:
        return logits
    vals, idx = torch.sort(logits, descending=True, stable=True)
    drop = torch.zeros_like(vals, dtype=torch.bool)
    if top_k > 0:
        drop[top_k:] = True
    if top_p < 1:
        probs = vals.masked_fill(drop, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs          # mass of the strictly better tokens
        drop |= before >= top_p
        drop[0] = False
    out = logits.clone()
    out[idx[drop]] = float("-inf")
    return out


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from logits [V] fp32."""
    if params.greedy:
        return int(logits.argmax())
    x = mask_top_k_top_p(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = x.softmax(-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_min_(1e-10)
    return int((probs / race).argmax())


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> dict:
    """{"token_id", "logprob", "top_logprobs": [{"token_id", "logprob"}, ... n best]} from the model's own
    distribution (log_softmax of the raw logits, before temperature / top-k / top-p)."""
    lp = torch.log_softmax(logits.float(), -1)
    top = []
    if n > 0:
        vals, idx = torch.topk(lp, n)
        top = [{"token_id": int(i), "logprob": float(v)} for v, i in zip(vals.tolist(), idx.tolist())]
    return {"token_id": int(token), "logprob": float(lp[token]), "top_logprobs": top}
