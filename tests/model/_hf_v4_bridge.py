"""Bridge to transformers' DeepseekV4ForCausalLM: its config from our V4Args, its state dict from our tensor names.

Name mapping (ours = HF checkpoint keys -> transformers module names) mirrors transformers' own `deepseek_v4`
conversion mapping; routed experts are stacked into `gate_up_proj` [E, 2I, D] (w1 then w3) and `down_proj` [E, D, I].
MTP tensors have no transformers counterpart and are skipped.
"""
from __future__ import annotations

import contextlib
import re

import torch

from dsflash.model_def.config import V4Args

_LAYER_RENAMES = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
]
_TOP_RENAMES = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
                "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
                "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}


def hf_config(args: V4Args):
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(**args.to_hf_dict())
    cfg._attn_implementation = "eager"
    return cfg


def hf_state_dict(ours: dict[str, torch.Tensor], args: V4Args) -> dict[str, torch.Tensor]:
    """Our tensors (logical values, HF checkpoint names) -> transformers' DeepseekV4ForCausalLM state dict."""
    sd, experts = {}, {}
    layer_map = dict(_LAYER_RENAMES)
    for name, t in ours.items():
        if name in _TOP_RENAMES:
            sd[_TOP_RENAMES[name]] = t
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None:
            assert name.startswith("mtp."), name
            continue
        i, rest = int(m.group(1)), m.group(2)
        x = re.fullmatch(r"ffn\.experts\.(\d+)\.(w[123])\.weight", rest)
        if x:
            experts[(i, int(x.group(1)), x.group(2))] = t
            continue
        sd[f"model.layers.{i}.{layer_map[rest]}"] = t
    for i in range(args.n_layers):
        E = range(args.n_routed_experts)
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[(i, e, "w1")], experts[(i, e, "w3")]], 0) for e in E])
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([experts[(i, e, "w2")] for e in E])
    return sd


def build_hf_model(args: V4Args, ours: dict[str, torch.Tensor]):
    """transformers' DeepseekV4ForCausalLM in float32 (eval) holding exactly `ours` values; strict load."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hf_config(args)).float().eval()
    sd = {k: v.float() if v.is_floating_point() else v for k, v in hf_state_dict(ours, args).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    assert not missing and not unexpected, (missing[:5], unexpected[:5])
    return model


@contextlib.contextmanager
def stable_topk_ties():
    """Make `Tensor.topk` break exact ties toward the lower index, as our indexer does.

    transformers' indexer picks its top-k with `Tensor.topk`, whose order among exactly equal scores is
    implementation-defined. Exact ties are common in tiny models: the score Σ_h w_h·ReLU(q_h·k_t) is exactly 0
    whenever every index head's ReLU is 0 (1 in 16 entries with 4 heads). Only `Tensor.topk` (the indexer) is
    patched; the router calls `torch.topk` on continuous scores and is left alone."""
    orig = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        assert largest
        idx = self.argsort(dim=dim, descending=True, stable=True).narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, idx), idx))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = orig


@torch.no_grad()
def hf_chunked_logits(model, input_ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """transformers' own incremental path (DynamicCache with its V4 cache layers) fed in `chunks` -> [B,S,V]."""
    from transformers import DynamicCache

    cache, outs, p = DynamicCache(config=model.config), [], 0
    with stable_topk_ties():
        for c in chunks:
            out = model(input_ids=input_ids[:, p:p + c], past_key_values=cache, use_cache=True)
            outs.append(out.logits.float())
            cache, p = out.past_key_values, p + c
    return torch.cat(outs, 1)


@torch.no_grad()
def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Full forward without cache (transformers' stateless path) -> [B,S,V] fp32, indexer ties broken stably."""
    with stable_topk_ties():
        return model(input_ids=input_ids, use_cache=False).logits.float()
