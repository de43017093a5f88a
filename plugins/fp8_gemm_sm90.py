"""Group-32 FP8 GEMM for large M as a hand-written CUDA kernel on Hopper wgmma (sm_90a), compiled at run time.

y[m, n] = Σ_kb (A_q[m, kb]·W_q[n, kb]ᵀ)·sa[m, kb]·sw[n/32, kb], fp32 promotion every 32 K: the contract and numerics
of `fp8_gemm._fp8_gemm_g32_kernel` (the same m64nNk32 e4m3 MMAs, one FFMA per accumulator element and 32 K).

A build candidate (`tuning.SM90_SPACE`, the sm90 default for M > 64; `fp8_gemm_sm90_config`) in its
warp-specialized TMA form; the other forms are the measured steps to it (benchmarks/README.md, "Session 23",
"Session 24"), kept for `benchmarks/gemm_sm90.py`, with an offline build check (no spills, no serialised wgmma) and a
GPU parity test. Structure:
- each warpgroup keeps `depth` MMA partials: the MMA of K block t + 1 runs while block t is folded
  (wgmma.wait_group depth - 1); with `split` 2 a K block is two 64-wide MMAs into half-width partials, so at the
  same registers (four halves) three half MMAs run during each half fold; the K loop is generated straight-line
  (`_main_loop`);
- the scales come in fp32 (A per 1×32, from `act_quant(x, "fp32")`; W per 32×32, `weight_scales_f32`) in the same
  ring slot as the tiles, read one K block ahead, so a fold's scale product is one FMUL per (row, column block)
  (`ps`, measured and slower: the producer's other warps write those products into the slot instead);
- the ring is filled by TMA: by a producer warpgroup (`ws`: one thread, 40 registers, waits for each slot's
  "empty" mbarrier; the consumers take 232 registers and wait only for "full" ones), or by one consumer thread
  (`tma`: one CTA barrier per stage); or by every thread's cp.async into the 128-byte swizzle wgmma reads (one CTA
  barrier per 128-K stage);
- with `body` a multiple of the ring size every K block's slot is a constant, so its wgmma descriptors are an add
  of an immediate to two uniform registers (84 instructions per warp and K block against 98: 64 of them FFMA);
- `cluster` 2 / 4 (measured, not a build candidate: no faster, session 26): thread-block clusters of that many row
  tiles, each CTA's producer loading a share of the common W tile that TMA multicasts into every CTA's slot; each
  consumer warp hands a slot back to every CTA of the cluster.
- 192- and 256-wide tiles (128 rows, session 27; 256 wide a build candidate) land half the operand bytes per MMA
  flop of the 64 × 128 pair; their MMAs split in 64- or 96-wide units so two partials fit beside the accumulator
  (`tuning.sm90_depth`); three consumer warpgroups (192 rows, 152 registers each) are a measured variant.
Tile: BM = 64·WGS rows (one consumer warpgroup per 64), BN columns (64/96/128/192/256), 128 K per ring slot, STAGES
slots; with a producer, one CTA per SM or (`ctas` 2, one consumer warpgroup) two. Compiled by NVRTC
(`torch.cuda._utils._nvrtc_compile`, sm_90a; nvcc where torch has no NVRTC) once per configuration and process;
launched with cuLaunchKernel (cuLaunchKernelEx with clusters) on the current stream (no host sync; the TMA
descriptors are kernel parameters, encoded on the host per call).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from dsflash.plugins.refs import E4M3, QBLOCK, scale_to_fp32
from dsflash.plugins.tuning import sm90_depth

BLOCK_K = 128   # K per ring slot: 4 MMAs of k32, 4 promotions


def _wgmma_asm(name: str = "mma_fresh", scale_d: int = 0, n: int = 128) -> str:
    """The m64{n}k32 e4m3 MMA as an inline-asm function: into a fresh partial (scale-d = 0) or accumulating
    (scale-d = 1). The registers are an in-out operand so they stay put from one MMA to the next (no copies while an
    MMA is in flight)."""
    r = n // 2
    regs = ", ".join(f"%{i}" for i in range(r))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(r))
    head = f"__device__ __forceinline__ void {name}(float (&d)[{r}], unsigned long long da, unsigned long long db) {{\n"
    return (head
            + f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"\n'
            + f'    "wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{regs}}}, %{r}, %{r + 1}, p, 1, 1;\\n}}\\n"\n'
            + f"    : {outs}\n"
            + f'    : "l"(da), "l"(db), "r"({scale_d}));\n'
            + "}\n")


def _main_loop(depth: int, body: int, stages: int, ws: bool = False, split: int = 1, ps: bool = False,
               bn: int = 128, no_mma: bool = False) -> str:
    """The K loop, generated straight-line: `body` stages (4 K blocks each) per iteration, `depth` partials p0.. in
    rotation. With split 2 (4) a K block is two (four) MMA units, its W tile's column halves (quarters), each into a
    partial that narrow; else one. Unit u is folded after unit u + depth - 1 was issued, so depth - 1 MMAs run
    during every fold but the last few of an iteration: none may still be in flight at the back edge (ptxas would
    serialise every wgmma, C7514).
    A stage's first MMA waits for the stage (`next_stage`: its data, then one CTA barrier); the wait for the next
    iteration's first stage is taken while this one's last MMAs run. Block t + 1's scales are read before block t's
    first wait and fold, or, where block t + 1 opens a stage whose wait comes later (depth <= split), right after
    that wait. With body a multiple of `stages` every iteration starts on slot 0, so each block's slot is a
    constant (its descriptors one add of an immediate); the stages left over run one per iteration.
    ps (scale products from the producer): each unit reads its own products, one unit ahead with split 2, else just
    before its wait (one set of 8 live registers: two would not fit next to the partials).
    ws (a producer warpgroup fills the ring): a stage's first MMA only waits for its data (`stage_ready`), and the
    slot is handed back (`release`) once the stage's last MMA completed.
    no_mma (the NO_MMA timing probe): the loop keeps its waits and hand-backs and drops its MMAs and folds, so it
    times the ring's loads alone."""
    static = body % stages == 0
    wait = (lambda j: f"stage_ready(g, {j});") if ws else (lambda j: f"next_stage(g, ring, {j}, n_st, tid);")
    per_stage = 4 * split   # MMA units per stage

    def code(n_st: int, last: bool, fixed: bool) -> list[str]:
        n_u = per_stage * n_st
        slot = (lambda t: f"{(t // 4) % stages}") if fixed else (lambda t: f"(s + {t // 4}) % STAGES")
        blk = lambda t: f"block_at(r, {slot(t)}, {t % 4})"
        issue = lambda u: f"issue<{u % split}>(p{u % depth}, {blk(u // split)});"
        out = [issue(u) for u in range(min(depth - 1, n_u))]
        # block b's scales are read during block b - 1 (its first unit), but never before the wait for b's stage:
        # with depth <= split that wait comes later, in the iteration that issues b's first MMA
        read_at = {}
        for b in range(1, 4 * n_st):
            u_read = (b - 1) * split
            if b % 4 == 0:
                u_read = max(u_read, b * split - (depth - 1))
            read_at.setdefault(u_read, []).append(b)
        nb = bn // 32 // split
        prod = lambda u: f"{blk(u // split)}.sa + {(u % split) * nb * 4}"
        if not ps:
            out.append(f"Scales c1, c0 = scales_of({blk(0)}.sa, {blk(0)}.sw);")
        elif split == 2:
            out.append(f"Scales c1, c0 = scales_of({prod(0)}, 0);")
        for u in range(n_u):
            t, h = divmod(u, split)
            v = u + depth - 1
            if v < n_u:
                if v % per_stage == 0:
                    out.append(wait(f"s + {v // per_stage}"))
                out.append(issue(v))
                if v == n_u - 1 and not last:
                    out.append(f"if (s + {n_st} < n_st) {wait(f's + {n_st}')}")
            if not ps:
                for b in read_at.get(u, []):
                    out.append(f"{{ const Block b = {blk(b)}; c{b % 2} = scales_of(b.sa, b.sw); }}")
            elif split == 2 and u + 1 < n_u:
                out.append(f"c{(u + 1) % 2} = scales_of({prod(u + 1)}, 0);")
            elif split == 1:
                out.append(f"const Scales c{u} = scales_of({prod(u)}, 0);")
            out.append(f"mma_wait<{min(depth - 1, n_u - 1 - u)}>();")
            if ws and u % per_stage == per_stage - 1:
                out.append(f"release(g, {slot(t)});")
            c = f"c{u}" if ps and split == 1 else f"c{u % 2}" if ps else f"c{t % 2}"
            out.append(f"fold<{h}>(acc, p{u % depth}, {c});")
        if no_mma:
            out = [line for line in out if not line.startswith(("issue<", "mma_wait<", "fold<"))]
        return out
    ind = "\n    "
    loop = lambda n, fixed: (f"  for (; s + {n} <= n_st; s += {n}) {{{ind}" + ind.join(code(n, False, fixed))
                             + "\n  }")
    src = ["  int s = 0;", loop(body, static)]
    if static:
        src.append(loop(1, False))
    elif body > 1:
        src.append("  switch (n_st - s) {")
        for r in range(1, body):
            src.append(f"  case {r}: {{{ind}" + ind.join(code(r, True, False)) + f"{ind}break;\n  }}")
        src.append("  default: break;\n  }")
    return "\n".join(src) + "\n"


_PTX_HELPERS = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ void cp16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp4(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void mma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void mma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void mma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
__device__ __forceinline__ float lds(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void lds4(u32 addr, float (&v)[4]) {
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "r"(addr));
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// K-major operand tile, rows of 128 bytes in the 128-byte swizzle (8-row atoms of 1024 bytes).
__device__ __forceinline__ u64 desc_sw128(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

"""

_SOURCE = r"""
#define BM (64 * WGS)
#define PR (BN / 2)   // fp32 registers per thread of an m64 x BN accumulator
#define PU (PR / SPLIT)   // of an MMA unit's partial (m64 x BN/SPLIT)
#define BK 128
#define NT (128 * (WGS + WS))   // WS: + a producer warpgroup
// with a producer warpgroup: its registers and the consumers' (all of a CTA's share of the 64K-register file)
#define PRODUCER_REGS 40
#define CONSUMER_FIT (((65536 / CTAS - 128 * PRODUCER_REGS) / (128 * WGS)) / 8 * 8)
#define CONSUMER_REGS (CONSUMER_FIT > 232 ? 232 : CONSUMER_FIT)
#define SLOT_A (BM * BK)
#define SLOT_W (BN * BK)
#define SLOT_SA (BM * 16)
// W scales per slot: [4 K blocks][SW_ROW / 4 column blocks]. TMA boxes start on 16-byte aligned columns: a 128-wide
// tile's 4 column blocks are one aligned box row; a narrower tile's (starting at any column block) sit inside an
// 8-wide row from the aligned column below (`sw_skew`).
#define SW_ROW ((TMA && BN != 128) ? 32 : 16)
#define SLOT_SW (4 * SW_ROW)
// PS: the producer warpgroup's other warps multiply each K block's scales into [BM rows][4 column blocks] products
// after the slot's loads land, so a consumer's fold reads its 2 × 4 scale products (two 16-byte loads) instead of
// reading 6 scales and multiplying 8 pairs (one FMUL per row and column block per thread, 4 threads per row).
#define SLOT_P (PS ? 4 * BM * 16 : 0)
#define PS_THREADS 96   // the producer's warps 1..3 write the products (warp 0's first thread issues the loads)
// slots start on 1024-byte boundaries
#define SLOT ((SLOT_A + SLOT_W + SLOT_SA + SLOT_SW + SLOT_P + 1023) / 1024 * 1024)
#define P_OFF (SLOT_A + SLOT_W + SLOT_SA + SLOT_SW)

PTX_HELPERS
MMA_FRESH

#if TMA
// TMA: one thread requests a slot's four boxes (A and W tiles in the 128-byte swizzle, zero-filled past the
// tensor ends; the fp32 scale boxes) on the slot's mbarrier; every thread waits on that barrier's phase.
struct __align__(64) TmaDesc {
  u64 v[16];
};
struct Args {
  const TmaDesc *a, *w, *sa, *sw;
  u32 bars;   // STAGES mbarriers, 8 bytes apart
  int m0, n0;
  int rank;   // the CTA's rank in its cluster (0 without clusters)
};
__device__ __forceinline__ void tma_2d(u32 dst, const TmaDesc* map, int x, int y, u32 bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
               :: "r"(dst), "l"((u64)map), "r"(x), "r"(y), "r"(bar) : "memory");
}
#ifdef PROBE_NO_MCAST   // timing probe: clusters launched, each CTA loads its whole W tile (no multicast)
#define MC 1
#else
#define MC CM   // CTAs a W tile is multicast to
#endif
#if CM > 1
// A cluster of CM CTAs (CM row tiles of one W column tile): each loads a CM-th of the W tile and the TMA multicasts
// it into the same slot offset of every CTA of the cluster, completing bytes on each one's slot barrier; so each CTA
// reads BM + BN/CM rows of operands from L2 per K instead of BM + BN.
__device__ __forceinline__ void tma_2d_multicast(u32 dst, const TmaDesc* map, int x, int y, u32 bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%2, %3}], [%4], %5;\n"
               :: "r"(dst), "l"((u64)map), "r"(x), "r"(y), "r"(bar), "h"((unsigned short)((1 << CM) - 1)) : "memory");
}
// every thread of every CTA of the cluster (barrier inits, fenced by fence.mbarrier_init, visible before any remote
// arrive; no CTA leaves while a peer may still arrive on its barriers). Relaxed: a release arrive at cluster scope
// is a MEMBAR.ALL.GPU first.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.relaxed;\nbarrier.cluster.wait;\n" ::: "memory");
}
#endif
__device__ __forceinline__ void load_slot(const Args& g, u32 slot, int s, int tid) {
  if (tid != 0) return;
  const u32 bar = g.bars + (s % STAGES) * 8;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               :: "r"(bar), "r"(SLOT_A + SLOT_W + SLOT_SA + SLOT_SW) : "memory");
  tma_2d(slot, g.a, s * BK, g.m0, bar);
#if MC > 1
  tma_2d_multicast(slot + SLOT_A + g.rank * (SLOT_W / CM), g.w, s * BK, g.n0 + g.rank * (BN / CM), bar);
#else
  tma_2d(slot + SLOT_A, g.w, s * BK, g.n0, bar);
#endif
  tma_2d(slot + SLOT_A + SLOT_W, g.sa, s * 4, g.m0, bar);
  tma_2d(slot + SLOT_A + SLOT_W + SLOT_SA, g.sw, (g.n0 >> 5) & ~3, s * 4, bar);
}
// Stage j resident: its barrier's phase completed. Loads issued: the warps reconverge (thread 0 issued them), since
// the wgmma instructions that follow are .aligned (a diverged warp executing one is an illegal instruction).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}
__device__ __forceinline__ void stage_ready(const Args& g, int j) {
  mbar_wait(g.bars + (j % STAGES) * 8, (j / STAGES) & 1);
#if PS   // and its scale products, written after that barrier (the third set of STAGES mbarriers)
  mbar_wait(g.bars + (2 * STAGES + j % STAGES) * 8, (j / STAGES) & 1);
#endif
}
__device__ __forceinline__ void loads_issued() { __syncwarp(); }

#if WS
// The producer warpgroup's one thread fills slot s % STAGES with stage s once the consumers handed the slot back
// (its "empty" mbarrier, STAGES·8 bytes after the "full" ones, completes a phase per hand-back).
__device__ __forceinline__ void produce(const Args& g, u32 ring, int n_st) {
  for (int s = 0; s < n_st; ++s) {
    if (s >= STAGES) {
      const u32 bar = g.bars + (STAGES + s % STAGES) * 8, parity = ((s / STAGES) - 1) & 1;
      mbar_wait(bar, parity);
    }
    load_slot(g, ring + (s % STAGES) * SLOT, s, 0);
  }
}
#if PS
__device__ __forceinline__ void sts4(u32 addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
// The producer's warps 1..3 (thread tp of PS_THREADS): once stage s has landed, its scale products
// [4 K blocks][BM rows][4 column blocks] = sa[row][kb]·sw[kb][column block], then an arrive on the stage's products
// mbarrier. The slot is refilled only after the consumers handed it back, so no products are overwritten early.
__device__ __forceinline__ void multiply_scales(const Args& g, u32 ring, int n_st, int tp, u32 sw_skew) {
  for (int s = 0; s < n_st; ++s) {
    const u32 slot = ring + (s % STAGES) * SLOT;
    mbar_wait(g.bars + (s % STAGES) * 8, (s / STAGES) & 1);
    for (int row = tp; row < BM; row += PS_THREADS) {
      float a[4];
      lds4(slot + SLOT_A + SLOT_W + row * 16, a);
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        float w[4] = {0.f, 0.f, 0.f, 0.f};
        const u32 sw = slot + SLOT_A + SLOT_W + SLOT_SA + kb * SW_ROW + sw_skew;
#if SW_ROW == 16
        lds4(sw, w);
#else
#pragma unroll
        for (int b = 0; b < BN / 32; ++b) w[b] = lds(sw + 4 * b);
#endif
        sts4(slot + P_OFF + (kb * BM + row) * 16, a[kb] * w[0], a[kb] * w[1], a[kb] * w[2], a[kb] * w[3]);
      }
    }
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(g.bars + (2 * STAGES + s % STAGES) * 8)
                 : "memory");
  }
}
#endif
// Consumers wait for stage j with `stage_ready` alone (no CTA barrier: each warpgroup runs at its own pace); a slot
// is handed back by every consumer thread once its reads of the slot (MMA operands, scales) are complete. In a
// cluster every CTA's producer writes into the slot, so each consumer warp (its wgmma wait passed in all its lanes)
// hands it back to every CTA of the cluster: one arrive per warp and CTA, with the default (CTA-scope) release: at
// cluster scope ptxas puts a MEMBAR.ALL.GPU before each (session 26: 1.6-2.8x slower).
__device__ __forceinline__ void release(const Args& g, u32 slot) {
#if CM > 1
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int c = 0; c < MC; ++c)
      asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                   "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n"
                   :: "r"(g.bars + (STAGES + slot) * 8), "r"(MC > 1 ? c : g.rank) : "memory");
  }
#else
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(g.bars + (STAGES + slot) * 8) : "memory");
#endif
}
// a barrier of the consumer warpgroups only (the producer has left)
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;\n" :: "n"(128 * WGS) : "memory"); }
#endif

#else
// The kernel's arguments and the CTA's tile origin, which every slot load reads (kept as arguments, not
// per-thread registers: the loop holds 192 accumulator registers).
struct Args {
  const unsigned char* A;
  const float* SA;
  const unsigned char* W;
  const float* SW;
  int M, N, K, lda, ldsa, ldsw, m0, n0;
};

// One ring slot: A rows [m0, m0 + BM), W rows [n0, n0 + BN) over K [k0, k0 + 128), and their fp32 scales
// (sa [row][4 K blocks], sw [K block][4 column blocks]); rows and K past the ends are zero-filled (a chunk that
// copies 0 bytes reads nothing, so its source is only clamped to a valid row).
__device__ __forceinline__ void load_slot(const Args& g, u32 slot, int s, int tid) {
  const int k0 = s * BK, r = tid >> 3, c = tid & 7;
  const bool k_ok = k0 + c * 16 < g.K;
  const u32 dst = slot + r * 128 + ((c ^ (r & 7)) << 4);
#pragma unroll
  for (int j = 0; j < BM * 8 / NT; ++j) {
    const int row = g.m0 + r + j * (NT / 8);
    const bool ok = k_ok && row < g.M;
    cp16(dst + j * (NT / 8) * 128, g.A + (long long)(ok ? row : 0) * g.lda + k0 + c * 16, ok ? 16 : 0);
  }
#pragma unroll
  for (int j = 0; j < BN * 8 / NT; ++j) {
    const int row = g.n0 + r + j * (NT / 8);
    const bool ok = k_ok && row < g.N;
    cp16(dst + SLOT_A + j * (NT / 8) * 128, g.W + (long long)(ok ? row : 0) * g.K + k0 + c * 16, ok ? 16 : 0);
  }
  if (tid < BM) {   // ldsa is a multiple of 4 (the wrapper pads): a slot's 4 row scales are one 16-byte chunk
    const int row = g.m0 + tid;
    const bool ok = row < g.M && s * 4 < g.ldsa;
    cp16(slot + SLOT_A + SLOT_W + tid * 16, g.SA + (ok ? (long long)row * g.ldsa + s * 4 : 0), ok ? 16 : 0);
  } else if (tid < BM + 16) {
    const int e = tid - BM, kb = e >> 2, nb = (g.n0 >> 5) + (e & 3);
    const bool ok = nb < ((g.N + 31) >> 5) && s * 4 + kb < g.ldsw;
    cp4(slot + SLOT_A + SLOT_W + SLOT_SA + e * 4, g.SW + (ok ? (long long)nb * g.ldsw + s * 4 + kb : 0), ok ? 4 : 0);
  }
}

// Stage j resident: every thread's copies landed and are visible to the async proxy. Loads issued: one group.
__device__ __forceinline__ void stage_ready(const Args&, int) {
  cp_wait<STAGES - 3>();
  fence_async_smem();
}
__device__ __forceinline__ void loads_issued() { cp_commit(); }

#endif

// Stage j resident in every warp; after a CTA barrier (every warp is past stage j - 2, whose MMAs are complete) the
// slot of stage j - 2 takes stage j + STAGES - 2.
__device__ __forceinline__ void next_stage(const Args& g, u32 ring, int j, int n_st, int tid) {
  stage_ready(g, j);
  __syncthreads();
  const int sl = j + STAGES - 2;
#ifdef PROBE_NO_LOAD   // timing probe: MMAs and folds on the slots the prologue filled
  if (sl < STAGES) load_slot(g, ring + (sl % STAGES) * SLOT, sl, tid);
#else
  if (sl < n_st) load_slot(g, ring + (sl % STAGES) * SLOT, sl, tid);
#endif
  loads_issued();
}

// acc += p * s with acc updated in its own register: left to itself the allocator renames accumulators from fold
// to fold and runs out of registers next to the two 64-register MMA partials.
__device__ __forceinline__ void ffma_inplace(float& acc, float p, float s) {
  asm("fma.rn.f32 %0, %1, %2, %0;\n" : "+f"(acc) : "f"(p), "f"(s));
}

#if PS
// the thread's two rows' products for one MMA unit's NB column blocks (`sa`: the first, on the thread's first row)
#define NB (BN / 32 / SPLIT)
struct Scales {
  float s0[NB], s1[NB];
};
__device__ __forceinline__ Scales scales_of(u32 sa, u32) {
  Scales c;
#if NB == 4
  lds4(sa, c.s0);
  lds4(sa + 8 * 16, c.s1);
#else
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    c.s0[b] = lds(sa + 4 * b);
    c.s1[b] = lds(sa + 8 * 16 + 4 * b);
  }
#endif
  return c;
}
#else
// The scales a thread folds one K block with: its first row's sa (the row 8 below is 128 bytes further in the slot)
// and the K block's column-block sw. Read one K block ahead, so the shared loads are not waited for next to the
// wgmma operand reads.
struct Scales {
  float a0, a1, w[BN > 128 ? BN / 32 : 4];
};
__device__ __forceinline__ Scales scales_of(u32 sa, u32 sw) {
  Scales c;
  c.a0 = lds(sa);
  c.a1 = lds(sa + 8 * 16);
#if SW_ROW == 16
  lds4(sw, c.w);
#else   // the tile's column blocks may start at any of 4 word offsets: one load each
#pragma unroll
  for (int b = 0; b < BN / 32; ++b) c.w[b] = lds(sw + 4 * b);
#endif
  return c;
}
#endif

// acc += p * (sa_row ⊗ sw_block), one FFMA per element, for MMA unit H of a K block (its column half or quarter H
// when split). n8 group j of the m64nBN layout is column block j / 4; registers 4j, 4j+1 are on the thread's first
// row, 4j+2, 4j+3 eight rows below.
template <int H>
__device__ __forceinline__ void fold(float (&acc)[PR], const float (&p)[PU], const Scales& c) {
  constexpr int A0 = H * PU;   // the unit's first accumulator register
#ifdef PROBE_NO_FOLD   // timing probe (benchmarks/gemm_sm90.py): a quarter of the folds' FFMAs
#pragma unroll
#if PS
  for (int i = 0; i < PU; i += 4) ffma_inplace(acc[A0 + i], p[i] + p[i + 1] * p[i + 2], p[i + 3] * c.s0[0]);
#else
  for (int i = 0; i < PU; i += 4) ffma_inplace(acc[A0 + i], p[i] + p[i + 1] * p[i + 2], p[i + 3] * c.a0);
#endif
  return;
#endif
#pragma unroll
  for (int b = 0; b < BN / 32 / SPLIT; ++b) {
#if PS
    const float s0 = c.s0[b], s1 = c.s1[b];
#else
    constexpr int B0 = H * (BN / 32 / SPLIT);   // the unit's first column block
    const float s0 = c.a0 * c.w[B0 + b], s1 = c.a1 * c.w[B0 + b];
#endif
#pragma unroll
    for (int j = 4 * b; j < 4 * b + 4; ++j) {
      ffma_inplace(acc[A0 + 4 * j + 0], p[4 * j + 0], s0);
      ffma_inplace(acc[A0 + 4 * j + 1], p[4 * j + 1], s0);
      ffma_inplace(acc[A0 + 4 * j + 2], p[4 * j + 2], s1);
      ffma_inplace(acc[A0 + 4 * j + 3], p[4 * j + 3], s1);
    }
  }
}

// Slot 0's K block 0 for this thread: its warpgroup's A-tile and the W-tile wgmma descriptors, its scale addresses.
// Another block's are these plus constants (shared addresses stay below 2^18, so the descriptors' 14-bit address
// fields never carry).
struct Ring {
  u64 da, dw;
  u32 sa, sw;
};
// A K block of a slot: its operand descriptors for this warpgroup and the scales the thread folds it with.
struct Block {
  u64 da, dw;
  u32 sa, sw;
};
__device__ __forceinline__ Block block_at(const Ring& r, u32 slot, int kb) {
  const u32 o = slot * SLOT + kb * 32;
  return {r.da + (o >> 4), r.dw + (o >> 4), r.sa + slot * SLOT + kb * (PS ? BM * 16 : 4),
          r.sw + slot * SLOT + kb * SW_ROW};
}

// MMA unit H of a K block: W tile rows [H·BN/SPLIT, (H + 1)·BN/SPLIT) (whole 1024-byte swizzle atoms)
template <int H>
__device__ __forceinline__ void issue(float (&d)[PU], const Block& b) {
  mma_fence();
  mma_fresh(d, b.da, b.dw + H * (BN / SPLIT * 128 / 16));
  mma_commit();
}

extern "C" __global__ void __launch_bounds__(NT, CTAS) fp8_g32_gemm_sm90(
#if TMA
    const __grid_constant__ TmaDesc map_a, const __grid_constant__ TmaDesc map_w,
    const __grid_constant__ TmaDesc map_sa, const __grid_constant__ TmaDesc map_sw,
    unsigned short* __restrict__ Out, int M, int N, int K) {
#else
    const unsigned char* __restrict__ A, const float* __restrict__ SA, const unsigned char* __restrict__ W,
    const float* __restrict__ SW, unsigned short* __restrict__ Out, int M, int N, int K, int lda, int ldsa,
    int ldsw) {
#endif
  extern __shared__ unsigned char smem_raw[];
  // the 128-byte swizzle repeats every 1024 bytes of shared address: slots start on that boundary
  const u32 raw = (u32)__cvta_generic_to_shared(smem_raw);
  const u32 ring = (raw + 1023) & ~1023u;

  // grouped tile order: GROUP_M row tiles (clusters of CM row tiles: CM consecutive CTAs) share each W column tile
  // while it is in L2
  const int tid = threadIdx.x, pid = blockIdx.x / CM, rank = CM > 1 ? (int)cluster_rank() : 0;
  const int npm = (M + CM * BM - 1) / (CM * BM), npn = (N + BN - 1) / BN;
  const int group = GROUP_M * npn, first = (pid / group) * GROUP_M;
  const int gsize = min(npm - first, GROUP_M);
  const int m0 = ((first + (pid % group) % gsize) * CM + rank) * BM, n0 = ((pid % group) / gsize) * BN;

  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int row0 = wg * 64 + warp * 16 + (lane >> 2);   // the thread's first accumulator row in the tile
  const int n_st = (K + BK - 1) / BK;
  const u32 sw_skew = SW_ROW == 16 ? 0 : ((n0 >> 5) & 3) * 4;   // the tile's first column block in its box row

#if TMA
  const Args g = {&map_a, &map_w, &map_sa, &map_sw, ring + STAGES * SLOT, m0, n0, rank};
  if (tid == 0) {
    for (int q = 0; q < STAGES; ++q)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(g.bars + q * 8) : "memory");
#if WS
    for (int q = 0; q < STAGES; ++q)   // empty: every consumer thread arrives (in a cluster: every consumer warp)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(g.bars + (STAGES + q) * 8),
                   "n"(CM > 1 ? 4 * WGS * MC : 128 * WGS) : "memory");
#endif
#if PS
    for (int q = 0; q < STAGES; ++q)   // products: every multiplying thread of the producer arrives
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(g.bars + (2 * STAGES + q) * 8), "n"(PS_THREADS)
                   : "memory");
#endif
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
#if CM > 1
  cluster_sync();
#else
  __syncthreads();
#endif
#if WS
  if (wg == WGS) {   // the producer: few registers, one thread issues every load, then leaves
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGS) : "memory");
    if (tid == 128 * WGS) produce(g, ring, n_st);
#if PS
    else if (tid >= 128 * (WGS + 1) - PS_THREADS)
      multiply_scales(g, ring, n_st, tid - (128 * (WGS + 1) - PS_THREADS), sw_skew);
#endif
#if CM > 1
    __syncwarp();
    cluster_sync();
#endif
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(CONSUMER_REGS) : "memory");
  stage_ready(g, 0);
#else
  for (int s = 0; s < STAGES - 2 && s < n_st; ++s) load_slot(g, ring + s * SLOT, s, tid);
  __syncwarp();
  next_stage(g, ring, 0, n_st, tid);
#endif
#else
  const Args g = {A, SA, W, SW, M, N, K, lda, ldsa, ldsw, m0, n0};
#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (s < n_st) load_slot(g, ring + s * SLOT, s, tid);
    cp_commit();
  }
  next_stage(g, ring, 0, n_st, tid);
#endif

  float acc[PR], p0[PU], p1[PU];
#if DEPTH >= 3
  float p2[PU];
#endif
#if DEPTH >= 4
  float p3[PU];
#endif
#if DEPTH >= 5
  float p4[PU];
#endif
#if DEPTH >= 6
  float p5[PU];
#endif
#if DEPTH >= 7
  float p6[PU];
#endif
#if DEPTH >= 8
  float p7[PU];
#endif
#pragma unroll
  for (int i = 0; i < PR; ++i) acc[i] = 0.f;   // the partials: written by their first MMA (scale-d = 0)

  const u32 wg_u = __shfl_sync(0xffffffffu, wg, 0);   // warp-uniform: the descriptors stay in uniform registers
  const Ring r = {desc_sw128(ring + wg_u * 64 * 128), desc_sw128(ring + SLOT_A),
                  ring + (PS ? P_OFF : SLOT_A + SLOT_W) + row0 * 16, ring + SLOT_A + SLOT_W + SLOT_SA + sw_skew};
MAIN_LOOP
  // epilogue: bf16 through shared memory (padded rows), then 16-byte coalesced stores
#if !TMA
  cp_wait<0>();
#endif
#if WS
  consumers_sync();
#else
  __syncthreads();
#endif
  const int ld_t = (BN + 8) * 2;   // bytes per staged row
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const u32 c = ring + row0 * ld_t + (j * 8 + (lane & 3) * 2) * 2;
    u32 lo, hi;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(lo) : "f"(acc[4 * j + 1]), "f"(acc[4 * j + 0]));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(hi) : "f"(acc[4 * j + 3]), "f"(acc[4 * j + 2]));
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(c), "r"(lo));
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(c + 8 * ld_t), "r"(hi));
  }
#if WS
  consumers_sync();
#else
  __syncthreads();
#endif
#pragma unroll
  for (int j = 0; j < BM * (BN / 8) / (128 * WGS); ++j) {
    const int id = tid + j * 128 * WGS, r = id / (BN / 8), c = (id % (BN / 8)) * 8;
    if (m0 + r < M && n0 + c < N) {
      u32 v0, v1, v2, v3;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3) : "r"(ring + r * ld_t + c * 2));
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n"
                   :: "l"(Out + (long long)(m0 + r) * N + n0 + c), "r"(v0), "r"(v1), "r"(v2), "r"(v3) : "memory");
    }
  }
#if CM > 1
  cluster_sync();
#endif
}
"""


def cuda_source(wgs: int, stages: int, group_m: int, probe: str = "", bn: int = 128, depth: int = 2,
                body: int = 2, tma: bool = False, ws: bool = False, ctas: int = 1, split: int = 1,
                ps: bool = False, cluster: int = 1) -> str:
    """The kernel's CUDA source for one configuration (also what `benchmarks/` compiles offline with nvcc):
    wgs warpgroups (64 rows each) × bn columns per CTA, `stages` ring slots, `depth` MMA partials per warpgroup
    (depth - 1 MMAs in flight during a fold), `body` stages per K-loop iteration (a multiple of `stages`: constant
    slots); tma: the slots are filled by TMA (one thread, mbarrier per slot) instead of every thread's cp.async;
    ws: by a producer warpgroup (TMA); ctas: CTAs per SM (2: one consumer warpgroup each, with ws); split: MMA units
    per K block (2-4: m64n(bn/split) MMAs into partials that narrow, so `depth` counts those partials); ps: the
    producer warpgroup's other warps multiply the scales into per-(row, column block) products (with ws); cluster:
    CTAs per thread-block cluster (2 or 4 row tiles of one W tile, with ws), each loading a share of the W tile that
    TMA multicasts to all of them.
    probe ("", "NO_FOLD", "NO_LOAD", "NO_MMA", "NO_MCAST"): a timing probe of benchmarks/gemm_sm90.py (wrong results): NO_FOLD
    keeps a quarter of the fold arithmetic, NO_LOAD loads only the slots the prologue fills, NO_MMA keeps the loads
    and drops the MMAs and folds, NO_MCAST launches the clusters without the multicast (right results)."""
    assert wgs in (1, 2, 3) and 3 <= stages <= 8 and group_m >= 1, (wgs, stages, group_m)
    assert bn in (64, 96, 128, 192, 256) and 2 <= depth <= 4 * split and 1 <= body <= 8, (bn, depth, body)
    assert bn <= 128 or (ws and not ps), \
        "tiles wider than 128 columns: TMA loads by a producer warpgroup, scales multiplied by the consumers"
    assert probe in ("", "NO_FOLD", "NO_LOAD", "NO_MMA", "NO_MCAST"), probe
    assert not ws or (tma and probe != "NO_LOAD"), "the producer warpgroup issues TMA loads"
    assert ctas == 1 or (ctas == 2 and ws and wgs == 1), "two CTAs per SM: one consumer warpgroup each (ws)"
    assert split in (1, 2, 3, 4) and bn % split == 0 and (bn // split) % 32 == 0, \
        "an MMA unit spans whole 32-column scale blocks"
    assert not ps or ws, "the scale products are the producer warpgroup's"
    assert cluster in (1, 2, 4) and (cluster == 1 or ws) and (bn // cluster) % 8 == 0, \
        "a cluster's W tile is multicast by the producers, in whole 8-row swizzle atoms"
    return (f"#define WGS {wgs}\n#define STAGES {stages}\n#define GROUP_M {group_m}\n#define BN {bn}\n"
            f"#define DEPTH {depth}\n#define TMA {int(tma)}\n#define WS {int(ws)}\n#define CTAS {ctas}\n"
            f"#define SPLIT {split}\n#define PS {int(ps)}\n#define CM {cluster}\n"
            + (f"#define PROBE_{probe}\n" if probe else "")
            + _SOURCE.replace("PTX_HELPERS", _PTX_HELPERS).replace("MMA_FRESH", _wgmma_asm(n=bn // split))
            .replace("MAIN_LOOP", _main_loop(depth, body, stages, ws, split, ps, bn, probe == "NO_MMA")))


def smem_bytes(wgs: int, stages: int, bn: int = 128, ps: bool = False) -> int:
    bm = 64 * wgs
    sw = 64 if bn == 128 else 128   # SLOT_SW (the cp.async path's 64 when narrower: this over-counts at most)
    products = 4 * bm * 16 if ps else 0
    ring = stages * (-(-(bm * BLOCK_K + bn * BLOCK_K + bm * 16 + sw + products) // 1024) * 1024)   # SLOT
    # + the TMA path's mbarriers after the ring (full; empty with a producer warpgroup; products), + alignment slack
    # for the 1024-byte swizzle atoms
    return max(ring + (24 if ps else 16) * stages, bm * (bn + 8) * 2) + 1024


@functools.cache
def _kernel(device_index: int, wgs: int, stages: int, group_m: int, probe: str, bn: int, depth: int, body: int,
            tma: bool, ws: bool, ctas: int, split: int, ps: bool, cluster: int):
    major, minor = torch.cuda.get_device_capability(device_index)
    assert (major, minor) == (9, 0), f"fp8_gemm_sm90 needs an sm_90 GPU, got sm_{major}{minor}"
    with torch.cuda.device(device_index):
        return load_kernel(cuda_source(wgs, stages, group_m, probe, bn, depth, body, tma, ws, ctas, split, ps,
                                       cluster),
                           "fp8_g32_gemm_sm90", smem_bytes(wgs, stages, bn, ps))


def load_kernel(src: str, name: str, smem: int):
    """Compile `src` for sm_90a, load its kernel `name` on the current device with `smem` bytes of dynamic shared
    memory allowed -> torch's `_CudaKernel` (`kern.func` is the CUfunction)."""
    from torch.cuda._utils import _cuda_load_module
    kern = _cuda_load_module(_compile(src), [name])[name]
    kern.set_shared_memory_config(smem)
    return kern


def _compile(src: str) -> bytes:
    """sm_90a cubin of `src`: NVRTC (shipped with torch) or, where torch's NVRTC is missing, the CUDA toolkit's nvcc."""
    try:
        from torch.cuda._utils import _nvrtc_compile
        cubin, _ = _nvrtc_compile(src, "fp8_g32_gemm_sm90", "90a", nvcc_options=["-std=c++17"])
        return cubin
    except (ImportError, OSError, RuntimeError) as e:
        nvrtc_error = e
    import shutil
    import subprocess
    import tempfile
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError(f"fp8_gemm_sm90: NVRTC failed ({nvrtc_error}) and no nvcc on PATH")
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.cu", "w") as f:
            f.write(src)
        subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-o", f"{d}/k.cubin", f"{d}/k.cu"], check=True)
        with open(f"{d}/k.cubin", "rb") as f:
            return f.read()


def weight_scales_f32(w_s: torch.Tensor, tma: bool = False) -> torch.Tensor:
    """W's e8m0 (or fp32) [ceil(N/32), K/32] block scales in fp32 (exact), as the kernel reads them: [ceil(N/32),
    K/32 padded to a multiple of 4] for cp.async, or transposed to [K/32 padded to 4, ceil(N/32) padded to 4] for
    TMA (a slot's box is then [4 K blocks][4 column blocks], or 8 from the aligned column below for tiles narrower
    than 128). Done once per weight (build/bind time)."""
    f = scale_to_fp32(w_s)
    if not tma:
        return pad_scales(f)
    return pad_scales(pad_scales(f).t().contiguous())


def pad_scales(s: torch.Tensor) -> torch.Tensor:
    """fp32 [R, G] -> contiguous fp32 [R, ceil(G/4)·4] (zero columns), so each 128-K slot's scales are 16 bytes."""
    r, g = s.shape
    gp = -(-g // 4) * 4
    if gp == g and s.is_contiguous():
        return s
    out = torch.zeros((r, gp), dtype=torch.float32, device=s.device)
    out[:, :g] = s
    return out


def _tensor_map(t: torch.Tensor, inner: int, outer: int, row_bytes: int, box: tuple[int, int], swizzle128: bool):
    """A 2-D TMA descriptor (CUtensorMap, 128 bytes, 64-byte aligned host buffer) over `t`, uint8 or fp32, rows of
    `inner` elements `row_bytes` apart; zero fill past the ends."""
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library
    lib = _get_gpu_runtime_library()
    raw = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(raw) + 63) & ~63
    dtype = {torch.uint8: 0, torch.float32: 7}[t.dtype if t.dtype != E4M3 else torch.uint8]
    _check_cuda(lib.cuTensorMapEncodeTiled(
        ctypes.c_void_p(addr), ctypes.c_int(dtype), ctypes.c_uint32(2), ctypes.c_void_p(t.data_ptr()),
        (ctypes.c_uint64 * 2)(inner, outer), (ctypes.c_uint64 * 1)(row_bytes), (ctypes.c_uint32 * 2)(*box),
        (ctypes.c_uint32 * 2)(1, 1), ctypes.c_int(0), ctypes.c_int(3 if swizzle128 else 0), ctypes.c_int(2),
        ctypes.c_int(0)))
    return raw, addr


def _launch_tma(kern, grid: int, threads: int, smem: int, maps: list, out: torch.Tensor, m: int, n: int,
                k: int, cluster: int = 1) -> None:
    """cuLaunchKernel with four by-value tensor maps (torch's launcher passes only pointers and scalars); with
    cluster > 1, cuLaunchKernelEx with clusters of that many consecutive CTAs."""
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library
    lib = _get_gpu_runtime_library()
    scalars = [ctypes.c_void_p(out.data_ptr()), ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k)]
    params = (ctypes.c_void_p * 8)(*[addr for _, addr in maps], *[ctypes.addressof(v) for v in scalars])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    if cluster == 1:
        _check_cuda(lib.cuLaunchKernel(kern.func, grid, 1, 1, threads, 1, 1, smem, stream, params, None))
        return
    attr = _LaunchAttribute(id=_CLUSTER_DIMENSION)
    attr.value[:3] = [cluster, 1, 1]
    cfg = _LaunchConfig(grid, 1, 1, threads, 1, 1, smem, stream, ctypes.pointer(attr), 1)
    _check_cuda(lib.cuLaunchKernelEx(ctypes.byref(cfg), kern.func, params, None))


class _LaunchAttribute(ctypes.Structure):
    """The driver's CUlaunchAttribute: an id, padding, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint32 * 16)]


class _LaunchConfig(ctypes.Structure):
    """The driver's CUlaunchConfig."""
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4   # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


def fp8_gemm_sm90_config(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, cfg,
                         out: torch.Tensor | None = None, w_s_t: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel of an `sm90` GemmConfig (what `fp8_gemm` runs for one): a producer warpgroup fills a TMA ring of
    cfg.num_stages slots, cfg.block_p / 64 consumer warpgroups. a_s fp32 (or e8m0, widened here), w_s the weight's
    [ceil(N/32), K/32] scales; w_s_t = weight_scales_f32(w_s, tma=True) when the caller holds it (an `FP8Linear`
    does, from bind time), else derived here (a few small launches)."""
    assert cfg.sm90, cfg
    a_s = scale_to_fp32(a_s)
    if w_s_t is None:
        w_s_t = weight_scales_f32(w_s, tma=True)
    return fp8_gemm_sm90(a_q, a_s, w_q, w_s_t, out, wgs=cfg.block_p // 64, stages=cfg.num_stages,
                         group_m=cfg.group_p, bn=cfg.block_q, depth=sm90_depth(cfg.block_q, cfg.mma_split),
                         body=cfg.num_stages, tma=True, ws=True, ctas=cfg.ctas_per_sm, split=cfg.mma_split)


def fp8_gemm_sm90(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, sw_f32: torch.Tensor,
                  out: torch.Tensor | None = None, wgs: int = 2, stages: int = 5, group_m: int = 8,
                  probe: str = "", bn: int = 128, depth: int = 2, body: int = 2, tma: bool = False,
                  ws: bool = False, ctas: int = 1, split: int = 1, ps: bool = False, cluster: int = 1) -> torch.Tensor:
    """a_q e4m3 [M, K] (K contiguous, 16-byte aligned rows), a_s fp32 [M, K/32] pow2 scales, w_q e4m3 [N, K]
    contiguous, sw_f32 = weight_scales_f32(w_s, tma) -> bf16 [M, N]. K % 32 == 0, N % 8 == 0."""
    assert a_q.dtype == E4M3 and w_q.dtype == E4M3, (a_q.dtype, w_q.dtype)
    assert a_s.dtype == torch.float32 and sw_f32.dtype == torch.float32, (a_s.dtype, sw_f32.dtype)
    m, k = a_q.shape
    n, kw = w_q.shape
    assert k == kw and k % QBLOCK == 0 and n % 8 == 0, f"A {tuple(a_q.shape)}, W {tuple(w_q.shape)}"
    assert a_q.stride(1) == 1 and a_q.stride(0) % 16 == 0 and a_q.data_ptr() % 16 == 0 and w_q.is_contiguous()
    assert w_q.data_ptr() % 16 == 0 and a_s.shape == (m, k // QBLOCK), (tuple(a_s.shape), m, k)
    nb, kg = -(-n // QBLOCK), -(-k // BLOCK_K) * 4
    want = (kg, -(-nb // 4) * 4) if tma else (nb, kg)
    assert sw_f32.shape == want and sw_f32.is_contiguous(), (tuple(sw_f32.shape), want)
    sa = pad_scales(a_s)
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=a_q.device)
    assert out.shape == (m, n) and out.is_contiguous() and out.dtype == torch.bfloat16
    if m == 0 or n == 0:
        return out
    kern = _kernel(a_q.device.index, wgs, stages, group_m, probe, bn, depth, body, tma, ws, ctas, split, ps, cluster)
    bm = 64 * wgs
    grid = -(-m // (bm * cluster)) * cluster * -(-n // bn)   # whole clusters (rows past M are zero-filled)
    smem = smem_bytes(wgs, stages, bn, ps)
    assert ctas == 1 or ctas * (smem + 1024) <= 228 * 1024, f"{ctas} CTAs of {smem} bytes do not share an SM"
    if tma:
        maps = [_tensor_map(a_q, k, m, a_q.stride(0), (BLOCK_K, bm), True),
                _tensor_map(w_q, k, n, k, (BLOCK_K, bn // (1 if probe == "NO_MCAST" else cluster)), True),
                _tensor_map(sa, sa.shape[1], m, sa.shape[1] * 4, (4, bm), False),
                _tensor_map(sw_f32, sw_f32.shape[1], sw_f32.shape[0], sw_f32.shape[1] * 4,
                            (4 if bn == 128 else 8, 4), False)]   # (SW_ROW in the source)
        _launch_tma(kern, grid, 128 * (wgs + ws), smem, maps, out, m, n, k, cluster)
        return out
    kern(grid=(grid, 1, 1), block=(128 * wgs, 1, 1),
         args=[a_q, sa, w_q, sw_f32, out, m, n, k, a_q.stride(0), sa.shape[1], sw_f32.shape[1]], shared_mem=smem)
    return out
