"""Checkpoint reading: every role dequantizes exactly, and each bad input fails with one message naming file and tensor."""
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsflash.convert.synth import encode, synth_value
from dsflash.model_def.checkpoint import CheckpointError, HFCheckpoint
from dsflash.model_def.config import get_preset
from dsflash.model_def.names import TensorEntry

TABLE = [
    TensorEntry("embed.weight", (64, 32), "bf16", "embed"),
    TensorEntry("layers.0.hc_attn_fn", (24, 128), "f32", "hc_fn"),
    TensorEntry("layers.0.attn.wq_a.weight", (40, 70), "fp8_block", "linear"),  # ragged 32x32 edges
    TensorEntry("layers.0.ffn.experts.0.w1.weight", (48, 64), "mxfp4", "linear"),
    TensorEntry("layers.1.engram.embed.weight", (10, 64), "fp8_rows32", "embed"),
    TensorEntry("layers.0.ffn.gate.tid2eid", (64, 2), "i64", "tid2eid"),
]


def write_ckpt(path: Path, table=TABLE, family="v41", shards=2) -> dict[str, torch.Tensor]:
    args = get_preset(family, "tiny")
    path.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for e in table:
        tensors.update(encode(e, synth_value(e, args, seed=1), args))
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = {k: tensors[k] for k in names[i::shards]}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(path / fname))
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(args.to_hf_dict()))
    return tensors


def test_roles_load_to_logical_values(tmp_path):
    write_ckpt(tmp_path / "c")
    ck = HFCheckpoint(tmp_path / "c")
    ck.validate(TABLE)
    args = get_preset("v41", "tiny")
    for e in TABLE:
        v = ck.load(e)
        assert tuple(v.shape) == e.shape
        ref = synth_value(e, args, seed=1)
        if e.role == "i64":
            assert torch.equal(v, ref)
        else:  # only the role's quantization error (FP4 experts are the coarsest)
            assert v.dtype == torch.float32
            assert (v - ref.float()).norm() / ref.float().norm() < (0.15 if e.role == "mxfp4" else 0.04)


def test_truncated_shard(tmp_path):
    write_ckpt(tmp_path / "c")
    shard = tmp_path / "c" / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: truncated"):
        HFCheckpoint(tmp_path / "c").validate(TABLE)


def test_missing_shard(tmp_path):
    write_ckpt(tmp_path / "c")
    (tmp_path / "c" / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: shard file is missing"):
        HFCheckpoint(tmp_path / "c").validate(TABLE)


def test_missing_tensor(tmp_path):
    write_ckpt(tmp_path / "c", table=TABLE[:-1])
    with pytest.raises(CheckpointError, match=r"index\.json: tensor 'layers\.0\.ffn\.gate\.tid2eid' is missing"):
        HFCheckpoint(tmp_path / "c").validate(TABLE)


def test_unexpected_tensor(tmp_path):
    write_ckpt(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.0\.ffn\.gate\.tid2eid'"):
        HFCheckpoint(tmp_path / "c").validate(TABLE[:-1])


def test_vision_tensors_are_ignored(tmp_path):
    write_ckpt(tmp_path / "c", table=TABLE + [TensorEntry("vision.patch_embed.weight", (8, 8), "bf16")])
    HFCheckpoint(tmp_path / "c").validate(TABLE)


def test_wrong_dtype(tmp_path):
    bad = [TensorEntry("embed.weight", (64, 32), "f32", "embed")] + TABLE[1:]
    write_ckpt(tmp_path / "c", table=bad)
    with pytest.raises(CheckpointError, match=r"safetensors: tensor 'embed\.weight' has dtype F32, expected BF16"):
        HFCheckpoint(tmp_path / "c").validate(TABLE)


def test_wrong_shape(tmp_path):
    bad = [TensorEntry("embed.weight", (64, 33), "bf16", "embed")] + TABLE[1:]
    write_ckpt(tmp_path / "c", table=bad)
    with pytest.raises(CheckpointError, match=r"tensor 'embed\.weight' has shape \[64, 33\], expected \[64, 32\]"):
        HFCheckpoint(tmp_path / "c").validate(TABLE)


def test_wrong_family(tmp_path):
    write_ckpt(tmp_path / "c", family="v4")
    with pytest.raises(CheckpointError, match=r"config\.json: checkpoint is family 'v4', expected 'v41'"):
        HFCheckpoint(tmp_path / "c", family="v41")


def test_unknown_model_type(tmp_path):
    write_ckpt(tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: field 'model_type' is 'llama'"):
        HFCheckpoint(tmp_path / "c")


def test_bad_config_field(tmp_path):
    write_ckpt(tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["text_config"]["compress_ratios"][3] = 4
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    where = re.escape(str(tmp_path / "c" / "config.json"))   # the file is named, with the section
    with pytest.raises(CheckpointError, match=rf"^{where} \(text_config\): field 'compress_ratios'\[3\] = 4: "
                                              r"V4.1 supports 0, 1 and 2"):
        HFCheckpoint(tmp_path / "c")


def test_dsflash_outputs_are_not_taken_for_hf_checkpoints(tmp_path):
    """A convert output or an engine dir given where an HF checkpoint belongs is named for what it is (its
    config.json would otherwise fail with a misleading 'model_type is None'); load_args still reads a convert
    output's model config (prepare-dataset --tokenizer CKPT)."""
    from dsflash.model_def.config import load_args
    write_ckpt(tmp_path / "c")
    hf_cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({"dsflash": {"layout": "hopper"}, "model": hf_cfg}))
    with pytest.raises(CheckpointError, match=r"a `dsflash convert` output \(layout hopper\), not a Hugging Face "
                                              r"checkpoint \(`dsflash build --ckpt"):
        HFCheckpoint(tmp_path / "c")
    assert load_args(tmp_path / "c").hidden_size == hf_cfg["text_config"]["hidden_size"]
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "engine.json").write_text("{}")
    with pytest.raises(CheckpointError, match="a dsflash engine directory, not a Hugging Face checkpoint"):
        HFCheckpoint(tmp_path / "e")
