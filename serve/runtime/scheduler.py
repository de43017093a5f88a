"""FCFS scheduler: prefill first (chunked by max_num_tokens), then decodes; admission control; preemption.

Each step holds at most `max_num_tokens` tokens and `max_batch_size` requests (running requests never exceed it).
Order within a step: (1) prompt chunks / recomputation of running requests, oldest first; (2) waiting requests in
arrival order while a slot, the token budget and the pages for all their known tokens allow (head of line blocks:
no overtaking), keeping back the pages the running decodes need this step (pages are still taken block by block);
(3) one decode token per running request, oldest first (speculative engines: the pending token + up to
num_draft_tokens drafts, all counted against the budget, pages for the whole verify width; the engine trims the
pages back to the committed tokens after the step).

Prompts are cut at fixed multiples of max_num_tokens and a chunk is never split to fill a budget, so the sequence
of segments a request sees never depends on its neighbours (with the runner's `batch_invariant`, its outputs are
then exactly those it produces alone). When a running request
cannot get a page, the newest running request is preempted (its pages freed, its model state dropped; it goes back
to the head of the queue and later recomputes prompt + generated tokens with the same calls, so its output is
unchanged); when it is itself the newest, it is the one preempted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dsflash.serve.runtime.block_manager import BlockManager
from dsflash.serve.runtime.sequence import Sequence, Status


class QueueFullError(RuntimeError):
    """The waiting queue is full (overload): the client should retry later (HTTP 429/503)."""


@dataclass
class Segment:
    """One model call: tokens [start, end) of `seq`; `reset` starts a fresh state; `sample` = last token's logits
    give the next token."""
    seq: Sequence
    start: int
    end: int
    draft: int | None = None    # speculative decode: draft tokens verified with the pending token (width draft + 1)

    @property
    def ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.end]

    @property
    def reset(self) -> bool:
        return self.start == 0

    @property
    def sample(self) -> bool:
        return self.end == len(self.seq)


@dataclass
class Batch:
    segments: list[Segment] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start + (s.draft or 0) for s in self.segments)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_tokens: int, max_batch_size: int, max_queue: int,
                 num_draft_tokens: int = 0, max_seq_len: int | None = None):
        self.blocks, self.max_num_tokens, self.max_batch_size, self.max_queue = \
            blocks, max_num_tokens, max_batch_size, max_queue
        # speculative engines: a decode verifies the pending token + up to num_draft_tokens drafts (never more than
        # the request may still emit, nor than the step's token budget leaves); its pages cover the verify width
        self.num_draft_tokens, self.max_seq_len = num_draft_tokens, max_seq_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- requests ----------------------------------------------------------------------------------------------
    def check_fits(self, seq: Sequence, max_seq_len: int) -> None:
        """ValueError when the request could never be served, even alone in an empty cache."""
        longest = min(seq.num_prompt + seq.params.max_tokens, max_seq_len)
        need, total = self.blocks.layout.blocks_for(longest), self.blocks.total_blocks
        if need > total:
            raise ValueError(f"request needs {need} KV-cache blocks for {longest} tokens but the cache holds {total}; "
                             f"lower max_tokens or give the engine a larger KV cache")

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"request queue is full ({len(self.waiting)} waiting); retry later")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)
        seq.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------------------------
    def schedule(self) -> Batch:
        batch = Batch()
        for seq in list(self.running):
            if not seq.is_decode and seq in self.running:
                self._take(seq, batch)
        reserve = sum(self.blocks.needed(s.request_id, s.num_computed + 1 + self._draft(s)) for s in self.running
                      if s.is_decode)
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if seq in batch.preempted:      # just preempted: not back in the same step
                break
            start, end = seq.next_segment(0, self.max_num_tokens)
            if end - start > self._budget(batch) or not self.blocks.can_hold(seq.request_id, len(seq), reserve):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._take(seq, batch)
        for seq in list(self.running):
            if self._budget(batch) < 1:
                break
            if seq.is_decode and seq in self.running and not self._scheduled(seq, batch):
                if not self.num_draft_tokens:
                    if self._make_room(seq, seq.num_computed + 1, batch):
                        batch.segments.append(Segment(seq, seq.num_computed, seq.num_computed + 1))
                    continue
                k = min(self._draft(seq), self._budget(batch) - 1)
                if self._make_room(seq, seq.num_computed + 1 + k, batch):
                    batch.segments.append(Segment(seq, seq.num_computed, seq.num_computed + 1, draft=k))
        return batch

    def _draft(self, seq: Sequence) -> int:
        """Draft tokens of seq's next speculative decode (0 on a non-speculative engine)."""
        if not self.num_draft_tokens:
            return 0
        left = seq.remaining(self.max_seq_len) if self.max_seq_len else seq.params.max_tokens - seq.num_generated
        return max(0, min(self.num_draft_tokens, left - 1))

    def _budget(self, batch: Batch) -> int:
        return self.max_num_tokens - batch.num_tokens

    def _take(self, seq: Sequence, batch: Batch) -> None:
        """Schedule consecutive (re)compute segments of seq while the token budget and the pages allow."""
        pos = seq.num_computed
        while pos < len(seq):
            start, end = seq.next_segment(pos, self.max_num_tokens)
            if end - start > self._budget(batch) or not self._make_room(seq, end, batch):
                return
            batch.segments.append(Segment(seq, start, end))
            pos = end

    def _make_room(self, seq: Sequence, n_tokens: int, batch: Batch) -> bool:
        """Allocate pages for seq to hold n_tokens, preempting the newest running requests. False when no room is
        left: seq was itself the newest (preempted, unless it already has work in this step; then it just stops)."""
        while not self.blocks.can_hold(seq.request_id, n_tokens):
            victim = self.running[-1]
            if victim is seq and self._scheduled(seq, batch):
                return False
            self.preempt(victim, batch)
            if victim is seq:
                return False
        self.blocks.grow(seq.request_id, n_tokens)
        return True

    def preempt(self, seq: Sequence, batch: Batch) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        batch.segments = [s for s in batch.segments if s.seq is not seq]
        seq.reset_cache()
        batch.preempted.append(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    @staticmethod
    def _scheduled(seq: Sequence, batch: Batch) -> bool:
        return any(s.seq is seq for s in batch.segments)
