"""Scheduler: fixed-boundary chunked prefill, prefill-first batches, admission control, preemption by recompute.

The model is replaced by a deterministic function of the token history, and a mirror of every request's cache
length checks that the plans are what a worker needs (a segment starts where the cache ends; reset starts at 0).
"""
import pytest

from dsflash.serve.runtime.block_manager import BlockManager, CacheLayout
from dsflash.serve.runtime.sampling import SamplingParams
from dsflash.serve.runtime.scheduler import QueueFullError, Scheduler
from dsflash.serve.runtime.sequence import Request, Sequence, Status

LAYOUT = CacheLayout("test", 4, (("kv", 1, 16),), (("state", 64),))   # 4-token pages of 64 B, state = 1 page


def make(max_num_tokens=8, max_batch_size=4, blocks=100, max_queue=16) -> Scheduler:
    return Scheduler(BlockManager(LAYOUT, blocks * 64), max_num_tokens, max_batch_size, max_queue)


def seq(rid: str, n: int, max_tokens: int = 4, first: int = 1) -> Sequence:
    return Sequence(Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens)))


def fake_next(tokens: list[int]) -> int:
    return sum(t * (i + 1) for i, t in enumerate(tokens)) * 7919 % 997 + 2


class Runner:
    """Executes plans like a worker would (mirrored cache lengths) and samples with fake_next."""

    def __init__(self, sched: Scheduler):
        self.sched, self.cached, self.steps = sched, {}, []

    def step(self) -> list[tuple[str, int, int]]:
        s = self.sched
        batch = s.schedule()
        for p in batch.preempted:
            self.cached.pop(p.request_id, None)
        plan = [(g.seq.request_id, g.start, g.end) for g in batch.segments]
        assert batch.num_tokens <= s.max_num_tokens
        assert len({g.seq.request_id for g in batch.segments}) <= s.max_batch_size
        assert len(s.running) <= s.max_batch_size
        samples = [g.seq for g in batch.segments if g.sample]
        for g in batch.segments:
            rid = g.seq.request_id
            if g.reset:
                self.cached[rid] = 0
            assert g.start == self.cached[rid], (rid, g.start, self.cached[rid])
            self.cached[rid] = g.end
            assert s.blocks.layout.blocks_for(g.end) <= len(s.blocks.tables[rid])
            g.seq.num_computed = g.end
        for q in samples:
            q.append(fake_next(q.token_ids), q.params.max_tokens, 10 ** 6)
            if q.finish_reason:
                s.remove(q)
                self.cached.pop(q.request_id)
        self.steps.append(plan)
        return plan

    def drain(self, limit: int = 1000) -> None:
        for _ in range(limit):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("scheduler made no progress")


def expected_tokens(prompt_len: int, max_tokens: int, first: int = 1) -> list[int]:
    toks = list(range(first, first + prompt_len))
    for _ in range(max_tokens):
        toks.append(fake_next(toks))
    return toks


def test_prompt_chunks_have_fixed_boundaries():
    s = make(max_num_tokens=8)
    a, b = seq("a", 20), seq("b", 5, first=50)
    s.add(a)
    s.add(b)
    r = Runner(s)
    assert r.step() == [("a", 0, 8)]
    assert r.step() == [("a", 8, 16)]
    assert r.step() == [("a", 16, 20)]               # b's 5-token chunk does not fit the 4 left: not split
    assert r.step() == [("b", 0, 5), ("a", 20, 21)]  # prefill first, then decodes in the remaining budget
    assert r.step() == [("a", 21, 22), ("b", 5, 6)]
    r.drain()
    assert a.token_ids == expected_tokens(20, 4) and b.token_ids == expected_tokens(5, 4, first=50)
    assert s.blocks.num_used == 0


def test_batch_is_bounded_by_max_batch_size():
    s = make(max_num_tokens=64, max_batch_size=2)
    seqs = [seq(f"r{i}", 3, max_tokens=3, first=10 * i + 1) for i in range(3)]
    for q in seqs:
        s.add(q)
    r = Runner(s)
    r.step()
    assert [q.status for q in seqs] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    r.drain()
    assert all(len({rid for rid, *_ in plan}) <= 2 for plan in r.steps)
    assert all(q.token_ids == expected_tokens(3, 3, first=10 * i + 1) for i, q in enumerate(seqs))


def test_admission_control():
    s = make(blocks=10)                       # 10 pages of 4 tokens; a request needs 1 state page
    with pytest.raises(ValueError, match="needs 11 KV-cache blocks"):
        s.check_fits(seq("big", 30, max_tokens=10), max_seq_len=1000)
    s.check_fits(seq("ok", 30, max_tokens=6), max_seq_len=1000)          # 36 tokens: 9 + 1 pages
    s.check_fits(seq("capped", 30, max_tokens=100), max_seq_len=36)       # max_seq_len caps the length
    s = make(max_queue=2)
    s.add(seq("a", 3))
    s.add(seq("b", 3))
    with pytest.raises(QueueFullError, match="queue is full"):
        s.add(seq("c", 3))


def test_preemption_recomputes_and_output_is_unchanged():
    # 7 pages: a and b (6-token prompts: 1 state + 2 pages each) both fit; growing past 8 tokens needs a third
    # page: a (older) gets the last one, b (newest) is preempted, later recomputes prompt + generated tokens.
    s = make(max_num_tokens=16, blocks=7)
    a, b = seq("a", 6, max_tokens=6), seq("b", 6, max_tokens=6, first=40)
    s.add(a)
    s.add(b)
    r = Runner(s)
    r.drain()
    assert s.num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert a.token_ids == expected_tokens(6, 6) and b.token_ids == expected_tokens(6, 6, first=40)
    b_plan = [(st, en) for plan in r.steps for rid, st, en in plan if rid == "b"]
    restart = b_plan.index((0, 6), 1)
    # recompute: the prompt chunk, then the generated tokens one by one (the calls it made the first time)
    assert b_plan[restart:restart + 4] == [(0, 6), (6, 7), (7, 8), (8, 9)]
    assert b_plan[:restart] == [(0, 6), (6, 7), (7, 8)]
    assert s.blocks.num_used == 0


def test_victim_is_the_newest_running_request():
    s = make(max_num_tokens=64, blocks=9)
    seqs = [seq(n, 8, max_tokens=4, first=10 * i + 1) for i, n in enumerate("abc")]   # 3 pages each
    for q in seqs:
        s.add(q)
    r = Runner(s)
    r.step()                                    # all three prefill: 9 pages used; next decodes need a 4th page each
    r.step()
    # a needs a page: c (newest) is preempted, which also leaves room for b
    assert [q.num_preemptions for q in seqs] == [0, 0, 1] and seqs[2].status is Status.PREEMPTED
    assert r.steps[-1] == [("a", 8, 9), ("b", 8, 9)]
    r.drain()
    assert all(q.token_ids == expected_tokens(8, 4, first=10 * i + 1) for i, q in enumerate(seqs))
    assert s.blocks.num_used == 0


def test_admission_keeps_the_pages_running_decodes_need():
    # a (8-token prompt: 3 pages) decodes its 9th token this step and needs a 4th page; admitting b (3 pages) into
    # the 3 free pages would force a preemption right away, so b waits instead.
    s = make(max_num_tokens=64, blocks=6)
    a = seq("a", 8, max_tokens=3)
    s.add(a)
    r = Runner(s)
    r.step()
    b = seq("b", 8, max_tokens=3, first=30)
    s.add(b)
    assert r.step() == [("a", 8, 9)]
    r.drain()
    assert s.num_preemptions == 0
    assert a.token_ids == expected_tokens(8, 3) and b.token_ids == expected_tokens(8, 3, first=30)


def test_remove_frees_pages_of_running_and_waiting_requests():
    s = make(max_num_tokens=8, max_batch_size=1)
    a, b = seq("a", 6), seq("b", 6)
    s.add(a)
    s.add(b)
    Runner(s).step()
    assert s.blocks.num_used == 3
    s.remove(a)
    s.remove(b)
    assert s.blocks.num_used == 0 and not s.has_work()
    assert a.status is Status.FINISHED and b.status is Status.FINISHED
