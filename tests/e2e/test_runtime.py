"""Serving runtime on tiny synthetic engines (CPU): reference equality, batch invariance, cache exhaustion,
abort / async / drain, stop strings and logprobs, TP2 under mpirun.

Outputs are compared with those of each request alone in both step modes: `batch_invariant` (a forward per request,
exact by construction, the engine's float32 model) and the default fused steps (one forward per step for all
requests, whose GEMM row counts change a token's last bits with its neighbours; so its model runs in float64, where
a last-bit difference flips a deploy-mode FP8/FP4 code in ~1e-9 of the cases: see tests/model/test_v4_decode.py)."""
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsflash.build.engine import load_engine_model, write_engine
from dsflash.build.plan import BuildConfig
from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset, load_reference
from dsflash.model_def.mapping import Mapping
from dsflash.serve.llm_engine import (AsyncLLMEngine, LLMEngine, QueueFullError, Request, SamplingParams)
from dsflash.serve.mpi_launch import mpirun_path

BUILD = BuildConfig(max_batch_size=32, max_num_tokens=64, max_seq_len=512)
PROMPT_LENS = [3, 70, 9, 41, 17, 33, 5, 52, 26, 12, 64, 37, 4, 48, 21, 8]   # window 32; prompts > 24 get chunked




@pytest.fixture(scope="module", params=["v41", "v4"])
def family(request):
    return request.param


_built: dict = {}


def built(family: str, tmp_path_factory) -> tuple[Path, Path, object]:
    """(hf dir, engine dir, loaded engine model) of a tiny preset, made once per session."""
    if family not in _built:
        root = tmp_path_factory.mktemp(family)
        hf = synthesize(get_preset(family, "tiny"), root / "hf", seed=5)
        eng = write_engine(hf, root / "engine", Mapping(), "cpu", BUILD, progress=False)
        _built[family] = (hf, eng, load_engine_model(eng)[0])
    return _built[family]


_wide: dict = {}


def engine(family, tmp_path_factory, mode: str = "fused", **kw) -> LLMEngine:
    """mode "fused" (the default steps, the engine's float32 model), "isolated" (batch_invariant steps, float32) or
    "fused64" (fused steps, a float64 model: comparisons across batch compositions)."""
    _, eng, model = built(family, tmp_path_factory)
    if mode == "fused64":
        if family not in _wide:
            _wide[family] = load_engine_model(eng, dtype=torch.float64)[0]
        model = _wide[family]
    kw.setdefault("kv_cache_bytes", 1 << 26)
    return LLMEngine(str(eng), model=model, batch_invariant=mode == "isolated", **kw)


def prompt(i: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + i)
    return [0] + torch.randint(3, 120000, (n - 1,), generator=g).tolist()


def params(i: int) -> SamplingParams:
    """Mixed decoding: greedy, seeded temperature sampling, top-k / top-p."""
    kinds = [dict(), dict(temperature=0.9, seed=i), dict(temperature=1.2, top_k=20, seed=i),
             dict(temperature=0.8, top_p=0.9, seed=i)]
    return SamplingParams(max_tokens=2 + i % 4, ignore_eos=True, **kinds[i % 4])


def requests(n: int) -> list[Request]:
    return [Request(f"r{i}", prompt(i, PROMPT_LENS[i % len(PROMPT_LENS)]), params(i)) for i in range(n)]


def run(eng: LLMEngine, reqs: list[Request]) -> dict:
    """Add all requests, step until done; -> {id: (tokens, finish_reason, text)}."""
    out = {r.request_id: ([], None, "") for r in reqs}
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        for o in eng.step():
            toks, _, text = out[o.request_id]
            assert len(o.new_token_ids) == 1 and o.completion_tokens == len(toks) + 1
            out[o.request_id] = (toks + o.new_token_ids, o.finish_reason, text + o.text)
    assert eng.stats()["kv_cache_used_blocks"] == 0 and eng.stats()["kv_cache_usage"] == 0.0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["isolated", "fused64"])
def test_greedy_matches_reference(family, mode, tmp_path_factory):
    """The served tokens are the reference model's greedy tokens, each request generated alone: exactly in the
    batch-invariant mode (float32), and in fused steps in float64 (in float32 a fused step's GEMM row count moves
    logits by a last bit, which flips a near-tied argmax of this random model on some CPUs)."""
    from dsflash.plugins import moe_config
    hf, _, _ = built(family, tmp_path_factory)
    eng = engine(family, tmp_path_factory, mode)
    # batch-invariant steps also make a GPU MoE's expert sum deterministic (the CPU reference is already)
    assert moe_config.deterministic() == (mode == "isolated")
    prompts = [prompt(100, 5), prompt(101, 19), prompt(102, 45)]
    reqs = [Request(f"g{i}", p, SamplingParams(max_tokens=8, ignore_eos=True)) for i, p in enumerate(prompts)]
    got = run(eng, reqs)
    ref = load_reference(hf, numerics="deploy", dtype=torch.float64 if mode == "fused64" else torch.float32)
    for r, p in zip(reqs, prompts):
        want = ref.generate_greedy(torch.tensor([p]), 8)[0, len(p):].tolist()
        assert got[r.request_id][0] == want and got[r.request_id][1] == "length"
    s = eng.stats()
    assert s["prompt_tokens_total"] == 69 and s["generation_tokens_total"] == 24 and s["num_running"] == 0


_alone: dict = {}


def alone(family, tmp_path_factory, mode: str) -> dict:
    """Each request of the mixed set run by itself (max_num_tokens 24), in the model dtype of `mode`."""
    if (family, mode) not in _alone:
        eng = engine(family, tmp_path_factory, mode, max_num_tokens=24)
        _alone[family, mode] = {}
        for r in requests(32 if family == "v41" else 12):
            _alone[family, mode].update(run(eng, [r]))
    return _alone[family, mode]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["isolated", "fused64"])
def test_batch_invariance(family, mode, tmp_path_factory):
    """32 (V4: 12) concurrent requests of mixed lengths and sampling settings, prompts up to 70 tokens (window 32,
    many ratio-2/4 groups, chunks of 24) produce exactly the tokens they produce alone."""
    ref = alone(family, tmp_path_factory, mode)
    eng = engine(family, tmp_path_factory, mode, max_num_tokens=24)
    got = run(eng, requests(len(ref)))
    assert got == ref
    assert any(len(t) > 1 for t, _, _ in got.values())


@pytest.mark.slow
def test_decode_slots_serve_the_same_tokens(family, tmp_path_factory):
    """The mixed set again with the decode caches in slots (model_def/decode_slots.py; on a GPU they come with the
    CUDA graphs): the same tokens as each request alone, prompt chunks and slot decode tokens sharing steps, and
    every slot back once the requests are done (released with the plan, not when Python collects the states)."""
    ref = alone(family, tmp_path_factory, "fused64")
    eng = engine(family, tmp_path_factory, "fused64", max_num_tokens=24)
    model = eng.runner.model
    slots = model.enable_decode_slots(len(ref), BUILD.max_seq_len)
    try:
        got = run(eng, requests(len(ref)))
        # the last step's finished requests are released with the next plan: one more request (a prompt only)
        run(eng, [Request("tail", prompt(999, 3), SamplingParams(max_tokens=1, ignore_eos=True))])
        free = slots.free
    finally:
        model.decode_slots = None
    assert got == ref
    assert free == len(ref)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["isolated", "fused64"])
def test_cache_exhaustion_preempts_and_recovers(family, mode, tmp_path_factory):
    """A pool (4-token pages) that holds both requests' prompts and nothing more: when the older one needs a page,
    the newer one is preempted, waits, and later recomputes its prompt and generated tokens; both outputs (one
    greedy, one seeded sampling) equal those produced alone; usage returns to zero."""
    reqs = [Request("x", prompt(300, 5), SamplingParams(max_tokens=10, ignore_eos=True)),
            Request("y", prompt(301, 30), SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=3))]
    ref = {}
    for r in reqs:
        ref.update(run(engine(family, tmp_path_factory, mode, max_num_tokens=24, block_size=4), [r]))
    probe = engine(family, tmp_path_factory, mode, block_size=4)
    lay = probe.cache.layout
    pool = lay.blocks_for(5) + lay.blocks_for(30)
    eng = engine(family, tmp_path_factory, mode, max_num_tokens=24, block_size=4,
                 kv_cache_bytes=pool * lay.bytes_per_block)
    assert run(eng, reqs) == ref
    assert eng.stats()["num_preemptions"] >= 1


def test_one_iteration_runs_every_scheduled_request(tmp_path_factory):
    """Four 5-token prompts fit one step: 3 iterations (prompts, then two decodes), each with all 4 requests;
    /metrics reports them."""
    from dsflash.serve.api.metrics import Metrics, parse
    eng = engine("v41", tmp_path_factory)
    run(eng, [Request(f"i{i}", prompt(400 + i, 5), SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(4)])
    s = eng.stats()
    assert s["num_iterations"] == 3 and s["scheduled_batch_size"] == 4 and s["iteration_latency"]["count"] == 3
    v = parse(Metrics("tiny").render(json.loads(json.dumps(s))))    # stats() is plain data
    assert v["trtllm_iterations_total"] == 3 and v["trtllm_scheduled_batch_size"] == 4
    assert v["trtllm_iteration_latency_seconds_count"] == 3


def test_stop_strings_logprobs_and_limits(tmp_path_factory):
    eng = engine("v41", tmp_path_factory)
    p = prompt(7, 6)
    full = run(eng, [Request("a", p, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2))])["a"]
    text = full[2]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and text.find(stop) == len(text) // 2
    got = run(eng, [Request("b", p, SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))])["b"]
    assert got[1] == "stop" and got[2] == text[:len(text) // 2]
    assert got[0] == full[0][:len(got[0])] and len(got[0]) < 12
    # a stop token ends the request with the token included
    got = run(eng, [Request("c", p, SamplingParams(max_tokens=12, stop_token_ids=[full[0][3]]))])["c"]
    assert got[0] == full[0][:4] and got[1] == "stop"
    # logprobs: greedy picks the best token, whose logprob heads the top list
    eng.add_request(Request("d", p, SamplingParams(max_tokens=2, logprobs=3)))
    outs = []
    while eng.has_work():
        outs += eng.step()
    for o in outs:
        (lp,) = o.logprobs
        assert lp["token_id"] == o.new_token_ids[0] == lp["top_logprobs"][0]["token_id"]
        assert len(lp["top_logprobs"]) == 3 and lp["logprob"] <= 0
    # max_seq_len ends generation with "length"; prompts that leave no room are refused
    short = engine("v41", tmp_path_factory, max_seq_len=10)
    got = run(short, [Request("e", p, SamplingParams(max_tokens=50, ignore_eos=True))])["e"]
    assert got[0] == full[0][:4] and got[1] == "length"
    with pytest.raises(ValueError, match="max_seq_len"):
        short.add_request(Request("f", prompt(8, 10), SamplingParams()))
    for bad in ([], [0, 10 ** 9], "abc"):
        with pytest.raises(ValueError, match="prompt token ids"):
            short.add_request(Request("g", bad, SamplingParams()))
    # a request that could never fit the pool is refused up front
    lay = eng.cache.layout
    small = engine("v41", tmp_path_factory, kv_cache_bytes=lay.blocks_for(128) * lay.bytes_per_block)
    small.add_request(Request("h", prompt(9, 60), SamplingParams(max_tokens=68)))
    with pytest.raises(ValueError, match="needs 7 KV-cache blocks for 129 tokens but the cache holds 6"):
        small.add_request(Request("i", prompt(9, 60), SamplingParams(max_tokens=69)))
    with pytest.raises(ValueError, match="max_num_tokens must be in"):
        engine("v41", tmp_path_factory, max_num_tokens=65)


def test_queue_full_and_abort_frees_pages(tmp_path_factory):
    eng = engine("v41", tmp_path_factory, max_queue=2, max_batch_size=1)
    for i in range(2):
        eng.add_request(Request(f"q{i}", prompt(i, 40), SamplingParams(max_tokens=30)))
    with pytest.raises(QueueFullError):
        eng.add_request(Request("q2", prompt(2, 4), SamplingParams()))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request(Request("q1", prompt(2, 4), SamplingParams()))
    eng.step()
    assert eng.stats()["kv_cache_used_blocks"] > 0 and eng.stats()["num_waiting"] == 1
    eng.abort("q0")
    eng.abort("q1")
    eng.abort("unknown")
    assert eng.stats()["kv_cache_used_blocks"] == 0
    outs = eng.step()
    assert sorted((o.request_id, o.finished, o.finish_reason) for o in outs) == [("q0", True, "abort"),
                                                                                ("q1", True, "abort")]
    assert not eng.has_work()


@pytest.mark.slow
def test_async_engine_disconnect_and_drain(tmp_path_factory):
    eng = engine("v41", tmp_path_factory)
    want = run(eng, [Request("w", prompt(3, 9), SamplingParams(max_tokens=5, ignore_eos=True))])["w"][0]
    aeng = AsyncLLMEngine(eng)

    async def full(rid):
        toks = []
        async for o in aeng.generate(Request(rid, prompt(3, 9), SamplingParams(max_tokens=5, ignore_eos=True))):
            toks += o.new_token_ids
        return toks

    async def disconnect(rid):
        agen = aeng.generate(Request(rid, prompt(4, 30), SamplingParams(max_tokens=500, ignore_eos=True)))
        async for _ in agen:
            break               # the client goes away after the first token
        await agen.aclose()

    async def scenario():
        assert aeng.ready
        a, _ = await asyncio.gather(full("a"), disconnect("b"))
        assert a == want
        for _ in range(200):
            if not eng.has_work():
                break
            await asyncio.sleep(0.01)
        s = aeng.stats()
        assert s["kv_cache_used_blocks"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
        # drain: a long request is cut off when the timeout passes; new requests are refused meanwhile
        long = aeng.generate(Request("c", prompt(5, 9), SamplingParams(max_tokens=400, ignore_eos=True)))
        first = await long.__anext__()
        clean = await aeng.drain(timeout=0.2)
        rest = [o async for o in long]
        assert not clean and not aeng.ready and not first.finished and rest[-1].finish_reason == "abort"
        with pytest.raises(QueueFullError):
            await aeng.generate(Request("d", prompt(6, 4), SamplingParams())).__anext__()
        assert aeng.stats()["kv_cache_used_blocks"] == 0

    asyncio.run(scenario())
    aeng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.add_request(Request("e", prompt(6, 4), SamplingParams()))


def mpirun(engine_dir: Path, job: dict, tmp_path: Path, world: int = 2,
           timeout: float = 240) -> tuple[subprocess.CompletedProcess, dict | None]:
    jf, out = tmp_path / "job.json", tmp_path / "out.json"
    jf.write_text(json.dumps(job))
    script = Path(__file__).with_name("runtime_mpi_job.py")
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-n", str(world), sys.executable,
                        str(script), str(engine_dir), str(jf), str(out)], env=env, capture_output=True, text=True,
                       timeout=timeout)
    return r, (json.loads(out.read_text()) if out.is_file() else None)


@pytest.mark.mpi
@pytest.mark.slow
def test_tp2_ep2_match_tp1_and_a_dead_worker_stops_the_job(tmp_path_factory, tmp_path):
    """TP2 and EP2 (tp 2 = moe_ep 2) (gloo) through LLMEngine + worker_loop: batched ==
    alone (the 40-token prompt chunked by 16) == TP1, token for token. The engines compute in float64 (`--dtype`):
    in fp32 the row-parallel partial sums round differently from the unsharded GEMM (~3e-8), and on random tiny
    weights one FP8/FP4 grid flip can cascade. Then a worker that fails must abort the whole job with a clear
    message instead of leaving rank 0 hanging."""
    hf, _, _ = built("v41", tmp_path_factory)
    b64 = dataclasses.replace(BUILD, dtype="float64")
    tp1 = write_engine(hf, tmp_path / "tp1", Mapping(), "cpu", b64, progress=False)
    reqs = [Request(f"t{i}", prompt(200 + i, n), SamplingParams(max_tokens=5, ignore_eos=True))
            for i, n in enumerate((6, 40, 13))]
    want = {k: v[0] for k, v in run(LLMEngine(str(tp1), kv_cache_bytes=1 << 26, max_num_tokens=16), reqs).items()}
    for tag, m, crash in (("tp2", Mapping(world_size=2, tp_size=2), True),
                          ("ep2", Mapping(world_size=2, tp_size=2, moe_ep_size=2), False)):
        eng_dir = write_engine(hf, tmp_path / tag, m, "cpu", b64, progress=False)
        job = {"requests": [[r.request_id, r.prompt_ids, r.params.max_tokens] for r in reqs], "max_num_tokens": 16,
               "crash": crash}
        t0 = time.monotonic()
        r, out = mpirun(eng_dir, job, tmp_path, world=m.world_size)
        assert out is not None, r.stderr[-3000:]
        assert out["batched"] == out["alone"] == want, tag
        assert out["stats"]["kv_cache_used_blocks"] == 0 and out["stats"]["generation_tokens_total"] == 30
        if crash:
            assert r.returncode != 0 and time.monotonic() - t0 < 200
            assert "[dsflash rank 1] worker failed: IndexError" in r.stderr
        else:
            assert r.returncode == 0, r.stderr[-3000:]
