"""`dsflash bench` end to end on tiny CPU engines: prepare-dataset -> throughput sweep / latency, the report's
figures against the requests it ran, outputs equal to the engine's greedy generation, failed requests, a dummy
engine, and a TP2 engine under mpirun."""
import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from dsflash.build.engine import load_engine_model, write_engine
from dsflash.build.plan import BuildConfig
from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset
from dsflash.model_def.mapping import Mapping
from dsflash.serve.bench.cli import main
from dsflash.serve.bench.dataset import BenchRequest, load_dataset
from dsflash.serve.bench.serving import stream_one
from dsflash.serve.llm_engine import LLMEngine

KV = str(1 << 26)

_spec = importlib.util.spec_from_file_location("_serving", Path(__file__).with_name("_serving.py"))
sv = sys.modules.setdefault("_serving", importlib.util.module_from_spec(_spec))
if not hasattr(sv, "Served"):
    _spec.loader.exec_module(sv)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    hf = synthesize(get_preset("v41", "tiny"), root / "hf", seed=9)
    return write_engine(hf, root / "engine", Mapping(), "cpu",
                        BuildConfig(max_batch_size=8, max_num_tokens=64, max_seq_len=96), progress=False)


def dataset(engine, path, n=4, isl=(6, 20), osl=(2, 5)):
    rc = main(["prepare-dataset", "--tokenizer", str(engine), "--output", str(path), "--random-seed", "5",
               "token-unif-dist", "--num-requests", str(n), "--input-min", str(isl[0]), "--input-max", str(isl[1]),
               "--output-min", str(osl[0]), "--output-max", str(osl[1])])
    assert rc == 0 and path.is_file()
    return path


@pytest.mark.slow
def test_throughput_sweep_reports_what_it_ran(tiny, tmp_path, capsys):
    data = dataset(tiny, tmp_path / "d.jsonl")
    rep, reqs_json, plot = tmp_path / "r.json", tmp_path / "q.json", tmp_path / "s.svg"
    rc = main(["throughput", "--engine", str(tiny), "--dataset", str(data), "--concurrency", "1,3",
               "--warmup", "1", "--kv-cache-bytes", KV, "--report-json", str(rep), "--request-json", str(reqs_json),
               "--plot", str(plot), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("= PERFORMANCE OVERVIEW") == 2 and "| concurrency |" in out
    doc = json.loads(rep.read_text())
    reqs = load_dataset(data, 129280)
    want_out = sum(r.output_tokens for r in reqs)
    assert [row["concurrency"] for row in doc["sweep"]] == [1, 3]
    for run, c in zip(doc["runs"], (1, 3)):
        assert run["world_info"]["concurrency"] == c
        info, perf = run["request_info"], run["performance"]
        assert info["num_requests"] == 4 and info["num_failed_requests"] == 0      # warm-up not counted
        assert info["avg_output_length"] == want_out / 4
        assert perf["system_output_throughput_tok_s"] == pytest.approx(want_out / perf["total_latency_ms"] * 1e3)
        # a sweep reports TTFT / TPOT without --streaming: its table needs them
        assert run["streaming_metrics"]["ttft_percentiles"]["maximum"] <= perf["total_latency_ms"]
        assert set(run) >= {"engine", "machine", "world_info", "request_info", "performance", "dataset"}
    assert doc["runs"][0]["request_info"]["avg_num_concurrent_requests"] <= 1.0 + 1e-6
    # every request ran greedy to exactly its output_tokens, as the engine generates it alone, at both concurrencies
    rows = json.loads(reqs_json.read_text())
    assert len(rows) == 8 and all(r["error"] is None and r["finish_reason"] == "length" for r in rows)
    model = load_engine_model(tiny)[0]
    for r in reqs:
        want = model.generate_greedy(torch.tensor([r.input_ids]), r.output_tokens)[0, len(r.input_ids):].tolist()
        got = [row["output_ids"] for row in rows if row["task_id"] == r.task_id]
        assert got == [want, want]
    assert len(ET.parse(plot).getroot().findall("{http://www.w3.org/2000/svg}circle")) == 2


@pytest.mark.slow
def test_latency_and_failed_requests(tiny, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"task_id": i, "input_ids": [5 + i] * n, "output_tokens": 2}) + "\n"
                            for i, n in enumerate((8, 70, 12)))
                    + json.dumps({"task_id": "text", "prompt": "The three primary colors are", "output_tokens": 3}))
    lay = LLMEngine(str(tiny), kv_cache_bytes=1 << 26).cache.layout
    pool = lay.blocks_for(14) * lay.bytes_per_block
    rep = tmp_path / "r.json"
    # a pool for one 64-token page (and the per-request state): the 72-token request can never fit and fails; the
    # others run and are reported
    rc = main(["latency", "--engine", str(tiny), "--dataset", str(data), "--kv-cache-bytes", str(pool),
               "--warmup", "0", "--report-json", str(rep), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 1 and "request 1 failed (not counted)" in captured.err
    doc = json.loads(rep.read_text())
    assert doc["request_info"]["num_requests"] == 3 and doc["request_info"]["num_failed_requests"] == 1
    assert doc["request_info"]["avg_output_length"] == pytest.approx(7 / 3)     # the prompt line was tokenized
    assert doc["world_info"]["concurrency"] == 1 and doc["streaming_metrics"]["avg_tpot_ms"] > 0


def test_bad_inputs_exit_2_with_one_clear_message(tiny, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"task_id": "long", "input_ids": [3] * 90, "output_tokens": 10}) + "\n")
    assert main(["throughput", "--engine", str(tiny), "--dataset", str(data), "--kv-cache-bytes", KV]) == 2
    assert "task_id 'long' needs 90 + 10 tokens; the engine's max_seq_len is 96" in capsys.readouterr().err
    assert main(["throughput", "--engine", str(tiny), "--dataset", str(data), "--concurrency", "0"]) == 2
    assert "--concurrency values must be >= 1 or -1" in capsys.readouterr().err
    assert main(["throughput", "--engine", str(tmp_path), "--dataset", str(data)]) == 2
    assert "engine.json missing" in capsys.readouterr().err
    assert main(["throughput", "--load-format", "dummy", "--model-preset", "v41/full", "--workspace",
                 str(tmp_path / "ws"), "--dataset", str(data)]) == 2   # (built, then refused before allocating)
    assert "GiB of weights on cpu, which has" in capsys.readouterr().err
    assert main(["throughput", "--load-format", "dummy", "--model-preset", "v41/tiny", "--tune-budget-s", "-1",
                 "--dataset", str(data)]) == 2
    assert "--tune-budget-s must be >= 0, got -1.0" in capsys.readouterr().err
    assert main(["throughput", "--engine", str(tiny), "--tune-budget-s", "5", "--dataset", str(data)]) == 2
    assert "--tune-budget-s go with --load-format dummy" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"task_id": 1}\n')
    assert main(["throughput", "--engine", str(tiny), "--dataset", str(tmp_path / "bad.jsonl"),
                 "--kv-cache-bytes", KV]) == 2
    assert "bad.jsonl:1: output_tokens must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.mpi
def test_dummy_engine_tp2_under_mpirun_and_its_rank_simulation(tmp_path, capsys):
    """--load-format dummy builds a TP2 dummy-weight engine of the preset once (kept in the workspace; no rank files:
    each rank draws its weights at load time) and the run relaunches
    itself on two ranks; `collectives` measures all-reduce time on two ranks; one rank simulated alone with that
    cost makes the same collectives as the real run."""
    ws = tmp_path / "ws"
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"task_id": i, "input_ids": [9 + i] * 7, "output_tokens": 3}) + "\n"
                            for i in range(3)))
    rep = tmp_path / "r.json"
    argv = ["throughput", "--load-format", "dummy", "--model-preset", "v41/tiny-wide", "--tp", "2",
            "--workspace", str(ws), "--max-seq-len", "64", "--max-num-tokens", "64", "--tune-budget-s", "0",
            "--dataset", str(data),
            "--concurrency", "2", "--warmup", "0", "--kv-cache-bytes", KV, "--report-json", str(rep), "--no-progress"]
    assert main(argv) == 0
    engines = list((ws / "v41-tiny-wide").glob("engine-cpu-tp2-*"))
    assert len(engines) == 1 and engines[0].name.endswith("-tune0")
    meta = json.loads((engines[0] / "engine.json").read_text())
    assert meta["build_config"]["tune_budget_s"] == 0 and meta["weights"]["format"] == "dummy"
    doc = json.loads(rep.read_text())
    assert doc["world_info"]["world_size"] == 2 and doc["world_info"]["tp_size"] == 2
    assert doc["request_info"]["num_requests"] == 3 and doc["request_info"]["avg_output_length"] == 3
    assert doc["performance"]["output_throughput_per_gpu_tok_s"] == pytest.approx(
        doc["performance"]["system_output_throughput_tok_s"] / 2)
    real = doc["collectives"]
    assert real["all_reduce_calls"] > 0 and real["added_collective_ms"] is None

    # the TP-rank simulation: rank 1 alone, all-reduces local no-ops plus their time measured on two ranks
    cost = tmp_path / "cost.json"
    assert main(["collectives", "--world-size", "2", "--output", str(cost), "--sizes", "64,4096", "--iters", "2"]) == 0
    table = json.loads(cost.read_text())
    assert table["backend"] == "gloo" and [b for b, _ in table["all_reduce_us"]] == [64, 4096]
    sim_rep = tmp_path / "sim.json"
    argv = argv[argv.index("--dataset"):] + ["--engine", str(engines[0]), "--simulate-rank", "1",
                                             "--collective-cost", str(cost)]
    argv[argv.index("--report-json") + 1] = str(sim_rep)
    assert main(["throughput", *argv]) == 0
    out = capsys.readouterr().out
    assert "TP-RANK SIMULATION: SIMULATED FIGURES" in out
    sim = json.loads(sim_rep.read_text())
    assert sim["simulation"]["simulated_rank"] == 1 and sim["simulation"]["world_size"] == 2
    assert sim["simulation"]["collective_cost"]["backend"] == "gloo"
    # the simulated rank made exactly the collectives of the real TP2 run, and their measured time was added
    assert sim["collectives"]["all_reduce_calls"] == real["all_reduce_calls"]
    assert sim["collectives"]["all_reduce_bytes"] == real["all_reduce_bytes"]
    least = min(us for _, us in table["all_reduce_us"]) * real["all_reduce_calls"] / 1e3
    assert least <= sim["collectives"]["added_collective_ms"] < sim["performance"]["total_latency_ms"]
    assert sim["request_info"]["num_requests"] == 3 and sim["request_info"]["avg_output_length"] == 3


@pytest.mark.slow
def test_speculative_run_reports_decoding_stats(tiny, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"task_id": i, "input_ids": [3 + i] * 9, "output_tokens": 12}) + "\n"
                            for i in range(2)))
    rep = tmp_path / "r.json"
    rc = main(["throughput", "--engine", str(tiny), "--dataset", str(data), "--concurrency", "2", "--warmup", "0",
               "--kv-cache-bytes", KV, "--speculative-algorithm", "dspark", "--simulate-acceptance-length", "3",
               "--report-json", str(rep), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "= DECODING STATISTICS (dspark)" in out and "SIMULATED acceptance" in out
    doc = json.loads(rep.read_text())
    d = doc["decoding_stats"]
    assert d["mode"] == "dspark" and d["simulated_acceptance"] is True
    assert 1.5 < d["acceptance_length_percentiles"]["average"] <= d["num_draft_tokens"] + 1
    assert doc["request_info"]["avg_output_length"] == 12        # cut exactly at output_tokens


@pytest.mark.slow
def test_serving_benchmark_against_a_running_server(tmp_path_factory, tmp_path, capsys):
    """`bench serving` streams the dataset to `dsflash serve` (API key on) at two concurrencies: the tokens it
    counts are the engine's greedy tokens, a request the server refuses is reported as failed (exit 1), and a wrong
    key fails every request (exit 2, nothing to report)."""
    _, engine = sv.tiny_engine(sv.engines_dir(tmp_path_factory), "v41")
    data = tmp_path / "d.jsonl"
    good = [[0, 671, 6102, 294, 8760, 344], [0, 17, 4242, 99]]
    data.write_text("".join(json.dumps({"task_id": i, "input_ids": ids, "output_tokens": 4}) + "\n"
                            for i, ids in enumerate(good))
                    + json.dumps({"task_id": "oov", "input_ids": [1 << 30], "output_tokens": 4}) + "\n")
    res, plot = tmp_path / "res.json", tmp_path / "s.svg"
    with sv.Served(engine, "--api-key", "k3y") as server:
        rc = main(["serving", "--base-url", server.url, "--api-key", "k3y", "--dataset", str(data),
                   "--max-concurrency", "1,2", "--warmup", "1", "--save-result", str(res), "--plot", str(plot),
                   "--no-progress"])
        captured = capsys.readouterr()
        assert rc == 1 and "request 'oov' failed (not counted): HTTP 400" in captured.err
        assert captured.out.count(" Serving Benchmark Result ") == 2
        assert main(["serving", "--base-url", server.url, "--api-key", "wrong", "--model", "x", "--dataset",
                     str(data), "--warmup", "0", "--no-progress"]) == 2
        assert "no request completed" in capsys.readouterr().err
        assert main(["serving", "--base-url", server.url, "--dataset", str(data), "--max-concurrency", "0"]) == 2
        assert "--max-concurrency values must be >= 1 or -1" in capsys.readouterr().err
        # the token ids a request streams back are the engine's greedy tokens
        got = [stream_one(server.url, engine.name, BenchRequest(i, ids, 4), "k3y", 120)[0].output_ids
               for i, ids in enumerate(good)]
    doc = json.loads(res.read_text())
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 2] and len(doc["sweep"]) == 2
    model = load_engine_model(engine)[0]
    want = [model.generate_greedy(torch.tensor([ids]), 4)[0, len(ids):].tolist() for ids in good]
    for run in doc["runs"]:
        assert (run["completed"], run["failed"], run["total_output_tokens"]) == (2, 1, 8)
        assert run["total_input_tokens"] == sum(map(len, good)) and run["model"] == engine.name
        assert 0 < run["median_ttft_ms"] <= run["p99_e2el_ms"]
        assert run["mean_itl_ms"] == pytest.approx(run["mean_tpot_ms"], rel=0.5)   # one token per chunk
        assert run["trtllm_bench"]["request_info"]["num_requests"] == 2
    assert len(ET.parse(plot).getroot().findall("{http://www.w3.org/2000/svg}circle")) == 2
    assert got == want
