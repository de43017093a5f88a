"""Speculative serving (LLMEngine(speculative=...), `dsflash serve --speculative-*`) on tiny float64 engines (CPU).

Greedy speculative serving must give the non-speculative engine's tokens for several concurrent requests (DSpark
blocks 3 and 5 on V4.1, MTP 1 and 2 on V4), also across a preemption; stop tokens and max_tokens inside an accepted
block must end the request where one-token decoding ends it; the acceptance (AL / DAR) must show in the OpenAI usage
and in /metrics. Random weights make real drafts almost always wrong (rejection + rollback on every step), so the
multi-token paths use an oracle drafter (the known greedy continuation, cut at a random point) that still commits
through the real drafter, or simulated acceptance, which must reproduce its configured mean within 5%.
"""
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from dsflash.build.engine import load_engine_model, write_engine
from dsflash.build.plan import BuildConfig
from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset
from dsflash.model_def.mapping import Mapping
from dsflash.serve.llm_engine import LLMEngine, Request, SamplingParams
from dsflash.serve.spec_decode import SpecConfig

_spec = importlib.util.spec_from_file_location("_serving", Path(__file__).with_name("_serving.py"))
sv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sv)

BUILD = BuildConfig(dtype="float64", max_batch_size=8, max_num_tokens=32, max_seq_len=256)
ALG = {"v41": "dspark", "v4": "mtp"}
_built: dict = {}


def built(family: str, tmp_path_factory) -> tuple[Path, object]:
    """(engine dir, loaded model) of the tiny float64 single-rank engine, made once per session."""
    if family not in _built:
        root = tmp_path_factory.mktemp(f"spec-{family}")
        hf = synthesize(get_preset(family, "tiny"), root / "hf", seed=5)
        eng = write_engine(hf, root / "engine", Mapping(), "cpu", BUILD, progress=False)
        _built[family] = (eng, load_engine_model(eng)[0])
    return _built[family]


class Oracle:
    """Proposes the request's known greedy continuation, wrong from a random cut on (the full block half the time);
    commits still go to the real drafter, so its state follows every rollback (as in tests/model/test_spec_decode)."""

    def __init__(self, inner, truth: list[int], seed: int):
        self.inner, self.truth = inner, torch.tensor([truth])
        self.rng = torch.Generator().manual_seed(seed)
        self.pos = 0

    def commit(self, hidden, next_tokens):
        self.inner.commit(hidden, next_tokens)
        self.pos += hidden.shape[1]

    def propose(self, bonus, k, temperature, generator):
        from dsflash.serve.spec_decode import Proposal
        assert int(bonus[0]) == int(self.truth[0, self.pos])
        truth = self.truth[:, self.pos + 1:self.pos + 1 + k]
        cut = k if torch.rand(1, generator=self.rng) < 0.5 else int(torch.randint(0, k, (1,), generator=self.rng))
        tokens = torch.where(torch.arange(k) < cut, truth, (truth + 1) % 1000)
        return Proposal(tokens, None, torch.full((1,), k))


def oracle(want: dict):
    """wrap_drafter for LLMEngine: each request's oracle over its prompt + expected tokens."""
    return lambda d, seq: Oracle(d, seq.token_ids[:seq.num_prompt] + want[seq.request_id][0], len(seq.request_id))


def engine(family, tmp_path_factory, spec: SpecConfig | None = None, **kw) -> LLMEngine:
    eng, model = built(family, tmp_path_factory)
    kw.setdefault("kv_cache_bytes", 1 << 26)
    return LLMEngine(str(eng), model=model, speculative=spec, **kw)


def prompt(i: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(500 + i)
    body = torch.randint(3, 1000, (n - 1,), generator=g).tolist()
    if i % 2:                                   # a repeated pattern: the drafters get some tokens right
        body = (body[:4] * n)[:n - 1]
    return [0] + body


def run(eng: LLMEngine, reqs: list[Request]) -> tuple[dict, dict]:
    """Add all requests, step until done; -> ({id: (tokens, finish_reason)}, {id: last Output.spec})."""
    out = {r.request_id: ([], None) for r in reqs}
    spec = {}
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        for o in eng.step():
            toks, _ = out[o.request_id]
            assert o.completion_tokens == len(toks) + len(o.new_token_ids)
            out[o.request_id] = (toks + o.new_token_ids, o.finish_reason)
            spec[o.request_id] = o.spec
    s = eng.stats()
    assert s["kv_cache_used_blocks"] == 0 and s["num_running"] == 0
    return out, spec


def greedy_requests(n: int = 3) -> list[Request]:
    lens = [5, 30, 12]
    return [Request(f"r{i}", prompt(i, lens[i % len(lens)]),
                    SamplingParams(max_tokens=12 + 3 * i, ignore_eos=True)) for i in range(n)]


_plain: dict = {}


def plain(family, tmp_path_factory) -> dict:
    if family not in _plain:
        _plain[family] = run(engine(family, tmp_path_factory), greedy_requests())[0]
    return _plain[family]


@pytest.mark.parametrize("family,n", [("v41", 3), ("v41", 5), ("v4", 1), ("v4", 2)])
def test_greedy_equals_non_speculative(family, n, tmp_path_factory):
    want = plain(family, tmp_path_factory)
    # small token budget: prompt chunks + several speculative decodes share steps; a few page-size boundaries
    eng = engine(family, tmp_path_factory, SpecConfig(ALG[family], n), max_num_tokens=16, block_size=4,
                 wrap_drafter=oracle(want))
    got, spec = run(eng, greedy_requests())
    assert got == want
    tot = eng.stats()["spec_decode"]
    assert tot["verify_steps"] > 0 and tot["draft_tokens"] > 0
    assert set(tot["acceptance_length_histogram"]) <= set(range(1, n + 2))
    for rid, s in spec.items():
        assert 1.0 < s["acceptance_length"] <= n + 1 and 0.0 < s["draft_acceptance_rate"] <= 1.0
        assert "simulated_acceptance" not in s
    assert tot["accepted_draft_tokens"] > 0 and max(tot["acceptance_length_histogram"]) == n + 1


def test_preemption_recomputes_drafter(tmp_path_factory):
    """A pool that holds the prompts and little more: a speculative decode that needs pages preempts the newer
    request, which later recomputes prompt + generated tokens (feeding its new drafter) and still matches."""
    want = plain("v41", tmp_path_factory)
    reqs = greedy_requests()[:2]
    probe = engine("v41", tmp_path_factory, block_size=4)
    lay = probe.cache.layout
    pool = lay.blocks_for(45) + lay.blocks_for(2)          # r1 alone needs 30 + 15 tokens, r0 5 + 12
    eng = engine("v41", tmp_path_factory, SpecConfig("dspark", 3), block_size=4, wrap_drafter=oracle(want),
                 kv_cache_bytes=pool * lay.bytes_per_block)
    got, _ = run(eng, reqs)
    assert got == {r.request_id: want[r.request_id] for r in reqs}
    assert eng.stats()["num_preemptions"] >= 1


@pytest.mark.parametrize("family", ["v41", "v4"])
def test_stop_token_inside_block(family, tmp_path_factory):
    """Simulated acceptance of every draft (L = N + 1) makes 4-token outputs certain; a stop token id inside one
    must end the request right after it, the rest of the block dropped. Then the same for real (greedy) drafts
    against the non-speculative engine, with max_tokens cutting a block too."""
    cfg = SpecConfig(ALG[family], 3, simulate_acceptance_length=4.0)
    p = prompt(1, 7)
    full, _ = run(engine(family, tmp_path_factory, cfg),
                  [Request("a", p, SamplingParams(max_tokens=13, seed=7, ignore_eos=True))])
    toks = full["a"][0]
    assert len(toks) == 13
    i = next(j for j in range(2, 12) if toks[j] not in toks[:j] and j % 4 != 0)   # not the end of a block
    got, spec = run(engine(family, tmp_path_factory, cfg),
                    [Request("b", p, SamplingParams(max_tokens=13, seed=7, stop_token_ids=[toks[i]],
                                                    ignore_eos=True))])
    assert got["b"] == (toks[:i + 1], "stop")
    assert spec["b"]["simulated_acceptance"] is True and spec["b"]["acceptance_length"] == 4.0
    want = plain(family, tmp_path_factory)["r1"][0]
    j = next(j for j in range(3, len(want)) if want[j] not in want[:j])
    eng = engine(family, tmp_path_factory, SpecConfig(ALG[family], 3 if family == "v41" else 2))
    r1 = greedy_requests()[1]
    got, _ = run(eng, [dataclasses.replace(r1, request_id="s", params=dataclasses.replace(
        r1.params, stop_token_ids=[want[j]])), dataclasses.replace(r1, request_id="m", params=dataclasses.replace(
            r1.params, max_tokens=j))])
    assert got["s"] == (want[:j + 1], "stop") and got["m"] == (want[:j], "length")


def test_simulated_acceptance_mean(tmp_path_factory):
    """Mean AL over ~100 verify steps (4 requests; the draws are seeded per request)."""
    L = 2.6
    eng = engine("v4", tmp_path_factory, SpecConfig("mtp", 3, simulate_acceptance_length=L))
    got, spec = run(eng, [Request(f"s{i}", prompt(i, 6), SamplingParams(max_tokens=64, ignore_eos=True, seed=i))
                          for i in range(4)])
    for rid, s in spec.items():
        assert s["simulated_acceptance"] is True
        assert len(got[rid][0]) == 64
    tot = eng.stats()["spec_decode"]
    assert tot["simulated"] and tot["verify_steps"] >= 90
    assert abs(tot["acceptance_length"] - L) / L < 0.05, tot


def test_rejects_bad_configs(tmp_path_factory):
    with pytest.raises(ValueError, match="needs a V4 model"):
        engine("v41", tmp_path_factory, SpecConfig("mtp", 1))
    with pytest.raises(ValueError, match="needs a V4.1 model"):
        engine("v4", tmp_path_factory, SpecConfig("dspark", 3))
    with pytest.raises(ValueError, match="speculative-num-draft-tokens"):
        engine("v41", tmp_path_factory, SpecConfig("dspark", 9))


def test_sampling_runs_and_is_seeded(tmp_path_factory):
    """temperature > 0 (rejection sampling, with top-k) is reproducible for a seeded request."""
    cfg = SpecConfig("dspark", 3)
    reqs = lambda: [Request("t", prompt(3, 9), SamplingParams(max_tokens=8, temperature=0.8, top_k=30, seed=4,
                                                              ignore_eos=True, logprobs=1))]
    a, _ = run(engine("v41", tmp_path_factory, cfg), reqs())
    b, _ = run(engine("v41", tmp_path_factory, cfg), reqs())
    assert a == b and len(a["t"][0]) == 8


def test_server_reports_acceptance(tmp_path_factory):
    import httpx
    eng, _ = built("v41", tmp_path_factory)
    with sv.Served(eng, "--speculative-algorithm", "dspark", "--speculative-num-draft-tokens", "3") as s, \
            httpx.Client(timeout=60) as c:
        r = c.post(f"{s.url}/v1/completions", json={"prompt": prompt(1, 8), "max_tokens": 10, "ignore_eos": True,
                                                    "return_token_ids": True})
        r.raise_for_status()
        body = r.json()
        want, _ = run(engine("v41", tmp_path_factory), [Request("w", prompt(1, 8),
                                                                 SamplingParams(max_tokens=10, ignore_eos=True))])
        assert body["choices"][0]["token_ids"] == want["w"][0]
        u = body["usage"]
        assert u["completion_tokens"] == 10 and 1 <= u["acceptance_length"] <= 4
        assert 0 <= u["draft_acceptance_rate"] <= 1 and "simulated_acceptance" not in u
        m = sv.metrics(c, s.url)
        hist = "trtllm_spec_decode_acceptance_length"
        assert m[f'{hist}_bucket{{le="4"}}'] == m[f"{hist}_count"] == m["trtllm_spec_decode_num_verify_steps_total"] > 0
        assert 'trtllm_spec_decode_acceptance_length_bucket{le="1"}' in m
        assert m["trtllm_spec_decode_drafted_tokens_total"] > 0
        assert m["trtllm_spec_decode_accepted_tokens_total"] >= 0
        assert 1 <= m["trtllm_spec_decode_mean_acceptance_length"] <= 4
        assert 0 <= m["trtllm_spec_decode_draft_acceptance_rate"] <= 1


def test_server_refuses_bad_flags(tmp_path_factory):
    import subprocess
    import sys
    eng, _ = built("v41", tmp_path_factory)
    r = subprocess.run([sys.executable, "-m", "dsflash.serve.cli", "serve", "--engine", str(eng), "--port", "0",
                        "--grpc-port", "-1", "--speculative-algorithm", "mtp"], capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 2 and "needs a V4 model" in r.stderr
    # multi-rank engines are refused (before any MPI launch)
    root = eng.parent
    tp2 = write_engine(root / "hf", root / "engine-tp2", Mapping(world_size=2, tp_size=2), "cpu", BUILD,
                       progress=False)
    with pytest.raises(ValueError, match="single-rank engines only"):
        LLMEngine(str(tp2), speculative=SpecConfig("dspark", 3))
    r = subprocess.run([sys.executable, "-m", "dsflash.serve.cli", "serve", "--engine", str(tp2), "--port", "0",
                        "--grpc-port", "-1", "--speculative-algorithm", "dspark"], capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 2 and "single-rank engines only" in r.stderr
