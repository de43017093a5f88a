"""`dsflash convert` end to end: exact round trip per layout and expert dtype, atomic/resumable output, bad inputs,
and peak memory that does not grow with the number of layers."""
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsflash.convert import layouts as L
from dsflash.convert import writer
from dsflash.convert.cli import main as convert_main
from dsflash.convert.synth import TOKENIZER_FILES, synthesize, tokenizer_source_dir
from dsflash.model_def import get_preset
from dsflash.model_def.checkpoint import INDEX_FILE, HFCheckpoint
from dsflash.model_def.names import tensor_table
from dsflash.model_def.quant import dequant_mxfp4
from dsflash.serve.cli import main as dsflash_main

SHARD = "4MB"  # small shards so every checkpoint spans several


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {fam: synthesize(get_preset(fam, "tiny"), root / fam, seed=7, shard_bytes=16 << 20) for fam in ("v41", "v4")}


@pytest.fixture(scope="module")
def reference(hf):
    """Per family: (args, table, logical values via HFCheckpoint.load, HF tensors as stored)."""
    res = {}
    for fam, path in hf.items():
        ck = HFCheckpoint(path)
        table = tensor_table(ck.args)
        res[fam] = (ck.args, table, {e.name: ck.load(e) for e in table}, {n: ck.get(n) for n in ck.names()})
    return res


def run(*argv) -> int:
    return convert_main([*map(str, argv), "--no-progress", "--threads", "1"])


def load_dir(out: Path) -> tuple[dict, dict, dict]:
    manifest = json.loads((out / "manifest.json").read_text())
    tensors = {}
    for shard in sorted({t["shard"] for t in manifest["tensors"]}):
        with safe_open(str(out / shard), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return json.loads((out / "config.json").read_text()), manifest, tensors


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


@pytest.mark.parametrize("family", ["v41", "v4"])
@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("expert_dtype", L.EXPERT_DTYPES)
def test_round_trip_is_exact(hf, reference, tmp_path, family, layout, expert_dtype):
    out = tmp_path / "ck"
    assert run("--hf", hf[family], "--out", out, "--layout", layout, "--expert-dtype", expert_dtype,
               "--max-shard-size", SHARD) == 0
    args, table, logical, stored = reference[family]
    cfg, manifest, ours = load_dir(out)
    info = cfg["dsflash"]
    assert (info["layout"], info["expert_dtype"], info["weight_block"]) == (layout, expert_dtype, args.weight_block)
    assert info["source"]["path"] == str(hf[family].resolve())
    assert info["source"]["sha256"][INDEX_FILE] == hashlib.sha256((hf[family] / INDEX_FILE).read_bytes()).hexdigest()
    assert cfg["model"] == json.loads(json.dumps(args.to_hf_dict()))
    assert all((out / f).read_bytes() == (hf[family] / f).read_bytes() for f in TOKENIZER_FILES)
    assert not (tmp_path / "ck.partial").exists() and not (out / writer.PROGRESS_FILE).exists()
    assert len(manifest["shards"]) > 1
    rows = {r["name"]: r for r in manifest["tensors"]}
    assert set(rows) == set(ours)
    for name, t in ours.items():
        r = rows[name]
        assert r["shape"] == list(t.shape) and r["dtype"] == L.DTYPE_NAMES[t.dtype]
        assert r["sha256"] == hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
    n_cache = 0
    for e in table:
        assert torch.equal(L.dequantize(e, ours, layout, expert_dtype, args), logical[e.name]), e.name
        back = L.to_reference(e, ours, layout, expert_dtype, args)
        if e.role == "mxfp4" and expert_dtype == "fp8":
            assert torch.equal(dequant_mxfp4(back[e.name], back[e.scale_name]), logical[e.name])
        else:
            for n, t in back.items():
                assert t.dtype == stored[n].dtype and torch.equal(_bytes(t), _bytes(stored[n])), n
        if layout == "hopper" and L.bf16_cache_eligible(e, args):
            assert torch.equal(ours[L.name_of(e, "weight_bf16")].float(), logical[e.name])
            n_cache += 1
    if layout == "hopper":
        assert (n_cache > 0) == (family == "v41")


def test_dsflash_entry_point(hf, tmp_path, capsys):
    """`dsflash convert` dispatches here (`python -m dsflash.convert` runs in the peak-memory test)."""
    assert dsflash_main(["convert", "--hf", str(hf["v4"]), "--out", str(tmp_path / "a"), "--layout", "blackwell",
                         "--threads", "1", "--no-progress"]) == 0
    assert f"wrote {tmp_path / 'a'} (blackwell, experts fp4)" in capsys.readouterr().out


# -- bad inputs: one clear message, non-zero exit, no output that looks complete ---------------------------------------
def clone(src: Path, dst: Path) -> Path:
    """A checkpoint dir whose files are symlinks to `src`'s (edit a file by replacing its link)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    return dst


def replace_text(path: Path, text: str) -> None:
    path.unlink()
    path.write_text(text)


def expect_failure(capsys, tmp_path, src, *extra, layout="hopper") -> str:
    out = tmp_path / "out"
    rc = run("--hf", src, "--out", out, "--layout", layout, *extra)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert err.startswith("dsflash convert: error:") and len(err.splitlines()) == 1, err
    assert not out.exists()
    return err


def test_truncated_shard(hf, tmp_path, capsys):
    src = clone(hf["v4"], tmp_path / "hf")
    shard = sorted(src.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data[: len(data) - 1000])
    err = expect_failure(capsys, tmp_path, src)
    assert str(shard) in err and "truncated" in err


def test_missing_tensor(hf, tmp_path, capsys):
    src = clone(hf["v41"], tmp_path / "hf")
    index = json.loads((src / INDEX_FILE).read_text())
    del index["weight_map"]["layers.3.attn.wo_b.scale"]
    replace_text(src / INDEX_FILE, json.dumps(index))
    err = expect_failure(capsys, tmp_path, src)
    assert "'layers.3.attn.wo_b.scale' is missing" in err and INDEX_FILE in err


def test_wrong_family(hf, tmp_path, capsys):
    err = expect_failure(capsys, tmp_path, hf["v4"], "--family", "v41")
    assert "config.json" in err and "family 'v4', expected 'v41'" in err


def test_unsupported_model_type(hf, tmp_path, capsys):
    src = clone(hf["v4"], tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    replace_text(src / "config.json", json.dumps(cfg))
    err = expect_failure(capsys, tmp_path, src)
    assert "config.json" in err and "'deepseek_v3'" in err


def test_unknown_layout_and_expert_dtype(hf, tmp_path, capsys):
    err = expect_failure(capsys, tmp_path, hf["v4"], layout="ampere")
    assert "unknown layout 'ampere'" in err and "reference, hopper, blackwell" in err
    err = expect_failure(capsys, tmp_path, hf["v4"], "--expert-dtype", "int4")
    assert "unknown expert dtype 'int4'" in err


def test_existing_output_is_refused(hf, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert run("--hf", hf["v4"], "--out", tmp_path / "out", "--layout", "reference") == 1
    assert "already exists" in capsys.readouterr().err


def test_disk_full_then_resume(hf, reference, tmp_path, capsys, monkeypatch):
    """ENOSPC midway: clear error, `--out` absent, finished shards kept; the rerun reuses the ones that verify."""
    out, tmp = tmp_path / "out", tmp_path / ("out" + writer.PARTIAL_SUFFIX)
    real_put, calls = writer.ShardWriter._put, []

    def full_disk(self, name, chunks):
        calls.append(name)
        if len(calls) == 500:  # inside the third of eight shards
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_put(self, name, chunks)

    monkeypatch.setattr(writer.ShardWriter, "_put", full_disk)
    argv = ("--hf", hf["v41"], "--out", out, "--layout", "hopper", "--max-shard-size", SHARD)
    assert run(*argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err and f"'{calls[-1]}'" in err
    assert str(tmp) in err and not out.exists()
    finished = json.loads((tmp / writer.PROGRESS_FILE).read_text())["shards"]
    assert len(finished) >= 2
    first, second = sorted(finished)[:2]
    stamps = {f: (tmp / f).stat().st_mtime_ns for f in finished}
    with open(tmp / second, "r+b") as f:  # a finished shard that no longer verifies is written again
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))

    monkeypatch.setattr(writer.ShardWriter, "_put", real_put)
    assert run(*argv) == 0
    assert f"{len(finished) - 1} of " in capsys.readouterr().err
    assert not tmp.exists()
    assert (out / first).stat().st_mtime_ns == stamps[first]
    assert (out / second).stat().st_mtime_ns != stamps[second]
    args, table, logical, _ = reference["v41"]
    _, manifest, ours = load_dir(out)
    for f, sha in manifest["shards"].items():
        assert writer.sha256_file(out / f) == sha
    for e in table:
        assert torch.equal(L.dequantize(e, ours, "hopper", "fp4", args), logical[e.name]), e.name


# -- peak memory -------------------------------------------------------------------------------------------------------
def quick_checkpoint(args, out: Path, shard_bytes: int = 64 << 20) -> int:
    """An HF-format checkpoint of random bytes (no e4m3 NaN, e8m0 scales near 1), far faster than `synthesize` at sizes
    where tensors dominate memory. Returns its tensor bytes."""
    out.mkdir()
    rng = np.random.default_rng(0)
    shards, size, total = [{}], 0, 0
    for e in tensor_table(args):
        for name, (shape, dtype) in e.stored(args.weight_block).items():
            numel = int(np.prod(shape))
            if dtype == "I64":
                t = torch.from_numpy(rng.integers(0, args.n_routed_experts, shape, dtype=np.int64))
            elif dtype == "F8_E8M0":
                t = torch.from_numpy(rng.integers(110, 130, shape, dtype=np.uint8)).view(L.TORCH_DTYPES[dtype])
            else:  # raw bytes: convert copies or re-lays them without arithmetic (V4 has no BF16 cache)
                b = rng.integers(0, 256, numel * L.DTYPE_BYTES[dtype], dtype=np.uint8)
                if dtype == "F8_E4M3":
                    b[(b & 0x7F) == 0x7F] = 0
                t = torch.from_numpy(b).view(L.TORCH_DTYPES[dtype]).reshape(shape)
            nbytes = t.numel() * t.element_size()
            if size and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
            total += nbytes
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / fname))
        weight_map.update({k: fname for k in tensors})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(args.to_hf_dict()))
    for f in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_source_dir() / f, out / f)
    return total


def peak_rss_of_convert(src: Path, out: Path) -> int:
    """Peak RSS (bytes) of one `python -m dsflash.convert` run, from a fresh wrapper process's RUSAGE_CHILDREN."""
    code = ("import resource, subprocess, sys; "
            "r = subprocess.run([sys.executable, '-m', 'dsflash.convert', '--hf', sys.argv[1], '--out', sys.argv[2], "
            "'--layout', 'hopper', '--max-shard-size', '64MB', '--threads', '1', '--no-progress'], "
            "capture_output=True, text=True); "
            "assert r.returncode == 0, r.stderr; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True, check=True)
    return int(r.stdout.strip()) * 1024  # Linux reports KiB


def test_peak_rss_does_not_grow_with_layers(tmp_path):
    def args(n_layers):
        return get_preset("v4", "tiny").replace(
            num_hidden_layers=n_layers, compress_ratios=([0] + [4, 128] * 8)[:n_layers] + [0], num_hash_layers=1,
            vocab_size=2048, hidden_size=1024, moe_intermediate_size=1024, n_routed_experts=8)

    small = quick_checkpoint(args(2), tmp_path / "hf2")
    big = quick_checkpoint(args(8), tmp_path / "hf8")
    rss_small = peak_rss_of_convert(tmp_path / "hf2", tmp_path / "out2")
    rss_big = peak_rss_of_convert(tmp_path / "hf8", tmp_path / "out8")
    growth = big - small
    assert growth > 100e6, growth
    # four times more layers: the checkpoint grows by ~113 MB, peak RSS by (almost) nothing (measured: < 1 MB)
    assert rss_big - rss_small < 0.1 * growth, (rss_small, rss_big, growth)
