"""The decode-slot kernels (rope, attention, index) inside a tiny V4.1 sm90 engine, run on the CPU through Triton's
interpreter. The registry sends CPU tensors to the references, so here the ops' eager entries are pointed at the
kernels themselves: the engine's own tensors (strided query views, the decode slots with their scratch slot, −1
top-k picks, open ratio-2 groups) reach the kernels, and the decode steps must come out as with the references.
Only under TRITON_INTERPRET=1 (`make test`); on a GPU, tests/kernels/test_engine_plugins.py covers the same ops."""
from __future__ import annotations

import pytest
import torch

from dsflash.build.engine import load_engine_model
from dsflash.plugins import refs
from dsflash.plugins.kernel_device import interpreting

pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(not interpreting() or torch.cuda.is_available(),
                                 reason="runs the kernels through Triton's interpreter on the CPU (TRITON_INTERPRET=1)")]

KERNELS = {"rope_quant": ("rope_quant", "rope_quant"), "slot_attention": ("slot_attention", "slot_attention"),
           "slot_index_scores": ("slot_index", "slot_index_scores")}


def _slot_kernels(ops) -> dict:
    """The decode-slot kernels of `ops` (names of `KERNELS`), which take their registry ops' arguments."""
    import importlib
    return {op: getattr(importlib.import_module(f"dsflash.plugins.{KERNELS[op][0]}"), KERNELS[op][1]) for op in ops}


def _site_err(out, want) -> float:
    """‖Δ‖/‖ref‖ of an op's output (the worst member of a tuple)."""
    outs, wants = (out, want) if isinstance(out, tuple) else ((out, ), (want, ))
    return max(refs.rel_err(o, w) for o, w in zip(outs, wants))


def _call_form(value) -> object:
    """What a kernel's code path can depend on: tensors by shape, strides and dtype, other arguments by value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_call_form(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _call_form(v)) for k, v in sorted(value.items()))
    return repr(value)


def _use_kernels(monkeypatch, kernels: dict, calls: dict[str, list], once_per_form: tuple[str, ...] = ()) -> None:
    """Point the registry's eager entries of `kernels` (op name -> a kernel taking the op's arguments) at the kernels;
    each call appends the kernel output's ‖Δ‖/‖ref‖ against the reference op on the same inputs to calls[op].
    Ops in once_per_form run their kernel on the first call of each form (`_call_form` of the arguments) and the
    reference on repeats, which later layers make with the same shapes (the interpreter takes seconds a call)."""
    from dsflash.plugins import registry
    seen: set = set()
    for op, kernel in kernels.items():
        ref = getattr(registry.eager_ops, op)

        def run(*args, kernel=kernel, ref=ref, op=op, **kw):
            if op in once_per_form:
                form = (op, _call_form(args), _call_form(kw))
                if form in seen:
                    return ref(*args, **kw)
                seen.add(form)
            out = kernel(*args, **kw)
            calls[op].append(_site_err(out, ref(*args, **kw)))
            return out
        monkeypatch.setattr(registry.eager_ops, op, run)


def _decode(model, steps: int = 6, prompts: tuple[int, ...] = (40, 3, 17)) -> list[torch.Tensor]:
    """Three requests (prompts 40, 3 and 17 tokens) prefilled, then `steps` decode steps in decode slots."""
    from dsflash.model_def.ragged import Chunk
    model.enable_decode_slots(3, 96)
    try:
        g = torch.Generator().manual_seed(9)
        states = [model.new_state(1) for _ in range(3)]
        model.step_chunks([Chunk(torch.randint(3, 900, (1, n), generator=g), s) for n, s in zip(prompts, states)])
        return [torch.cat(model.step_chunks([Chunk(torch.randint(3, 900, (1, 1), generator=g), s) for s in states]))
                for _ in range(steps)]
    finally:
        model.decode_slots = None


@pytest.fixture(scope="module")
def model(sm90_engine):
    model, eng = load_engine_model(sm90_engine, check_arch=False)
    assert {eng.meta["plugins"][op] for op in ("rope", "attention", "index")} == {"fused"}
    return model


def test_rope_and_index_kernels_give_the_reference_decode_steps(model, monkeypatch):
    """rope_quant is bit-exact, and the index scores pick the same top-k entries: the decode steps' logits are the
    references' bit for bit (through both ops' kernels in every prefill and decode step)."""
    want = _decode(model)
    calls = {"rope_quant": [], "slot_index_scores": []}
    _use_kernels(monkeypatch, _slot_kernels(calls), calls)
    got = _decode(model)
    n_idx = sum(1 for m in model.modules() if getattr(m, "indexer", None) is not None)
    assert len(calls["slot_index_scores"]) == 6 * n_idx and calls["rope_quant"]
    assert max(calls["rope_quant"]) == 0.0 and max(calls["slot_index_scores"]) <= 1e-5
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_attention_kernel_in_the_decode_slots(model, monkeypatch):
    """Each of the slot-attention kernel's calls (every layer, every decode step, the kernel's output driving the
    next) is within BF16 rounding flips of the reference on the same inputs. (Whole logits are not compared: in this
    tiny random model a 1e-3 change of the attention outputs moves the logits by 10-70 % through the FP4/FP8
    fake-quantization steps.)"""
    calls = {"slot_attention": []}
    _use_kernels(monkeypatch, _slot_kernels(calls), calls)
    _decode(model)
    errs = calls["slot_attention"]
    assert len(errs) == 6 * model.args.n_layers and max(errs) <= 1e-3, max(errs)


def _linear_kernel(x, w_q, w_s, w_bf16=None, act_block=32, w_s_t=None):
    """`fp8_linear` on the FP8 path with the arch-neutral default config (the sm90 default's Gluon and CUDA kernels
    need a GPU): the activation quantization kernel, then the Triton GEMM or GEMV."""
    from dsflash.plugins import tuning
    from dsflash.plugins.registry import fp8_linear_config
    n, k = w_q.shape
    return fp8_linear_config(x, w_q, w_s, tuning.default_config(n, k, x.shape[0], group=act_block), act_block)


def _moe_kernel(x, gate_w, gate_bias, topk, route_scale, w13_q, w13_s, w2_q, w2_s, swiglu_limit, inter, shared=None,
                gate_temp=1.0, expert_start=0, qblock=32, hash_ids=None):
    from dsflash.plugins.moe import moe
    return moe(x, gate_w, gate_bias, topk, route_scale, w13_q, w13_s, w2_q, w2_s, swiglu_limit, inter, shared,
               gate_temp, expert_start=expert_start, qblock=qblock, hash_ids=hash_ids)


def _mhc_kernels() -> dict:
    """The registry's mHC row ops this engine calls (their signatures) on the `plugins.mhc` kernels (the FP8-quantizing
    variants: tests/kernels/test_mhc.py). (Not the coefficients, `hc_mix`:
    the interpreter runs its 20 Sinkhorn iterations per token in numpy, ~0.5 s a call, 30 s for this test's steps;
    tests/kernels/test_mhc.py runs it at 1-64 tokens.)"""
    from dsflash.plugins import mhc
    return {"hc_pre": lambda X, pre, w, eps: mhc.hc_pre(X, pre, w, eps),
            "hc_post": lambda X, fx, post, comb: mhc.hc_post(X, fx, post, comb),
            "hc_post_pre": lambda X, fx, post, comb, npre, w, eps: mhc.hc_post(X, fx, post, comb, npre, w, eps)}


def test_gemm_moe_mhc_and_wo_a_kernels_in_the_engine_steps(model, monkeypatch):
    """The FP8 linears, the MoE (router, experts: the sorted path in the 17-token prefill, the decode GEMVs in the
    decode step), the mHC row kernels and WO-A, on the engine's own tensors through a prefill of three requests and
    a decode step: each kernel call within the GPU engine tests' site bound (1e-2) of the reference on the same inputs.
    The MoE runs its kernels in every layer (each layer routes its tokens its own way). The linears, mHC and WO-A,
    whose code paths depend only on shapes, strides, dtypes and flags, run theirs once per call form (each linear's
    in the prefill and in the decode step); later layers' repeats of a form run the reference."""
    from dsflash.plugins.wo_a import wo_a
    kernels = {"fp8_linear": _linear_kernel, "moe": _moe_kernel, "wo_a": wo_a, **_mhc_kernels()}
    errs: dict[str, list[float]] = {op: [] for op in kernels}
    _use_kernels(monkeypatch, kernels, errs, once_per_form=tuple(op for op in kernels if op != "moe"))
    _decode(model, steps=1, prompts=(9, 3, 5))
    called = {op: len(e) for op, e in errs.items()}
    assert min(called.values()) >= 2, called   # each op's kernel ran in the prefill and in the decode step
    assert called["moe"] == 2 * model.args.n_layers, called
    worst = {op: max(e) for op, e in errs.items() if e}
    assert max(worst.values()) <= 1e-2, worst
