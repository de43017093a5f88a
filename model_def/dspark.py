"""DSpark, the block drafter built into DeepSeek-V4.1-Flash as `mtp.0..2` (architecture.md §2.12).

Stage 0 projects the captured target hidden states (layer-entry streams of `dspark_target_layer_ids`, averaged over
the hc streams, concatenated) with `main_proj` + `main_norm` into `main_x`. Every stage is a full block (lagged mHC,
SWA attention, MoE with `dspark_n_routed_experts` top-`dspark_num_experts_per_tok`) whose attention context is its
own `sliding_window`-slot ring of `FP8(RoPE(kv_norm(wkv · main_x)))`, one row per committed position. A draft block
`[bonus, noise, …]` of `dspark_block_size` positions attends non-causally to the ring and to itself. The last stage
collapses with its lagged `pre`, applies `norm` and the shared `head`, refines the block sequentially with the
low-rank Markov head (`logits_k += head(embed[prev])`) and scores each position with the confidence head on the
collapsed (un-normed) hidden concatenated with `embed[prev]`. Position frames follow TensorRT-LLM: the context row
of committed position p sits at frame p + 1, block position k at frame ctx_len + 1 + k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.model_def.csa2 import layer_inv_freq
from dsflash.model_def.layers import Linear, Numerics, RMSNorm, hc_collapse, wide, wide_weight


class MarkovHead(nn.Module):
    """`markov_head`: token-bigram logit bias of rank r, `embed` [V, r] (W1) and `head` [V, r] (W2)."""

    def __init__(self, vocab: int, rank: int, numerics: Numerics, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank, dtype=dtype)
        self.head = Linear(rank, vocab, numerics, None, dtype=dtype)

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev token ids [B] -> fp32 logit bias [B, V]."""
        return F.linear(wide(self.embed(prev)), wide_weight(self.head.weight))


class ConfidenceHead(nn.Module):
    """`confidence_head`: acceptance logit from [hidden, markov embed of the previous token], computed in fp32."""

    def __init__(self, dim: int, rank: int, numerics: Numerics, dtype: torch.dtype):
        super().__init__()
        self.proj = Linear(dim + rank, 1, numerics, None, dtype=dtype)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        feats = torch.cat([wide(hidden), wide(prev_emb)], -1)
        return F.linear(feats, wide(self.proj.weight)).squeeze(-1)


def add_stage_heads(stage: nn.Module, args, stage_id: int, numerics: Numerics, dtype: torch.dtype) -> None:
    """Attach the stage-0 capture projection and the last stage's output heads to a draft block."""
    d = args.hidden_size
    if stage_id == 0:
        n_cap = len(args.dspark_target_layer_ids)
        stage.main_proj = Linear(n_cap * d, d, numerics, "fp8", dtype=dtype)
        stage.main_norm = RMSNorm(d, args.rms_norm_eps)
    if stage_id == args.n_draft - 1:
        stage.norm = RMSNorm(d, args.rms_norm_eps)
        stage.markov_head = MarkovHead(args.vocab_size, args.dspark_markov_rank, numerics, dtype)
        stage.confidence_head = ConfidenceHead(d, args.dspark_markov_rank, numerics, dtype)


@dataclass
class DraftState:
    """Per-request drafter context: one ring per stage, the frame each slot holds (−1 empty), committed length."""
    rings: list[torch.Tensor]   # [B, W, head_dim] per stage
    frames: torch.Tensor        # [W] long
    ctx_len: int = 0

    def snapshot(self) -> dict:
        return {"rings": [r.clone() for r in self.rings], "frames": self.frames.clone(), "ctx_len": self.ctx_len}

    def restore(self, snap: dict) -> None:
        self.rings = [r.clone() for r in snap["rings"]]
        self.frames, self.ctx_len = snap["frames"].clone(), snap["ctx_len"]


@dataclass
class DraftOutput:
    tokens: torch.Tensor       # [B, K] greedy Markov-refined proposal
    logits: torch.Tensor       # [B, K, V] fp32 Markov-corrected logits the tokens were drawn from
    confidence: torch.Tensor   # [B, K] sigmoid acceptance estimates (used only to shorten a proposal)


def new_draft_state(model, batch: int) -> DraftState:
    a = model.args
    dev = model.head.weight.device
    rings = [torch.zeros(batch, a.sliding_window, a.head_dim, dtype=model.dtype, device=dev) for _ in model.mtp]
    return DraftState(rings, torch.full((a.sliding_window,), -1, dtype=torch.long, device=dev))


def draft_context(model, dstate: DraftState, captured: torch.Tensor, first_pos: int) -> None:
    """Write context rows for committed positions first_pos.. (captured [B, M, n_capture * D], from `state.capture`)."""
    w = model.args.sliding_window
    m = captured.shape[1]
    if first_pos != dstate.ctx_len:
        raise ValueError(f"draft context must continue at position {dstate.ctx_len}, got {first_pos}")
    keep = min(m, w)
    captured = captured[:, m - keep:]
    b = captured.shape[0]
    frames = first_pos + m - keep + 1 + torch.arange(keep, device=captured.device)
    stage0 = model.mtp[0]
    main_x = stage0.main_norm(stage0.main_proj(captured.to(stage0.main_proj.weight.dtype)))
    slots = frames % w
    for s, stage in enumerate(model.mtp):
        inv = layer_inv_freq(model.args, stage.layer, main_x.device)    # draft layers: plain rope_theta, no YaRN
        rows = stage.attn.window_kv(main_x, frames.expand(b, -1), inv)
        dstate.rings[s][:, slots] = rows.to(dstate.rings[s].dtype)
    dstate.frames[slots] = frames
    dstate.ctx_len = first_pos + m


def draft_block(model, dstate: DraftState, bonus: torch.Tensor) -> DraftOutput:
    """Propose `dspark_block_size` tokens after `bonus` [B] (the target token at position ctx_len)."""
    a = model.args
    start, k, w = dstate.ctx_len, a.dspark_block_size, a.sliding_window
    if start <= 0:
        raise ValueError("draft_block needs committed context (call draft_context first)")
    b = bonus.shape[0]
    ids = torch.full((b, k), a.dspark_noise_token_id, dtype=torch.long, device=bonus.device)
    ids[:, 0] = bonus
    X = model.embed(ids).unsqueeze(2).expand(-1, -1, a.hc_mult, -1)
    pre = F.one_hot(torch.zeros(b, k, dtype=torch.long, device=bonus.device), a.hc_mult).float()  # lagged chain start
    frames = (start + 1 + torch.arange(k, device=bonus.device)).expand(b, -1)
    f = dstate.frames
    valid = ((f >= 0) & (f <= start) & (f > start - w)).expand(b, -1)
    for s, stage in enumerate(model.mtp):
        ring = dstate.rings[s]
        X, pre = stage(X, pre, lambda x, st=stage, r=ring: st.attn.draft_forward(x, r, valid, frames), None)
    last = model.mtp[-1]
    hidden = hc_collapse(X, pre)                                   # collapsed, un-normed: feeds the confidence head
    base = model.head(last.norm(hidden))
    prevs, logits = [bonus.long()], []
    for j in range(k):                      # sequential refinement: the bias depends on the token just drafted
        logits.append(base[:, j] + last.markov_head.bias(prevs[-1]))
        prevs.append(logits[-1].argmax(-1))
    tokens = torch.stack(prevs[1:], 1)
    conf = torch.sigmoid(last.confidence_head(hidden, last.markov_head.embed(torch.stack(prevs[:-1], 1))))
    return DraftOutput(tokens, torch.stack(logits, 1), conf)
