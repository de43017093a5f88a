"""Model arguments for DeepSeek-V4.1-Flash and DeepSeek-V4-Flash.

Field names are the Hugging Face `config.json` keys (V4.1: the `text_config` section plus the top-level token ids
and `quantization_config`; V4: the flat legacy spellings such as `compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`, `rope_scaling`). `load_args` reads a checkpoint's config and picks the family from
`model_type`; unknown keys are kept in `extra` so nothing is silently lost.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

YARN_FULL = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}


class ConfigError(ValueError):
    """A config.json that does not describe a model this toolchain supports."""


# The file a model-args dataclass names in its own validation errors; `_build` puts the real path in its place.
POST_INIT_WHERE = "config.json"


def _require(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


@dataclass
class _CommonArgs:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = field(default_factory=lambda: dict(YARN_FULL))
    compress_ratios: list[int] = field(default_factory=list)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = None
    quantization_config: dict = field(default_factory=dict)
    torch_dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)

    family = "?"

    # -- derived helpers ---------------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def n_draft(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def yarn(self) -> dict | None:
        rs = self.rope_scaling
        if not rs or rs.get("type", rs.get("rope_type")) != "yarn":
            return None
        return rs

    @property
    def weight_block(self) -> int:
        return int(self.quantization_config.get("weight_block_size", [self.default_block] * 2)[0])

    @property
    def act_block(self) -> int:
        return self.weight_block

    default_block = 128

    def ratio(self, layer: int) -> int:
        """Compress ratio of layer `layer` (draft layers follow the main layers)."""
        if layer < len(self.compress_ratios):
            return int(self.compress_ratios[layer])
        return 0

    def replace(self, **kw) -> "_CommonArgs":
        return dataclasses.replace(copy.deepcopy(self), **kw)

    # -- validation --------------------------------------------------------------------------------------------
    def _validate_common(self, where: str) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "n_routed_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "index_n_heads", "index_head_dim"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v > 0, where, f"field '{name}' must be a positive integer, got {v!r}")
        _require(self.num_key_value_heads == 1, where,
                 f"field 'num_key_value_heads' must be 1 (single shared KV latent), got {self.num_key_value_heads}")
        _require(0 < self.qk_rope_head_dim <= self.head_dim and self.qk_rope_head_dim % 2 == 0, where,
                 f"field 'qk_rope_head_dim' must be even and <= head_dim ({self.head_dim}), got {self.qk_rope_head_dim}")
        _require(self.qk_rope_head_dim <= self.index_head_dim, where,
                 "field 'index_head_dim' must be >= qk_rope_head_dim")
        _require(self.num_attention_heads % self.o_groups == 0, where,
                 f"field 'o_groups' ({self.o_groups}) must divide num_attention_heads ({self.num_attention_heads})")
        _require(self.num_experts_per_tok <= self.n_routed_experts, where,
                 "field 'num_experts_per_tok' must be <= n_routed_experts")
        _require(self.scoring_func == "sqrtsoftplus", where,
                 f"field 'scoring_func' must be 'sqrtsoftplus', got {self.scoring_func!r}")
        _require(self.hidden_act == "silu", where, f"field 'hidden_act' must be 'silu', got {self.hidden_act!r}")
        _require(self.n_shared_experts == 1, where, "field 'n_shared_experts' must be 1")
        n_total = self.num_hidden_layers + self.num_nextn_predict_layers
        _require(len(self.compress_ratios) in (self.num_hidden_layers, n_total), where,
                 f"field 'compress_ratios' has {len(self.compress_ratios)} entries, expected "
                 f"{self.num_hidden_layers} or {n_total} (num_hidden_layers + num_nextn_predict_layers)")
        if self.yarn is not None:
            for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
                _require(k in self.yarn, where, f"field 'rope_scaling' (yarn) lacks '{k}'")


@dataclass
class V4Args(_CommonArgs):
    """DeepSeek-V4-Flash (`model_type: deepseek_v4`), flat HF config."""
    num_hash_layers: int = 3
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [4, 128] * 20 + [4] + [0])
    family = "v4"
    default_block = 128

    def __post_init__(self) -> None:
        where = POST_INIT_WHERE
        self._validate_common(where)
        for i, r in enumerate(self.compress_ratios):
            _require(r in (0, 4, 128), where, f"field 'compress_ratios'[{i}] = {r}: V4 supports 0, 4 and 128")
        _require(0 <= self.num_hash_layers <= self.num_hidden_layers, where, "field 'num_hash_layers' out of range")

    def to_hf_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d.update(self.extra)
        d.update(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4")
        return d


@dataclass
class V41Args(_CommonArgs):
    """DeepSeek-V4.1-Flash text model: `text_config` keys plus top-level token ids and quantization_config."""
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    q_lora_rank: int = 1280
    rms_norm_eps: float = 1e-20
    n_routed_experts: int = 384
    moe_intermediate_size: int = 2304
    index_n_heads: int = 32
    num_nextn_predict_layers: int = 3
    pad_token_id: int | None = 2
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    kv_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    gate_temp: float = 1.0
    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list[int] = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    image_token_id: int = 129264
    quantization_config: dict = field(default_factory=lambda: {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0", "expert_dtype": "fp4"})
    family = "v41"
    default_block = 32

    def __post_init__(self) -> None:
        where = f"{POST_INIT_WHERE} (text_config)"
        self._validate_common(where)
        L = self.num_hidden_layers
        for i, r in enumerate(self.compress_ratios):
            _require(r in (0, 1, 2), where, f"field 'compress_ratios'[{i}] = {r}: V4.1 supports 0, 1 and 2")
        srcs = self.kv_source_layer_ids
        _require(srcs == sorted(srcs) and all(0 <= s < L for s in srcs), where,
                 f"field 'kv_source_layer_ids' must be sorted layer ids < {L}, got {srcs}")
        for i in range(L):
            if self.ratio(i) > 0:
                _require(any(s <= i for s in srcs), where,
                         f"layer {i} has compress ratio {self.ratio(i)} but no kv source at or before it")
                src = self.kv_source_of(i)
                _require(self.ratio(src) == self.ratio(i), where,
                         f"layer {i} (ratio {self.ratio(i)}) reads kv source {src} of ratio {self.ratio(src)}")
        for s in srcs:
            _require(self.ratio(s) > 0, where, f"kv source layer {s} has compress ratio 0")
        idx = self.index_source_layer_ids
        _require(idx == sorted(idx) and all(self.ratio(i) > 0 for i in idx), where,
                 f"field 'index_source_layer_ids' must be sorted compressed layers, got {idx}")
        for i in range(L):
            if self.ratio(i) > 0:
                _require(any(s <= i for s in idx), where, f"compressed layer {i} has no index source at or before it")
        c = self.candidate_source_layer_id
        _require(c < 0 or c in idx, where, f"field 'candidate_source_layer_id' ({c}) must be an index source")
        _require(all(0 <= e < L for e in self.engram_layer_ids), where, "field 'engram_layer_ids' out of range")
        _require(len(self.engram_num_embeddings) == len(self.engram_layer_ids), where,
                 "fields 'engram_num_embeddings' and 'engram_layer_ids' differ in length")
        _require(all(0 <= t < L for t in self.dspark_target_layer_ids), where, "field 'dspark_target_layer_ids' out of range")
        _require(self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts, where,
                 "field 'dspark_num_experts_per_tok' must be <= dspark_n_routed_experts")

    def kv_source_of(self, layer: int) -> int:
        """The KV-source layer whose compressed cache layer `layer` reads (-1 for ratio-0 layers)."""
        if self.ratio(layer) == 0 or layer >= self.num_hidden_layers:
            return -1
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source_of(self, layer: int) -> int:
        """The index-source layer whose top-k layer `layer` reuses (-1 for ratio-0 layers)."""
        if self.ratio(layer) == 0 or layer >= self.num_hidden_layers:
            return -1
        return max(s for s in self.index_source_layer_ids if s <= layer)

    def to_hf_dict(self) -> dict:
        top_keys = {"bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "quantization_config",
                    "torch_dtype", "tie_word_embeddings"}
        text = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in top_keys and f.name != "extra"}
        text.update(model_type="deepseek_v41_text", eos_token_id=self.eos_token_id, bos_token_id=self.bos_token_id,
                    pad_token_id=self.pad_token_id)
        d = {k: getattr(self, k) for k in top_keys}
        d.update(self.extra)
        d.update(architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41", text_config=text)
        return d


ModelArgs = V4Args | V41Args
_FIELD_ALIASES = {"engram_pad_id": "engram_pad_token_id"}


def _build(cls, cfg: dict, where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    kw, extra = {}, {}
    for k, v in cfg.items():
        k = _FIELD_ALIASES.get(k, k)
        if k in names and k != "extra":
            kw[k] = v
        else:
            extra[k] = v
    if kw.get("pad_token_id") is None and cls is V41Args:
        kw.pop("pad_token_id", None)
    try:
        return cls(**kw, extra=extra)
    except TypeError as e:  # wrong value types surface here
        raise ConfigError(f"{where}: {e}") from None
    except ConfigError as e:  # __post_init__ knows the section, not the file: name the file the config came from
        msg = str(e)
        if msg.startswith(POST_INIT_WHERE):
            msg = where + msg[len(POST_INIT_WHERE):]
        raise ConfigError(msg) from None


def args_from_hf_dict(cfg: dict, where: str = "config.json") -> ModelArgs:
    """Build model args from a parsed HF config.json (either family)."""
    mt = cfg.get("model_type")
    if mt == "deepseek_v41":
        text = cfg.get("text_config")
        _require(isinstance(text, dict), where, "V4.1 config lacks the 'text_config' section")
        merged = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "architectures", "model_type")}
        merged.update({k: v for k, v in text.items() if k != "model_type"})
        for k in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
            if k in cfg and cfg[k] is not None:
                merged[k] = cfg[k]
        return _build(V41Args, merged, where)
    if mt == "deepseek_v4":
        return _build(V4Args, {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}, where)
    raise ConfigError(f"{where}: field 'model_type' is {mt!r}; expected 'deepseek_v41' (DeepSeek-V4.1-Flash) "
                      f"or 'deepseek_v4' (DeepSeek-V4-Flash)")


def load_args(src: str | Path | dict, family: str | None = None) -> ModelArgs:
    """Read model args from a checkpoint dir, a config.json path or a parsed dict; optionally require a family."""
    if isinstance(src, dict):
        args, where = args_from_hf_dict(src), "config"
    else:
        p = Path(src)
        path = p / "config.json" if p.is_dir() else p
        where = str(path)
        if not path.is_file():
            raise ConfigError(f"{where}: file not found (expected a Hugging Face config.json)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e})") from None
        if isinstance(cfg, dict) and "dsflash" in cfg and isinstance(cfg.get("model"), dict):
            cfg = cfg["model"]   # a `dsflash convert` output keeps the HF config under "model"
        args = args_from_hf_dict(cfg, where)
    if family is not None and args.family != family:
        raise ConfigError(f"{where}: checkpoint is family '{args.family}', expected '{family}'")
    return args


def override_args(args: ModelArgs, overrides: dict, where: str = "--json-model-override-args") -> ModelArgs:
    """`args` with some config fields replaced (SGLang's --json-model-override-args, vLLM's --hf-overrides), validated
    as a config.json would be. For shape studies on dummy weights, e.g. a full-width model with fewer layers."""
    _require(isinstance(overrides, dict), where, f"expected a JSON object of config fields, got {overrides!r}")
    names = {f.name for f in dataclasses.fields(type(args))} - {"extra"}
    unknown = sorted(set(overrides) - names)
    _require(not unknown, where, f"unknown {args.family} config field(s) {unknown}")
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(type(args))}
    kw.update(copy.deepcopy(overrides))
    return _build(type(args), {**kw.pop("extra"), **kw}, where)


# -- presets -------------------------------------------------------------------------------------------------------
def _tiny_v41(**kw) -> V41Args:
    base = dict(
        hidden_size=128, num_hidden_layers=10, num_attention_heads=4, head_dim=128, qk_rope_head_dim=32,
        q_lora_rank=64, o_groups=2, o_lora_rank=64, sliding_window=32,
        compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1] + [0, 0, 0],
        kv_source_layer_ids=[2, 4, 6], index_source_layer_ids=[2, 4, 6, 8], candidate_source_layer_id=6,
        candidate_topk_blocks=6, candidate_block_size=4, index_n_heads=4, index_head_dim=64, index_topk=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        engram_layer_ids=[1, 4], engram_vocab_size=1000, engram_n_heads=2, engram_head_dim=32,
        dspark_block_size=5, dspark_target_layer_ids=[7, 8, 9], dspark_markov_rank=32,
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, num_nextn_predict_layers=3,
    )
    base.update(kw)
    base.setdefault("engram_num_embeddings", [0] * len(base["engram_layer_ids"]))
    args = V41Args(**base)
    from dsflash.model_def.engram import engram_table_sizes  # table sizes follow from the prime search
    args.engram_num_embeddings = engram_table_sizes(args)
    return args


def _tiny_v4(**kw) -> V4Args:
    base = dict(
        hidden_size=128, num_hidden_layers=5, num_attention_heads=4, head_dim=128, qk_rope_head_dim=32,
        q_lora_rank=64, o_groups=2, o_lora_rank=64, sliding_window=32, compress_ratios=[0, 4, 128, 4, 128, 0],
        num_hash_layers=2, index_n_heads=4, index_head_dim=64, index_topk=16, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, num_nextn_predict_layers=1,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                             "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    )
    base.update(kw)
    return V4Args(**base)


def _full_v4() -> V4Args:
    return V4Args(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                       "activation_scheme": "dynamic", "weight_block_size": [128, 128]})


PRESETS = {
    ("v41", "full"): V41Args,
    ("v41", "tiny"): _tiny_v41,
    # wider tiny model: 8 heads, 4 output groups, window 64, more experts (TP2/EP2 friendly)
    ("v41", "tiny-wide"): lambda: _tiny_v41(hidden_size=256, num_attention_heads=8, o_groups=4, sliding_window=64,
                                            n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                                            q_lora_rank=128, index_n_heads=8),
    # mid-size V4.1 for the GPU plugin checks: kernel-relevant widths (D 1024, 32 experts of 512, 16 heads) at ~1 GB
    ("v41", "mid"): lambda: _tiny_v41(hidden_size=1024, num_attention_heads=16, o_groups=4, o_lora_rank=256,
                                      q_lora_rank=384, sliding_window=128, index_n_heads=16, index_topk=64,
                                      n_routed_experts=32, num_experts_per_tok=6, moe_intermediate_size=512,
                                      dspark_n_routed_experts=8, dspark_markov_rank=64),
    ("v4", "full"): _full_v4,
    ("v4", "tiny"): _tiny_v4,
    # second tiny V4: two SWA layers first (as the real schedule), wider dims, window 64, 3 hash layers
    ("v4", "tiny-b"): lambda: _tiny_v4(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, o_groups=4,
                                       sliding_window=64, compress_ratios=[0, 0, 4, 128, 4, 128, 0],
                                       num_hash_layers=3, n_routed_experts=16, num_experts_per_tok=4,
                                       moe_intermediate_size=96, q_lora_rank=96, index_n_heads=8),
}


def get_preset(family: str, name: str) -> ModelArgs:
    """A fresh copy of a named preset ('full', 'tiny', ...)."""
    try:
        make = PRESETS[(family, name)]
    except KeyError:
        names = sorted(f"{f}/{n}" for f, n in PRESETS)
        raise ConfigError(f"unknown preset {family}/{name}; available: {', '.join(names)}") from None
    return make()
