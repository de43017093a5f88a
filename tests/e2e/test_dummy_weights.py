"""Dummy-weight engines and lean loading: no rank files, weights drawn at load time in the engine's formats; the
MoE plugin's experts and the Engram tables kept as stored, never dequantized whole; a rank that cannot fit is
refused before anything is allocated."""
import json
from pathlib import Path

import pytest
import torch

from dsflash.build.bind import site_parity
from dsflash.build.cli import main as build_main
from dsflash.build.engine import EngineError, load_engine_model, verify_engine, write_engine
from dsflash.build.plan import BuildConfig
from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset, load_reference
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.ragged import generate_greedy

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def _build(tmp_path, name, *extra):
    out = tmp_path / name
    assert build_main(["--dummy-weights", "--out", str(out), "--tune-budget-s", "0", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def dummy_cpu(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("dummy"), "cpu", "--preset", "v41/tiny")


def test_engine_has_no_rank_files_and_draws_the_same_weights_each_load(dummy_cpu, tmp_path):
    meta = json.loads((dummy_cpu / "engine.json").read_text())
    assert meta["weights"] == {"format": "dummy", "seed": 0} and meta["ranks"][0]["file"] is None
    assert not list(dummy_cpu.glob("*.safetensors")) and (dummy_cpu / "tokenizer.json").is_file()
    verify_engine(dummy_cpu)
    a, _ = load_engine_model(dummy_cpu)
    b, _ = load_engine_model(dummy_cpu)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k].view(torch.uint8) if sa[k].element_size() == 1 else sa[k],
                           sb[k].view(torch.uint8) if sb[k].element_size() == 1 else sb[k]) for k in sa)
    assert all(not torch.equal(v, torch.zeros_like(v)) for k, v in sa.items() if v.is_floating_point()
               and v.element_size() > 1)
    tokens = generate_greedy(a, IDS, 4)
    assert torch.equal(tokens, generate_greedy(b, IDS, 4))
    other, _ = load_engine_model(_build(tmp_path, "seed1", "--preset", "v41/tiny", "--seed", "1"))
    assert not torch.equal(other.layers[0].attn.wq_b.weight, a.layers[0].attn.wq_b.weight)


def test_tp_ranks_draw_whole_tensors_alike_and_their_slices_apart(tmp_path, partial_sums):
    eng = _build(tmp_path, "tp2", "--preset", "v41/tiny-wide", "--tp", "2")
    r0, _ = load_engine_model(eng, 0, comm=partial_sums(2, 0))
    r1, _ = load_engine_model(eng, 1, comm=partial_sums(2, 1))
    assert torch.equal(r0.layers[0].attn_norm.weight, r1.layers[0].attn_norm.weight)      # replicated
    assert torch.equal(r0.embed.weight, r1.embed.weight)                                   # (unsharded entry)
    assert not torch.equal(r0.layers[0].attn.wq_b.weight, r1.layers[0].attn.wq_b.weight)  # column slices


def test_moe_plugin_experts_stay_shape_only_and_change_nothing(tmp_path):
    """An sm90 engine bound on this CPU (the plugins' references run): the routed experts get no dense weights, and
    the model computes exactly what it does with them."""
    eng = _build(tmp_path, "sm90", "--preset", "v41/tiny", "--arch", "sm90")
    lean, _ = load_engine_model(eng, check_arch=False, device="cpu", dtype=torch.float32)
    dense, _ = load_engine_model(eng, check_arch=False, device="cpu", dtype=torch.float32, dense_experts=True)
    moe = lean.layers[0].ffn
    assert moe.plugin is not None and all(p.is_meta for p in moe.experts.parameters())
    assert not any(p.is_meta for n, p in lean.named_parameters() if ".experts." not in n)
    assert not any(p.is_meta for p in dense.parameters())
    with torch.no_grad():
        assert torch.equal(lean.logits(IDS), dense.logits(IDS))
    with pytest.raises(ValueError, match="dense_experts=True"):
        site_parity(lean, IDS)


def test_engram_table_is_kept_as_stored_and_looks_up_the_checkpoint_values(tmp_path):
    hf = synthesize(get_preset("v41", "tiny"), tmp_path / "hf", seed=5)
    eng = write_engine(hf, tmp_path / "eng", Mapping(), "cpu", BuildConfig(), progress=False)
    model, _ = load_engine_model(eng)
    ref = load_reference(hf)
    for layer in model.args.engram_layer_ids:
        table, want = model.layers[layer].engram.embed, ref.layers[layer].engram.embed.weight
        assert table.weight.dtype == torch.float8_e4m3fn and table.scale.dtype == torch.uint8
        idx = torch.randint(0, want.shape[0], (3, 5, 24), generator=torch.Generator().manual_seed(layer))
        assert torch.equal(table.lookup(idx), want[idx])
    with pytest.raises(ValueError, match="NaN encoding"):
        table.set_stored(table.weight.data, torch.full_like(table.scale, 255))


def test_a_rank_that_cannot_fit_is_refused_before_allocating(tmp_path):
    eng = _build(tmp_path, "full", "--preset", "v41/full")
    with pytest.raises(EngineError, match=r"rank 0 needs \d+\.\d GiB of weights on cpu, which has"):
        load_engine_model(eng)


def test_build_flags(tmp_path, capsys):
    assert build_main(["--ckpt", str(tmp_path), "--dummy-weights", "--out", str(tmp_path / "x")]) == 2
    assert "--dummy-weights goes with --preset" in capsys.readouterr().err
    assert build_main(["--preset", "v41/tiny", "--out", str(tmp_path / "x")]) == 2
    assert "a dummy-weight engine (--dummy-weights)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_model_override_args_shape_a_preset_engine(tmp_path, capsys):
    """--json-model-override-args (SGLang's flag) builds a preset with some config fields replaced, e.g. fewer
    layers of full width for a one-GPU shape study; the engine records and loads the replaced config, and a field
    that is unknown or inconsistent is refused naming the flag, writing nothing."""
    fewer = {"num_hidden_layers": 8, "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 0, 0, 0],
             "kv_source_layer_ids": [2, 6], "index_source_layer_ids": [2, 6], "candidate_source_layer_id": 6,
             "dspark_target_layer_ids": [5, 6, 7], "engram_layer_ids": [1, 4]}
    eng = _build(tmp_path, "fewer", "--preset", "v41/tiny", "--json-model-override-args", json.dumps(fewer))
    model, _ = load_engine_model(eng)
    assert len(model.layers) == 8 and [layer.attn.ratio for layer in model.layers] == fewer["compress_ratios"][:8]
    assert generate_greedy(model, IDS, 2).shape == (1, IDS.shape[1] + 2)
    for bad, needle in (('{"num_layers": 8}', "unknown v41 config field(s) ['num_layers']"),
                        ('{"num_hidden_layers": 8}', "field 'compress_ratios' has 13 entries, expected 8 or 11"),
                        ('{"num_hidden_layers": ', "--json-model-override-args: not valid JSON"),
                        ("[8]", "expected a JSON object of config fields")):
        assert build_main(["--preset", "v41/tiny", "--dummy-weights", "--out", str(tmp_path / "bad"),
                           "--json-model-override-args", bad]) == 2
        err = capsys.readouterr().err
        assert "--json-model-override-args" in err and needle in err, err
    assert build_main(["--ckpt", str(tmp_path), "--out", str(tmp_path / "bad"),
                       "--json-model-override-args", "{}"]) == 2
    assert "goes with --preset" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_a_cached_engine_of_another_format_version_is_rebuilt(tmp_path, capsys):
    """`bench --load-format dummy` keeps its engines in a workspace: one written by another dsflash (an older engine
    format) is rebuilt there, not loaded and not refused; a current one is reused as is."""
    import argparse
    from dsflash.build.engine import ENGINE_VERSION, is_current_engine
    from dsflash.serve.bench.cli import dummy_engine
    a = argparse.Namespace(model_preset="v41/tiny", tp=1, ep=None, tune_budget_s=0.0, max_batch_size=4,
                           max_num_tokens=16, max_seq_len=64, workspace=str(tmp_path))
    engine = dummy_engine(a)
    meta_file = Path(engine) / "engine.json"
    assert is_current_engine(engine)
    first = meta_file.stat().st_mtime_ns
    assert dummy_engine(a) == engine and meta_file.stat().st_mtime_ns == first
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps(meta | {"version": ENGINE_VERSION - 1}))
    assert not is_current_engine(engine)
    assert dummy_engine(a) == engine and is_current_engine(engine)
    assert "built by another dsflash version" in capsys.readouterr().err
