"""Speculative generation over one reference/engine model: DSpark (V4.1) or chained MTP (V4) drafts, verified in
one target `step`, with exact rollback of every stateful cache.

One iteration, for a batch of B requests that advance in lockstep (the model states keep one position per batch):

1. the drafter proposes k ≤ N tokens after the pending token `bonus` (the last emitted token, not yet in the target
   cache); DSpark may shorten a row's proposal where its confidence head falls below a threshold;
2. the target runs [bonus, d_0, …, d_{k-1}] in one `step` (snapshot taken first);
3. acceptance: greedy exact match, or rejection sampling (temperature > 0), or the simulated rule
   (`simulate_acceptance_length`); the batch commits the smallest accepted count a over its rows (a row that
   accepted more emits its accepted draft at position a instead of a resampled token — both are draws of the
   target distribution there, so truncating is lossless for greedy and for sampling);
4. rollback: unless all k drafts were kept, the state is restored and [bonus, d_0..d_{a-1}] re-stepped, so the
   caches (window rings, compressor partial groups, compressed / index caches, candidate state, Engram look-back,
   DSpark captures) hold exactly the committed tokens; the drafter then appends the committed positions to its own
   state (DSpark rings; the MTP block's cache, whose chained draft rows are always rolled back).

Each iteration emits a + 1 tokens per row. `SpecStats` per row counts AL / DAR (serve/speculative.py) of what the
batch commits: in a batch of several requests a row's acceptance is bounded by the batch minimum (run requests as
batch 1 for their own AL). Greedy output is the plain greedy output up to the numerics of a (k+1)-token chunk versus
one-token steps (bitwise in float64 V4.1; fp32/bf16 runs can flip near-ties, as in any engine).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from dsflash.serve.speculative import (SpecStats, greedy_accept, rejection_accept, simulated_accept,
                                       target_probs_from_logits)

ALGORITHMS = ("dspark", "mtp")


@dataclass
class SpecConfig:
    """Speculative decoding settings (`--speculative-*` / `--simulate-acceptance-length` flags)."""
    algorithm: str
    num_draft_tokens: int
    confidence_threshold: float = 0.0          # DSpark: a row's block ends before the first confidence below this
    temperature: float = 0.0                   # 0 = greedy (exact-match acceptance)
    seed: int = 0                              # drafts, rejection draws and simulated acceptance
    simulate_acceptance_length: float | None = None

    def validate(self, args) -> None:
        """ValueError (naming the flag) when the settings do not fit the model `args`."""
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        want = {"dspark": "v41", "mtp": "v4"}[self.algorithm]
        if args.family != want:
            raise ValueError(f"--speculative-algorithm {self.algorithm} needs a {'V4.1' if want == 'v41' else 'V4'} "
                             f"model (this one is family {args.family!r})")
        if args.n_draft < 1:
            raise ValueError(f"the model has no draft layers (num_nextn_predict_layers=0) for {self.algorithm}")
        top = args.dspark_block_size if self.algorithm == "dspark" else None
        if self.num_draft_tokens < 1 or (top is not None and self.num_draft_tokens > top):
            rng = f"1..{top}" if top else ">= 1"
            raise ValueError(f"--speculative-num-draft-tokens must be {rng} for {self.algorithm}, "
                             f"got {self.num_draft_tokens}")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"--speculative-confidence-threshold must be in [0, 1], got {self.confidence_threshold}")
        if self.confidence_threshold > 0 and self.algorithm != "dspark":
            raise ValueError("--speculative-confidence-threshold applies to dspark only (MTP has no confidence head)")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        L = self.simulate_acceptance_length
        if L is not None and not 1.0 <= L <= self.num_draft_tokens + 1:
            raise ValueError(f"--simulate-acceptance-length must be in [1, num_draft_tokens + 1 = "
                             f"{self.num_draft_tokens + 1}], got {L}")


# -- target forward ------------------------------------------------------------------------------------------------
def target_forward(model, ids: torch.Tensor, state,
                   need_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`model.step` that also returns what the drafter conditions on, for the rows of ids [B,S]:
    V4.1 the DSpark captures [B,S,n_capture·D] (state.capture); V4 the final main streams [B,S,n,D].
    need_logits=False lets V4 skip the vocabulary head (a rollback re-step only rebuilds the caches)."""
    if model.args.family == "v41":
        logits = model.step(ids, state)
        return logits, state.capture
    X = model.streams(ids, state)
    return (model.head_logits(X) if need_logits else None), X


# -- drafters ------------------------------------------------------------------------------------------------------
@dataclass
class Proposal:
    tokens: torch.Tensor                 # [B,k] long
    probs: torch.Tensor | None           # [B,k,V] the distribution each token was drawn from; None = deterministic
    num_draft: torch.Tensor              # [B] long: tokens of each row to verify (confidence truncation), ≤ k


class Drafter(Protocol):
    def commit(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Committed positions (their target `hidden` rows [B,M,...]) and the token after each [B,M]."""

    def propose(self, bonus: torch.Tensor, k: int, temperature: float, generator: torch.Generator) -> Proposal:
        """k tokens following `bonus` [B] (the token at the target's next position)."""


def _pick(logits: torch.Tensor, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B,V] -> (token [B], probs [B,V] or None): argmax when temperature is 0, else a draw."""
    if temperature <= 0:
        return logits.argmax(-1), None
    probs = target_probs_from_logits(logits, temperature)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1), probs


class DSparkDrafter:
    """V4.1's DSpark: context rows from the target's captures; one parallel block per proposal (the model's
    `dspark_block_size` positions; the first k are used). Its tokens are the greedy Markov-refined picks, so they
    are deterministic proposals (q one-hot) under rejection sampling."""

    def __init__(self, model, batch_size: int, confidence_threshold: float = 0.0):
        self.model, self.threshold = model, confidence_threshold
        self.dstate = model.new_draft_state(batch_size)

    def commit(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.model.draft_context(self.dstate, hidden, self.dstate.ctx_len)

    def propose(self, bonus: torch.Tensor, k: int, temperature: float, generator) -> Proposal:
        out = self.model.draft(self.dstate, bonus)
        tokens = out.tokens[:, :k]
        n = torch.full((tokens.shape[0],), k, dtype=torch.long, device=tokens.device)
        if self.threshold > 0:
            n = (out.confidence[:, :k] >= self.threshold).long().cumprod(1).sum(1)
        return Proposal(tokens, None, n)


class MTPDrafter:
    """V4's MTP block `mtp.0`, chained for k > 1: row p reads the main streams at p and the token at p + 1 and
    predicts p + 2; a chained row feeds the block's own output streams back with the token it just drafted.
    Chained rows live in the block's cache only while proposing (snapshot / restore)."""

    def __init__(self, model, state, j: int = 0):
        self.model, self.state, self.j = model, state, j
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None   # (logits [B,V], streams [B,1,n,D]) of row N−1

    def _forward(self, X_main: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`DeepseekV4Model.mtp_draft` (architecture.md §2.11): logits and the block's output streams."""
        return self.model.mtp_draft(X_main, next_ids, self.state, self.j)

    @torch.no_grad()
    def commit(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        logits, X = self._forward(hidden, next_tokens)
        self.last = logits[:, -1], X[:, -1:]

    @torch.no_grad()
    def propose(self, bonus: torch.Tensor, k: int, temperature: float, generator) -> Proposal:
        logits, X = self.last
        tok, probs = _pick(logits, temperature, generator)
        tokens, dists = [tok], [probs]
        if k > 1:
            snap = self.state.snapshot()
            for _ in range(k - 1):
                logits, X = self._forward(X, tokens[-1][:, None])
                tok, probs = _pick(logits[:, -1], temperature, generator)
                tokens.append(tok)
                dists.append(probs)
            self.state.restore(snap)
        probs = None if dists[0] is None else torch.stack(dists, 1)
        n = torch.full((bonus.shape[0],), k, dtype=torch.long, device=bonus.device)
        return Proposal(torch.stack(tokens, 1), probs, n)


def make_drafter(model, state, batch_size: int, cfg: SpecConfig) -> Drafter:
    if cfg.algorithm == "dspark":
        return DSparkDrafter(model, batch_size, cfg.confidence_threshold)
    return MTPDrafter(model, state)


# -- the loop ------------------------------------------------------------------------------------------------------
class SpeculativeDecoder:
    """A batch of requests decoded speculatively in lockstep (see the module docstring).

    `wrap_drafter(drafter) -> drafter` lets a caller substitute proposals (tests use an oracle that still commits
    through the real drafter)."""

    def __init__(self, model, cfg: SpecConfig, batch_size: int,
                 wrap_drafter: Callable[[Drafter], Drafter] | None = None):
        cfg.validate(model.args)
        self.model, self.cfg, self.batch = model, cfg, batch_size
        self.state = model.new_state(batch_size)
        drafter = make_drafter(model, self.state, batch_size, cfg)
        self.drafter = wrap_drafter(drafter) if wrap_drafter else drafter
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.stats = [SpecStats() for _ in range(batch_size)]
        self.bonus: torch.Tensor | None = None     # [B] last emitted token, not yet in the target cache
        self.last_logits: torch.Tensor | None = None   # [B, n, V] target logits of the last step's emitted tokens

    def target_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The target distribution p [B,S,V] that rejection sampling preserves (a server overrides it to apply a
        request's top-k / top-p)."""
        return target_probs_from_logits(logits, self.cfg.temperature)

    @property
    def simulated(self) -> bool:
        return self.cfg.simulate_acceptance_length is not None

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Prompt [B,S] -> the first new token [B]."""
        logits, hidden = target_forward(self.model, input_ids, self.state)
        self.bonus, _ = _pick(logits[:, -1], self.cfg.temperature, self.generator)
        self.drafter.commit(hidden, torch.cat([input_ids[:, 1:], self.bonus[:, None]], 1))
        return self.bonus

    @torch.no_grad()
    def step(self, max_tokens: int) -> torch.Tensor:
        """One draft + verify iteration -> new tokens [B, n], 1 ≤ n ≤ min(num_draft_tokens + 1, max_tokens)."""
        if self.bonus is None:
            raise RuntimeError("prefill() first")
        cfg, gen = self.cfg, self.generator
        b, dev = self.batch, self.bonus.device
        k = min(cfg.num_draft_tokens, max_tokens - 1)
        if k > 0:
            prop = self.drafter.propose(self.bonus, k, cfg.temperature, gen)
        else:                                      # one token left: a plain decode step
            prop = Proposal(torch.zeros(b, 0, dtype=torch.long, device=dev), None,
                            torch.zeros(b, dtype=torch.long, device=dev))
        limit = prop.num_draft
        kv = int(limit.max())                      # verify width: the longest row's proposal
        drafts = prop.tokens[:, :kv]
        ids = torch.cat([self.bonus[:, None], drafts], 1)
        snap = self.state.snapshot() if kv else None
        logits, hidden = target_forward(self.model, ids, self.state)          # [B, kv+1, V]
        if self.simulated:
            acc = simulated_accept(cfg.simulate_acceptance_length, limit.min().expand(b), gen).to(dev)
            nxt, _ = _pick(logits[torch.arange(b), acc], cfg.temperature, gen)
        elif cfg.temperature <= 0:
            acc, nxt = greedy_accept(drafts, logits, limit)
        else:
            probs = None if prop.probs is None else prop.probs[:, :kv]
            acc, nxt = rejection_accept(drafts, probs, self.target_probs(logits), gen, limit)
        a = int(acc.min())                         # lockstep: every row commits a drafts + one more token
        self.last_logits = logits[:, :a + 1]
        if a < kv:
            nxt = torch.where(acc > a, drafts[:, a], nxt)   # rows that accepted past a keep their accepted draft
            self.state.restore(snap)
            _, hidden = target_forward(self.model, ids[:, :a + 1], self.state, need_logits=False)
        new = torch.cat([drafts[:, :a], nxt[:, None]], 1)
        self.drafter.commit(hidden, new)
        for s, n in zip(self.stats, limit.tolist()):   # every target forward counts (AL = tokens / iterations)
            s.observe(a, n)
        self.bonus = nxt
        return new

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Prompt [B,S] -> new tokens [B, max_new_tokens]."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        out = [self.prefill(input_ids)[:, None]]
        n = 1
        while n < max_new_tokens:
            out.append(self.step(max_new_tokens - n))
            n += out[-1].shape[1]
        return torch.cat(out, 1)


@dataclass
class SpecResult:
    tokens: torch.Tensor                      # [B, max_new_tokens]
    stats: list[SpecStats]                    # per request
    config: SpecConfig
    simulated: bool = field(default=False)

    def total(self) -> SpecStats:
        out = SpecStats()
        for s in self.stats:
            out = out.merge(s)
        return out

    def report(self) -> dict:
        """The `dsflash generate --json` fields (batch totals)."""
        t = self.total()
        out = {"speculative_algorithm": self.config.algorithm,
               "speculative_num_draft_tokens": self.config.num_draft_tokens,
               "acceptance_length": t.mean_al, "draft_acceptance_rate": t.dar,
               "acceptance_length_histogram": {str(k): v for k, v in t.histogram().items()}}
        if self.simulated:
            out["simulated_acceptance"] = True
            out["simulated_acceptance_length"] = self.config.simulate_acceptance_length
        return out


def speculative_generate(model, input_ids: torch.Tensor, max_new_tokens: int, cfg: SpecConfig,
                         wrap_drafter: Callable[[Drafter], Drafter] | None = None) -> SpecResult:
    """Speculative generation of max_new_tokens for the prompts [B,S] (same length) -> tokens and AL/DAR."""
    dec = SpeculativeDecoder(model, cfg, input_ids.shape[0], wrap_drafter)
    tokens = dec.generate(input_ids, max_new_tokens)
    return SpecResult(tokens, dec.stats, cfg, dec.simulated)
