"""CSA2 pieces with hand-checkable expectations: pooling, visibility, top-k/candidate selection, cross-layer reuse,
`bias_vl` routing and the lagged mHC `pre` chain of DeepSeek-V4.1."""
import math

import pytest
import torch

from dsflash.convert.synth import synth_value
from dsflash.model_def import csa2
from dsflash.model_def.config import get_preset
from dsflash.model_def.layers import Numerics, hc_collapse, hc_expand, hc_mix
from dsflash.model_def.ragged import Ragged
from dsflash.model_def.v41 import ChunkContext, DeepseekV41Model, Gate, check_topology, tensor_table


@pytest.fixture(scope="module")
def model() -> DeepseekV41Model:
    """Tiny V4.1 with synthetic weights (fp64, so comparisons are not blurred by evaluation-order rounding)."""
    args = get_preset("v41", "tiny")
    m = DeepseekV41Model(args, Numerics("hf", args.act_block), dtype=torch.float64)
    params = dict(m.named_parameters())
    with torch.no_grad():
        for e in tensor_table(args):
            params[e.name].copy_(synth_value(e, args, 0))
    return m.eval()


# -- compressor ----------------------------------------------------------------------------------------------------
def test_pool_groups_softmax_gate_per_channel():
    kv = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]])
    gate = torch.zeros(1, 4, 2)
    gate[0, 1, 0] = math.log(3.0)  # group 0, channel 0: weights 1/4, 3/4; channel 1 equal
    out = csa2.pool_groups(kv, gate, 2)
    assert torch.allclose(out, torch.tensor([[[0.25 * 1 + 0.75 * 3, 3.0], [6.0, 7.0]]]))


def _compressor(ratio: int) -> csa2.Compressor:
    args = get_preset("v41", "tiny")
    c = csa2.Compressor(args, ratio, Numerics("hf", 32), torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in c.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return c


def _empty_cache(batch=1, dtype=torch.float64):
    args = get_preset("v41", "tiny")
    return csa2.SourceCache.empty(batch, args.head_dim, args.index_head_dim, dtype)


def test_ratio2_groups_complete_across_chunks():
    c = _compressor(2)
    x = torch.randn(1, 7, 128, dtype=torch.float64)
    whole = c(x, _empty_cache())
    assert whole.shape[1] == 3  # 7 tokens -> groups (0,1) (2,3) (4,5); token 6 waits
    cache = _empty_cache()
    parts = [c(x[:, :3], cache)]
    assert parts[0].shape[1] == 1 and cache.buf_kv.shape[1] == 1  # token 2 is buffered in fp32
    parts.append(c(x[:, 3:4], cache))  # completes group (2,3)
    assert parts[1].shape[1] == 1 and cache.buf_kv.shape[1] == 0
    parts.append(c(x[:, 4:], cache))
    assert torch.allclose(torch.cat(parts, 1), whole, atol=1e-12)
    # the latent is norm(pool(wkv x, wgate x)) of the two tokens
    kv, gate = x[:, 2:4] @ c.wkv.weight.T, x[:, 2:4] @ c.wgate.weight.T
    ref = c.norm(csa2.pool_groups(kv, gate, 2))
    assert torch.allclose(whole[:, 1], ref[:, 0], atol=1e-12)


def test_ratio1_is_per_token_pass_through():
    c = _compressor(1)
    assert c.wgate is None
    x = torch.randn(2, 5, 128, dtype=torch.float64)
    cache = _empty_cache(2)
    out = c(x, cache)
    assert out.shape == (2, 5, get_preset("v41", "tiny").head_dim) and cache.buf_kv.shape[1] == 0
    assert torch.allclose(out, c.norm(x @ c.wkv.weight.T), atol=1e-12)


# -- selection -----------------------------------------------------------------------------------------------------
def test_visibility_needs_the_whole_group():
    pos = torch.arange(8)
    assert csa2.visible_counts(pos, 2).tolist() == [0, 1, 1, 2, 2, 3, 3, 4]  # t < (pos + 1) // 2
    assert csa2.visible_counts(pos, 1).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]  # ratio 1 includes the current token


def test_topk_indices_pads_with_minus_one_and_breaks_ties_low():
    inf = float("-inf")
    s = torch.tensor([[0.5, inf, 2.0, 0.5, inf]])
    assert csa2.topk_indices(s, 4).tolist() == [[2, 0, 3, -1]]       # only 3 reachable entries
    assert csa2.topk_indices(s, 7).tolist() == [[2, 0, 3, -1, -1, -1, -1]]  # k beyond T
    assert csa2.topk_indices(torch.zeros(1, 0), 3).tolist() == [[-1, -1, -1]]
    assert csa2.indices_to_mask(torch.tensor([[2, 0, -1]]), 4).tolist() == [[True, False, True, False]]


def test_candidate_blocks_pin_the_newest_block():
    inf = float("-inf")
    # 10 entries, blocks of 4: [0..3] [4..7] [8, 9]; entry 9 is not visible yet (9 visible entries)
    s = torch.tensor([[[5.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.1, inf]]])
    counts = torch.tensor([[9]])
    one = csa2.select_candidate_blocks(s, counts, 1, 4)
    assert one[0, 0].tolist() == [False] * 8 + [True, True]          # block 2 (newest) pinned over block 0's 5.0
    two = csa2.select_candidate_blocks(s, counts, 2, 4)
    assert two[0, 0].tolist() == [True] * 4 + [False] * 4 + [True, True]
    # nothing visible: no pin, no -inf block kept
    none = csa2.select_candidate_blocks(torch.full((1, 1, 10), inf), torch.tensor([[0]]), 2, 4)
    assert not none.any()


# -- cross-layer reuse ---------------------------------------------------------------------------------------------
def test_only_kv_sources_own_compressors_and_layers_read_their_source(model):
    m = model
    a = m.args
    for layer in m.layers:
        at = layer.attn
        assert (at.compressor is not None) == (layer.layer in a.kv_source_layer_ids)
        assert (at.indexer is not None) == (layer.layer in a.index_source_layer_ids)
        assert (at.indexer is not None and at.indexer.owns_k) == (layer.layer in a.kv_source_layer_ids)
    assert [m.layers[i].attn.kv_source for i in range(10)] == [-1, -1, 2, 2, 4, 4, 6, 6, 6, 6]
    assert [m.layers[i].attn.index_source for i in range(10)] == [-1, -1, 2, 2, 4, 4, 6, 6, 8, 8]
    state = m.new_state(1)
    m.step(torch.randint(0, a.vocab_size, (1, 11)), state)
    assert sorted(state.sources) == a.kv_source_layer_ids
    assert [state.sources[s].count for s in (2, 4, 6)] == [5, 5, 11]  # 11 // 2 groups, ratio 1: every token
    assert state.sources[2].buf_kv.shape[1] == 1 and state.sources[6].buf_kv.shape[1] == 0


def test_consumer_layer_attends_to_the_selected_entries_of_its_source(model):
    m = model
    a = m.args
    attn = m.layers[3].attn  # ratio 2, reads kv source 2 and reuses index source 2's top-k
    state = m.new_state(1)
    state.pos = 20
    state.window[3] = torch.randn(1, 5, a.head_dim, dtype=torch.float64)  # positions 15..19
    cache = state.sources[2]
    cache.kv = torch.randn(1, 10, a.head_dim, dtype=torch.float64)
    pos = torch.tensor([[20]])
    sel = torch.full((1, 1, a.index_topk), -1)
    sel[0, 0, :3] = torch.tensor([7, 1, 4])
    x = torch.randn(1, 1, a.hidden_size, dtype=torch.float64)

    def run():
        s0 = state.window[3]
        y = attn(x, [ChunkContext(state, 20, pos, {2: sel})], Ragged([(1, 1)], [20]))
        state.window[3] = s0  # undo the window append of this probe
        return y

    base = run()
    cache.kv[0, 5] += 1.0   # not selected: no effect
    assert torch.equal(run(), base)
    cache.kv[0, 4] += 1.0   # selected: changes the output
    assert not torch.allclose(run(), base)


def test_check_topology_rejects_unusable_wiring():
    bad = get_preset("v41", "tiny").replace(index_source_layer_ids=[2, 6, 8])  # source 4 would own no `wk`
    with pytest.raises(ValueError, match="kv source layer 4"):
        check_topology(bad)


# -- MoE routing ---------------------------------------------------------------------------------------------------
def test_bias_vl_changes_selection_only_for_image_tokens():
    args = get_preset("v41", "tiny").replace(num_experts_per_tok=1, n_routed_experts=3)
    g = Gate(args, 3, 1, torch.float32)
    with torch.no_grad():
        g.weight.zero_()
        g.weight[0, 0], g.weight[1, 1], g.weight[2, 2] = 1.0, 0.5, 0.0
        g.bias.copy_(torch.tensor([0.0, 10.0, 0.0]))     # text: expert 1
        g.bias_vl.copy_(torch.tensor([0.0, 0.0, 10.0]))  # image: expert 2
    x = torch.zeros(3, args.hidden_size)
    x[:, 0], x[:, 1] = 2.0, 1.0
    mask = torch.tensor([False, True, False])
    w_t, i_t = g(x)
    w_i, i_i = g(x, mask)
    assert i_t.flatten().tolist() == [1, 1, 1]
    assert i_i.flatten().tolist() == [1, 2, 1]
    # weights are the unbiased scores sqrt(softplus(x·w)) (top-1: no renormalisation) times routed_scaling_factor
    s = torch.sqrt(torch.nn.functional.softplus(x @ g.weight.T))
    assert torch.allclose(w_i, s.gather(1, i_i) * args.routed_scaling_factor)
    g.topk = 2
    w2, i2 = g(x, mask)
    exp = s.gather(1, i2)
    exp = exp / (exp.sum(-1, keepdim=True) + 1e-20) * args.routed_scaling_factor
    assert torch.allclose(w2, exp)


# -- lagged mHC ----------------------------------------------------------------------------------------------------
def test_lagged_pre_chain(model):
    m = model
    n = m.args.hc_mult
    rec, handles = {}, []

    def keep(name, what="in"):
        def hook(mod, args, out):
            rec.setdefault(name, []).append(args if what == "in" else out)
        return hook

    def spy(blk, method, record):
        """A forward enters a block at `open_attn` (X, pre) and leaves it at `close_attn` (site, the attention's
        output) -> (X', pre'): record each call's (args, out)."""
        def wrapped(*args):
            out = getattr(type(blk), method)(blk, *args)
            record(args, out)
            return out
        setattr(blk, method, wrapped)

    for i, blk in enumerate(m.layers):
        spy(blk, "open_attn", lambda a, o, i=i: rec.setdefault(f"block{i}", []).append(a))
        spy(blk, "close_attn", lambda a, o, i=i: (rec.setdefault(f"block{i}.out", []).append(o),
                                                 rec.setdefault(f"attn{i}.out", []).append(a[1])))
        handles += [blk.attn_norm.register_forward_hook(keep(f"attn_norm{i}")),
                    blk.ffn_norm.register_forward_hook(keep(f"ffn_norm{i}"))]
    handles.append(m.norm.register_forward_hook(keep("norm")))
    ids = torch.randint(0, m.args.vocab_size, (1, 6))
    try:
        m.logits(ids)
    finally:
        for h in handles:
            h.remove()
        for blk in m.layers:
            del blk.open_attn, blk.close_attn

    X0, pre0 = rec["block0"][0][:2]
    assert torch.equal(pre0, torch.eye(n, dtype=pre0.dtype)[0].expand_as(pre0))         # first collapse one-hot
    assert torch.equal(rec["attn_norm0"][0][0], m.embed(ids))                           # = the embedding itself
    for i, blk in enumerate(m.layers):
        X, pre = rec[f"block{i}"][0][:2]
        assert torch.allclose(rec[f"attn_norm{i}"][0][0], hc_collapse(X, pre))           # collapse with incoming pre
        a_pre, a_post, a_comb = hc_mix(X.flatten(-2), blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale, n,
                                       m.args.hc_sinkhorn_iters, m.args.hc_eps, m.args.rms_norm_eps)
        X_mid = hc_expand(X, rec[f"attn{i}.out"][0], a_post, a_comb)
        assert torch.allclose(rec[f"ffn_norm{i}"][0][0], hc_collapse(X_mid, a_pre))     # FFN uses the attn site's pre
        f_pre = hc_mix(X_mid.flatten(-2), blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale, n,
                       m.args.hc_sinkhorn_iters, m.args.hc_eps, m.args.rms_norm_eps)[0]
        X_out, pre_out = rec[f"block{i}.out"][0]
        assert torch.allclose(pre_out, f_pre)
        if i + 1 < len(m.layers):
            assert torch.equal(rec[f"block{i + 1}"][0][1], pre_out)                     # next block's attn collapse
    X_last, pre_last = rec[f"block{len(m.layers) - 1}.out"][0]
    assert torch.allclose(rec["norm"][0][0], hc_collapse(X_last, pre_last))              # final collapse, no hc_head
