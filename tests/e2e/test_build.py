"""Engine build: per-rank plans, sharding that reassembles exactly, verification, errors; multi-rank generation."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsflash.build.engine import EngineError, load_engine_model, open_engine, verify_engine, write_engine
from dsflash.build.plan import BuildConfig, plan_ranks
from dsflash.build.shard import ShardError, expert_id
from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset, load_reference
from dsflash.model_def.checkpoint import HFCheckpoint
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.names import tensor_table

GiB = 2 ** 30


def dsflash(*argv, check=True):
    r = subprocess.run([sys.executable, "-m", "dsflash.serve.cli", *argv], capture_output=True, text=True)
    if check and r.returncode:
        raise AssertionError(r.stderr)
    return r


@pytest.fixture(scope="module")
def hf_v41(tmp_path_factory):
    return synthesize(get_preset("v41", "tiny-wide"), tmp_path_factory.mktemp("ck") / "hf", seed=3)


def test_dry_run_full_v41_tp8():
    """Full-size V4.1-Flash at TP8 from the preset alone.

    Experts (MXFP4, per expert w1/w3 [2304, 5120] + w2 [5120, 2304]; 40x384 + 3x128 = 15,744 experts) are sliced to
    288 per rank and padded after sharding to the 64-wide sm90 tile: 320, not 384. Per rank: w1/w3 320x2560 B +
    320x160 scale = 870,400 B each, w2 5120x160 + 5120x10 = 870,400 B -> 15,744 x 2,611,200 B = 38.29 GiB of experts.
    Engram tables (384,006,168 + 384,016,682 rows x 264 B, 188.8 GiB together) are row-split: 23.6 GiB per rank.
    architecture.md §3.3: experts + Engram = 464.5 GiB in the checkpoint, i.e. 58.06 GiB per rank before padding.
    """
    r = dsflash("build", "--preset", "v41/full", "--tp", "8", "--arch", "sm90", "--dry-run", "--json")
    rep = json.loads(r.stdout)
    assert rep["expert_inter_local"] == 288 and rep["expert_inter_padded"] == 320
    args = get_preset("v41", "full")
    table = tensor_table(args)
    n_exp = sum(1 for e in table if expert_id(e.name) and e.name.endswith("w1.weight"))
    assert n_exp == 15744
    cpu = plan_ranks(args, table, Mapping(world_size=8, tp_size=8), "cpu")
    sm90 = rep["ranks"]
    for p_cpu, p_gpu in zip(cpu, sm90):
        # padding 288 -> 320 costs exactly 15,744 x 3 x (870,400 - 783,360) bytes per rank
        assert p_gpu["bytes"] - p_cpu.bytes == 15744 * 3 * (870400 - 783360)
        assert 60 * GiB < p_gpu["bytes"] < 75 * GiB
    expert_engram = 15744 * 2350080 + sum((r // 8) * 264 for r in args.engram_num_embeddings)
    assert abs(expert_engram / GiB - 464.5 / 8) < 0.1


def test_non_dividing_topology_is_refused(hf_v41):
    r = dsflash("build", "--ckpt", str(hf_v41), "--tp", "3", "--dry-run", check=False)
    assert r.returncode != 0 and "does not divide num_attention_heads=8" in r.stderr
    r = dsflash("build", "--preset", "v41/full", "--tp", "8", "--moe-ep", "8", "--moe-tp", "2", "--dry-run", check=False)
    assert r.returncode != 0 and "moe_tp" in r.stderr
    args = get_preset("v41", "tiny-wide").replace(n_routed_experts=9)
    with pytest.raises(ShardError, match="moe_ep=2 does not divide n_routed_experts=9"):
        plan_ranks(args, [], Mapping(world_size=2, tp_size=2, moe_ep_size=2), "cpu")


def test_layout_arch_mismatch(hf_v41, tmp_path):
    r = dsflash("build", "--ckpt", str(hf_v41), "--arch", "sm100", "--out", str(tmp_path / "e"), check=False)
    assert r.returncode != 0 and "'reference' checkpoint cannot make an sm100 engine" in r.stderr
    assert not (tmp_path / "e").exists()


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("tp,moe_ep", [(2, None), (2, 2), (4, 2)])  # TP2, EP2, TP4 = MoE-TP2 x MoE-EP2
def test_sharded_engines_reassemble(hf_v41, tmp_path, tp, moe_ep):
    m = Mapping(world_size=tp, tp_size=tp, moe_ep_size=moe_ep)
    out = write_engine(hf_v41, tmp_path / "e", m, "cpu", BuildConfig(), progress=False)
    eng = open_engine(out)
    ck = HFCheckpoint(hf_v41)
    ranks = [load_file(str(eng.rank_file(r))) for r in range(tp)]
    for e in tensor_table(ck.args):
        for name in [e.name] + ([e.scale_name] if e.quantized else []):
            full = _bytes(ck.get(name))
            have = [_bytes(r[name]) for r in ranks if name in r]
            assert have, name
            if all(torch.equal(h, full) for h in have):  # replicated, or a whole expert on its EP rank
                continue
            dim = 1 if (e.shard == "row" or name.endswith("w2.weight") or name.endswith("w2.scale")) else 0
            assert torch.equal(torch.cat(have, dim), full), name


def test_engine_on_wrong_arch_is_refused(hf_v41, tmp_path):
    out = write_engine(hf_v41, tmp_path / "e", Mapping(), "cpu", BuildConfig(), progress=False)
    meta = json.loads((out / "engine.json").read_text())
    meta["arch"] = "sm90"
    (out / "engine.json").write_text(json.dumps(meta))
    with pytest.raises(EngineError, match="built for sm90, but this machine is cpu"):
        open_engine(out)
    r = dsflash("generate", "--engine", str(out), "--input-ids", "1,2,3", "--max-new-tokens", "2", check=False)
    assert r.returncode != 0 and "built for sm90" in r.stderr


def test_damaged_rank_file_is_named(hf_v41, tmp_path):
    """A truncated rank file, a missing tensor and a tensor of the wrong dtype each fail loading (and verification)
    with the file and tensor named; the CLI exits non-zero with that message, not a traceback."""
    import shutil
    good = write_engine(hf_v41, tmp_path / "good", Mapping(), "cpu", BuildConfig(), progress=False)
    tensors = load_file(str(good / "rank0.safetensors"))
    name = next(n for n in sorted(tensors) if tensors[n].dtype == torch.bfloat16)

    def damaged(tag, damage):
        eng = tmp_path / tag
        shutil.copytree(good, eng)
        damage(eng / "rank0.safetensors")
        return eng

    truncated = damaged("truncated", lambda f: f.write_bytes(f.read_bytes()[:-1000]))
    missing = damaged("missing", lambda f: save_file({k: v for k, v in tensors.items() if k != name}, str(f)))
    retyped = damaged("retyped", lambda f: save_file({**tensors, name: tensors[name].float()}, str(f)))
    cases = [(truncated, "truncated safetensors file"), (missing, f"tensor '{name}' is missing"),
             (retyped, f"tensor '{name}' is F32 .*, expected BF16")]
    for eng, why in cases:
        for check in (load_engine_model, verify_engine):
            with pytest.raises(EngineError, match=f"rank0.safetensors: {why}"):
                check(eng)
    load_engine_model(good)
    verify_engine(good)
    r = dsflash("generate", "--engine", str(truncated), "--input-ids", "1,2,3", "--max-new-tokens", "2", check=False)
    assert r.returncode != 0 and "rank0.safetensors: truncated safetensors file" in r.stderr
    assert "Traceback" not in r.stderr
    r = dsflash("generate", "--engine", str(tmp_path / "absent"), "--input-ids", "1", "--max-new-tokens", "1",
                check=False)
    assert r.returncode != 0 and "absent: directory not found" in r.stderr


def test_canonical_checkpoint_that_disagrees_with_its_config_is_refused(hf_v41, tmp_path):
    """A convert output whose config.json was edited afterwards, or whose shard lost a tensor the manifest lists,
    fails `build` up front naming the shard and tensor, and leaves no engine directory."""
    import shutil
    ck = tmp_path / "ck"
    dsflash("convert", "--hf", str(hf_v41), "--out", str(ck), "--layout", "reference")
    resized = tmp_path / "resized"
    shutil.copytree(ck, resized)
    cfg = json.loads((resized / "config.json").read_text())
    cfg["model"]["text_config"]["hidden_size"] += 16
    (resized / "config.json").write_text(json.dumps(cfg))
    r = dsflash("build", "--ckpt", str(resized), "--out", str(tmp_path / "e1"), "--tp", "1", "--arch", "cpu",
                check=False)
    assert r.returncode != 0 and "tensor 'embed.weight' is BF16" in r.stderr and "config.json implies" in r.stderr
    assert not (tmp_path / "e1").exists()
    emptied = tmp_path / "emptied"
    shutil.copytree(ck, emptied)
    shard = sorted(emptied.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    gone = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != gone}, str(shard))
    r = dsflash("build", "--ckpt", str(emptied), "--out", str(tmp_path / "e2"), "--tp", "1", "--arch", "cpu",
                check=False)
    assert r.returncode != 0 and f"{shard.name}: tensor '{gone}' is missing (manifest.json lists it)" in r.stderr
    assert not (tmp_path / "e2").exists()


def test_disk_full_during_build_leaves_nothing(hf_v41, tmp_path, monkeypatch):
    import dsflash.build.engine as be
    calls = {"n": 0}
    real = be.save_file

    def full_disk(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **k)
    monkeypatch.setattr(be, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_engine(hf_v41, tmp_path / "e", Mapping(world_size=2, tp_size=2), "cpu", BuildConfig(), progress=False)
    assert not (tmp_path / "e").exists() and not list(tmp_path.glob("e.tmp*"))


@pytest.mark.mpi
def test_tp4_ep2_generation_matches_tp1_and_reference(hf_v41, tmp_path):
    """`dsflash generate` on float64 engines: the TP all-reduce sums in another order than the unsharded GEMM; in fp32
    such last-bit differences can cross an FP8/FP4 rounding boundary of deploy numerics and flip tokens on longer
    sequences. TP2 and EP2 against TP1 are test_runtime's (`test_tp2_ep2_match_tp1_and_a_dead_worker_stops_the_job`);
    here the CLI runs the mixed topology, 4 ranks with the experts split in two groups."""
    ids = [0, 671, 6102, 294, 8760, 344] + list(range(1000, 1034))  # 40-token prompt
    ref = load_reference(hf_v41, numerics="deploy", dtype=torch.float64)
    ref = ref.generate_greedy(torch.tensor([ids]), 6)[0, len(ids):].tolist()
    outs = {}
    topologies = {"tp1": [], "tp4_ep2": ["--tp", "4", "--moe-ep", "2"]}
    for tag, extra in topologies.items():
        dsflash("build", "--ckpt", str(hf_v41), "--out", str(tmp_path / tag), "--dtype", "float64", *extra)
        r = dsflash("generate", "--engine", str(tmp_path / tag), "--input-ids", ",".join(map(str, ids)),
                    "--max-new-tokens", "6", "--json")
        outs[tag] = json.loads(r.stdout.strip().splitlines()[-1])["output_ids"]
    assert outs["tp1"] == ref and outs["tp4_ep2"] == ref


def test_hopper_engine_pads_experts_after_sharding(tmp_path):
    """tiny V4.1 (expert intermediate 64) at TP2 on sm90: 32 per rank, padded after sharding to the 64-wide tile.
    The padded rows/columns hold zeros, the rest is exactly this rank's slice of the reference weight."""
    from safetensors import safe_open

    from dsflash.build.engine import local_entry
    from dsflash.build.shard import plan_cut
    from dsflash.convert import layouts
    from dsflash.convert.writer import convert
    args = get_preset("v41", "tiny")
    hf = synthesize(args, tmp_path / "hf", seed=5)
    convert(hf, tmp_path / "hopper", "hopper", progress=False, log=lambda *a: None)
    out = write_engine(tmp_path / "hopper", tmp_path / "e", Mapping(world_size=2, tp_size=2), "sm90", BuildConfig(),
                       progress=False)
    eng = open_engine(out, check_arch=False)
    assert (eng.meta["expert_inter_local"], eng.meta["expert_inter_padded"]) == (32, 64)
    ck = HFCheckpoint(hf)
    table = {e.name: e for e in tensor_table(args)}
    for rank in range(2):
        m = eng.mapping(rank)
        with safe_open(str(eng.rank_file(rank)), framework="pt") as f:
            for name in ("layers.3.ffn.experts.5.w1.weight", "layers.3.ffn.experts.5.w2.weight"):
                e = table[name]
                cut = plan_cut(e, m, {"layers.3.ffn.experts": 8}, args.weight_block, 64)
                le = local_entry(e, cut)
                ours = {n: f.get_tensor(n) for n in layouts.stored_names(le, "hopper", "fp4", args)}
                got = layouts.dequantize(le, ours, "hopper", "fp4", args)
                full = ck.load(e)
                dim = 1 if name.endswith("w2.weight") else 0
                assert got.shape[dim] == 64
                assert torch.equal(got.narrow(dim, 0, 32), full.narrow(dim, 32 * rank, 32))
                assert torch.equal(got.narrow(dim, 32, 32), torch.zeros_like(got.narrow(dim, 32, 32)))


def test_speculative_defaults_are_recorded_and_checked(hf_v41, tmp_path):
    r = dsflash("build", "--ckpt", str(hf_v41), "--out", str(tmp_path / "x"), "--speculative-algorithm", "mtp",
                check=False)
    assert r.returncode != 0 and "mtp needs a V4 model with an MTP block (this is v41)" in r.stderr
    r = dsflash("build", "--ckpt", str(hf_v41), "--out", str(tmp_path / "x"), "--speculative-algorithm", "dspark",
                "--speculative-num-draft-tokens", "9", check=False)
    assert r.returncode != 0 and "must be in 1..5 for dspark" in r.stderr
    assert not (tmp_path / "x").exists()
    dsflash("build", "--ckpt", str(hf_v41), "--out", str(tmp_path / "e"), "--speculative-algorithm", "dspark",
            "--speculative-num-draft-tokens", "3")
    cfg = json.loads((tmp_path / "e" / "engine.json").read_text())["build_config"]
    assert cfg["speculative_algorithm"] == "dspark" and cfg["speculative_num_draft_tokens"] == 3
