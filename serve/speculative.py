"""Speculative decoding maths: accept/reject a drafted block against the target, and acceptance accounting.

Pure functions over tensors (no model, no state), batched over B rows with K drafted tokens each:

- `greedy_accept`: a draft token is accepted iff it equals the target argmax at its position; stop at the first
  mismatch; the next token is the target argmax after the accepted prefix (TensorRT-LLM's greedy rule).
- `rejection_accept`: draft token d at position j is accepted with probability min(1, p_j(d) / q_j(d)) (p target,
  q draft); on the first rejection the next token is drawn from norm(max(p_j − q_j, 0)); if all are accepted, from
  p_K. Every emitted token is then distributed exactly as the target's (Leviathan et al. 2023; gpt-fast
  `speculative_decode`, with p and q named the other way round there). A drafter that proposes deterministically
  (greedy) passes `draft_probs=None`: q is one-hot, accept with probability p(d), resample from p with d removed.
- `simulated_accept`: the benchmark aid (`--simulate-acceptance-length L`): accepted counts drawn so that the
  acceptance length (accepted + 1) has mean L, capped by the block.

Names and metrics follow TensorRT-LLM (conventions.md §6): acceptance length AL = tokens emitted per verify step
(accepted drafts + 1), draft acceptance rate DAR = accepted drafts / drafted tokens.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch


def _row_limits(num_draft: torch.Tensor | None, b: int, k: int, device) -> torch.Tensor:
    """Drafted tokens per row [B] (all K when None)."""
    if num_draft is None:
        return torch.full((b,), k, dtype=torch.long, device=device)
    num_draft = num_draft.to(device=device, dtype=torch.long)
    if num_draft.shape != (b,) or bool((num_draft < 0).any()) or bool((num_draft > k).any()):
        raise ValueError(f"num_draft must be [B={b}] integers in [0, {k}], got {num_draft.tolist()}")
    return num_draft


def _leading_run(ok: torch.Tensor) -> torch.Tensor:
    """ok [B,K] bool -> length of the leading all-True run per row [B]."""
    return ok.long().cumprod(1).sum(1)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact-match acceptance.

    draft_tokens [B,K] long; target_logits [B,K+1,V] (position j scores the token after the j-th input of the
    verified block [last, d_0, …, d_{K-1}]); num_draft [B] optional per-row drafted count (≤ K; later drafts are
    ignored). Returns (accepted [B] in 0..num_draft, next_token [B] = target argmax after the accepted prefix)."""
    b, k = draft_tokens.shape
    if target_logits.shape[:2] != (b, k + 1):
        raise ValueError(f"target_logits must be [B={b}, K+1={k + 1}, V], got {list(target_logits.shape)}")
    limit = _row_limits(num_draft, b, k, draft_tokens.device)
    best = target_logits.argmax(-1)                                  # [B,K+1]
    ok = (best[:, :k] == draft_tokens) & (torch.arange(k, device=draft_tokens.device) < limit[:, None])
    accepted = _leading_run(ok)
    return accepted, best.gather(1, accepted[:, None]).squeeze(1)


def rejection_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None,
                     num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling (see the module docstring).

    draft_tokens [B,K] long, drawn from draft_probs [B,K,V] (None: the drafter is deterministic, q one-hot);
    target_probs [B,K+1,V] (rows sum to 1; temperature / top-k / top-p already applied by the caller);
    num_draft [B] optional per-row drafted count. Returns (accepted [B], next_token [B]): the resampled token at
    the first rejection, or a draw from p at position num_draft when every draft was accepted."""
    b, k = draft_tokens.shape
    if target_probs.shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs must be [B={b}, K+1={k + 1}, V], got {list(target_probs.shape)}")
    dev = draft_tokens.device
    limit = _row_limits(num_draft, b, k, dev)
    p_d = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)          # [B,K]
    q_d = (torch.ones_like(p_d) if draft_probs is None
           else draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1))
    u = torch.rand(b, k, generator=generator, dtype=p_d.dtype, device=dev)
    ok = (u * q_d < p_d) & (torch.arange(k, device=dev) < limit[:, None])   # u < p/q without dividing by q = 0
    accepted = _leading_run(ok)
    rows = torch.arange(b, device=dev)
    p = target_probs[rows, accepted]                                                  # [B,V]
    rejected = accepted < limit                                                       # stopped on a rejection
    if bool(rejected.any()):
        pos = accepted.clamp(max=k - 1)
        if draft_probs is None:
            q = torch.zeros_like(p).scatter_(1, draft_tokens[rows, pos][:, None], 1.0)
        else:
            q = draft_probs[rows, pos].to(p.dtype)
        residual = (p - q).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # mass > 0 whenever a rejection can happen (p(d) < q(d) implies Σ max(p − q, 0) ≥ q(d) − p(d) > 0); the
        # fallback only guards rounding
        residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)
        p = torch.where(rejected[:, None], residual, p)
    return accepted, torch.multinomial(p, 1, generator=generator).squeeze(1)


def simulated_accept(mean_length: float, max_accept: torch.Tensor,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Benchmark aid: accepted draft counts [B] whose acceptance length (accepted + 1) has mean `mean_length`.

    Draws floor(L−1) or ceil(L−1) with the probabilities that give mean L−1 exactly (the lowest-variance choice),
    then caps each row at max_accept [B] (the drafted count: a block shorter than L−1 lowers the mean)."""
    if not math.isfinite(mean_length) or mean_length < 1:
        raise ValueError(f"simulated acceptance length must be a number >= 1, got {mean_length}")
    base = math.floor(mean_length - 1)
    frac = (mean_length - 1) - base
    up = torch.rand(max_accept.shape, generator=generator, dtype=torch.float64) < frac
    return torch.minimum(base + up.long().to(max_accept.device), max_accept.long())


def target_probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax of logits / temperature in float64 (the rejection test divides small probabilities)."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling (use greedy_accept for temperature 0)")
    return torch.softmax(logits.double() / temperature, dim=-1)


@dataclass
class SpecStats:
    """Acceptance accounting of one request (or of many: `merge`), with TensorRT-LLM's metric names.

    `observe(accepted_len, drafted)` records one verify step: `drafted` tokens proposed, `accepted_len` of them
    accepted (0..drafted); the step emits accepted_len + 1 tokens. AL (acceptance length) of that step =
    accepted_len + 1; `mean_al` = emitted tokens / verify steps; `dar` = accepted / drafted tokens."""
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    al_counts: Counter = field(default_factory=Counter)   # AL value -> number of verify steps

    def observe(self, accepted_len: int, drafted: int) -> None:
        accepted_len, drafted = int(accepted_len), int(drafted)
        if drafted < 0 or not 0 <= accepted_len <= drafted:
            raise ValueError(f"need 0 <= accepted_len <= drafted, got accepted_len={accepted_len}, "
                             f"drafted={drafted}")
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted_len
        self.al_counts[accepted_len + 1] += 1

    def merge(self, other: SpecStats) -> SpecStats:
        """A new SpecStats holding both (e.g. the server-wide total of finished requests)."""
        return SpecStats(self.steps + other.steps, self.drafted + other.drafted, self.accepted + other.accepted,
                         self.al_counts + other.al_counts)

    def histogram(self) -> dict[int, int]:
        """{acceptance length: verify steps}, ascending (buckets 1 .. max drafted + 1 that occurred)."""
        return dict(sorted(self.al_counts.items()))

    @property
    def mean_al(self) -> float:
        """Mean acceptance length (emitted tokens per verify step); 0.0 before the first step."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def dar(self) -> float:
        """Draft acceptance rate, accepted / drafted tokens; 0.0 when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return {"acceptance_length": self.mean_al, "draft_acceptance_rate": self.dar, "verify_steps": self.steps,
                "draft_tokens": self.drafted, "accepted_draft_tokens": self.accepted,
                "acceptance_length_histogram": {str(k): v for k, v in self.histogram().items()}}
