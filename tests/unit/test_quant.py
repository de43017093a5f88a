"""Quantization formats: hand-checked rounding, the power-of-two scale rule, and exact round trips."""
import pytest
import torch

from dsflash.model_def import quant as Q


def test_e2m1_ties_round_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 7.0, 0.26, 2.4])
    exp = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -4.0, 6.0, 0.5, 2.0])
    assert torch.equal(Q.round_e2m1(x), exp)


def test_e2m1_codes_count_the_midpoints_below():
    """The codes equal the definition (a comparison per midpoint, ties to the even code) on every midpoint, its
    float32 neighbours, the code values, ±0, saturation and random values."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    edges = torch.cat([mids, torch.nextafter(mids, torch.zeros(7)), torch.nextafter(mids, torch.full((7,), 9.0)),
                       torch.tensor([0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.5, 1e9, 1e-30])])
    x = torch.cat([edges, -edges, torch.randn(4000) * 3])
    a = x.abs().clamp(max=6.0)
    idx = torch.zeros(a.shape, dtype=torch.int32)
    for k, b in enumerate(mids.tolist()):
        idx += (a > b).to(torch.int32) + ((a == b) & (k % 2 == 1)).to(torch.int32)
    want = (idx + ((x < 0) & (idx > 0)).to(torch.int32) * 8).to(torch.uint8)
    assert torch.equal(Q.e2m1_code(x), want)
    assert torch.equal(Q.e2m1_code(x.double()), want) and torch.equal(Q.e2m1_code(x.bfloat16().double()),
                                                                      Q.e2m1_code(x.bfloat16()))


def test_pow2_scale_is_ceil_on_bit_pattern():
    amax = torch.tensor([448.0, 449.0, 224.0, 1.0, 0.0])
    s = Q.pow2_scale(amax, 448.0, 1e-4)
    # 448/448 = 1 -> 1; 449/448 just above 1 -> 2; 224/448 = .5 -> .5; 1/448 -> 2^-8; 0 -> min 1e-4/448 -> 2^-22
    assert s.tolist() == [1.0, 2.0, 0.5, 2.0 ** -8, 2.0 ** -22]


def test_fake_quant_fp8_block_hand_example():
    x = torch.tensor([[1.0, -3.0, 0.1, 2.0] * 8])  # one block of 32, amax 3 -> scale 2^-7 (3/448 < 2^-7)
    y = Q.fake_quant_fp8(x, 32)
    assert torch.equal(y, Q.round_e4m3(x / 2 ** -7) * 2 ** -7)
    assert torch.allclose(y, x, rtol=2 ** -3)


def test_fp4_pow2_and_e4m3scale():
    x = torch.linspace(-3, 3, 64).reshape(2, 32)
    y = Q.fake_quant_fp4_pow2(x, 32)
    s = Q.pow2_scale(x.abs().amax(-1, keepdim=True), 6.0, Q.FP4_POW2_MIN_AMAX)
    assert torch.equal(y, Q.round_e2m1(x / s) * s)
    z = Q.fake_quant_fp4_e4m3scale(x, 16)
    assert ((z.reshape(-1, 16).abs().amax(-1) - x.reshape(-1, 16).abs().amax(-1)).abs() < 0.3).all()


@pytest.mark.parametrize("shape,block", [((64, 96), 32), ((100, 70), 32), ((200, 130), 128)])
def test_fp8_block_round_trip(shape, block):
    w = torch.randn(shape) * 0.05
    q, s = Q.quant_fp8_block(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (-(-shape[0] // block), -(-shape[1] // block))
    d = Q.dequant_fp8_block(q, s, block)
    # dequantized values lie on the grid: requantizing reproduces them exactly (the scale may halve when the
    # block's amax rounded down onto qmax/2, so compare values, not bytes)
    assert torch.equal(Q.dequant_fp8_block(*Q.quant_fp8_block(d, block), block), d)
    assert ((d - w).norm() / w.norm()) < 0.05


def test_mxfp4_round_trip_and_nibble_order():
    w = torch.randn(8, 64)
    p, s = Q.quant_mxfp4(w)
    assert p.dtype == torch.int8 and p.shape == (8, 32) and s.shape == (8, 2)
    d = Q.dequant_mxfp4(p, s)
    codes = Q.unpack_fp4(p)
    assert torch.equal(codes[:, 0], p.view(torch.uint8)[:, 0] & 0xF)  # low nibble = even index
    assert torch.equal(Q.dequant_mxfp4(*Q.quant_mxfp4(d)), d)
    # hand example: one row [1.5, -6, 0, ...] with scale 1 -> codes 3 and 15 in the first byte
    row = torch.zeros(1, 32); row[0, 0], row[0, 1] = 1.5, -6.0
    pr, sr = Q.quant_mxfp4(row)
    assert pr.view(torch.uint8)[0, 0].item() == 3 | (15 << 4) and Q.e8m0_decode(sr).item() == 1.0


def test_fp8_rows32_round_trip():
    w = torch.randn(10, 64)
    q, s = Q.quant_fp8_rows32(w)
    d = Q.dequant_fp8_rows32(q, s)
    assert torch.equal(Q.dequant_fp8_rows32(*Q.quant_fp8_rows32(d)), d) and s.shape == (10, 2)


def test_bad_scale_shape_is_rejected():
    q, s = Q.quant_fp8_block(torch.randn(64, 64), 32)
    with pytest.raises(ValueError, match="scale shape"):
        Q.dequant_fp8_block(q, s[:1], 32)


def test_hadamard_orthonormal():
    x = torch.randn(3, 128)
    assert torch.allclose(Q.hadamard(Q.hadamard(x)), x, atol=1e-5)


def test_fake_quant_fp8_short_tail_block_equals_zero_padding():
    x = torch.randn(3, 96)
    padded = torch.nn.functional.pad(x, (0, 32))
    assert torch.equal(Q.fake_quant_fp8(x, 128), Q.fake_quant_fp8(padded, 128)[:, :96])
