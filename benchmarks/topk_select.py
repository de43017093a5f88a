"""The index top-k of a decode step: `csa2.topk_indices` (a stable descending sort of all T scores, the model's path)
against a candidate, `torch.topk` of one distinct int64 key per entry (order-preserving score bits in the high word,
T − 1 − index in the low word: the same picks in the same order, in five elementwise launches plus the topk), at one
TP8 rank's decode shapes. Checks that the two give the same indices on the GPU (rows with ties), then times both in
CUDA graphs. (Session 42, H100: the candidate was 1.2–3.2× slower; the model keeps the sort.)

    python benchmarks/topk_select.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from dsflash.model_def import csa2
from dsflash.plugins.timing import graph_time_many

# (rows N, entries T, k): index top-512 over E = 4608 / 9216 entries (ratio 2 / 1 at max_seq_len 9216), and the
# candidate level's top-2048 over blocks of 8 (all 1152 at ratio 1: a whole sort either way)
SHAPES = [(1, 4608, 512), (1, 9216, 512), (64, 4608, 512), (64, 9216, 512), (1, 1152, 2048), (64, 1152, 2048)]


def sort_keys(scores: torch.Tensor) -> torch.Tensor:
    """A distinct int64 per entry that orders as a stable descending sort of scores: a negative float's bits
    (−2³¹ + |x|) become −|x| (so −0.0 meets +0.0), stacked with T − 1 − index as the low int32 word."""
    bits = scores.float().contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, -(1 << 31) - bits, bits)
    t = scores.shape[-1]
    tail = torch.arange(t - 1, -1, -1, dtype=torch.int32, device=scores.device).expand_as(ordered)
    return torch.stack([tail, ordered], -1).view(torch.int64).squeeze(-1)


def keyed_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    kk = min(k, scores.shape[-1])
    idx = torch.topk(sort_keys(scores), kk, dim=-1).indices
    idx = torch.where(scores.gather(-1, idx) > float("-inf"), idx, -1)
    return torch.nn.functional.pad(idx, (0, k - kk), value=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for n, t, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(t + n)
        scores = torch.randn(n, t, device="cuda", generator=g).round(decimals=1)    # many ties
        scores[:, t * 3 // 4:] = float("-inf")                                        # invisible entries
        same = torch.equal(keyed_topk(scores, k), csa2.topk_indices(scores, k))
        (keyed, _), (sort, _) = graph_time_many([[lambda: keyed_topk(scores, k)],
                                                 [lambda: csa2.topk_indices(scores, k)]])
        rows.append({"N": n, "T": t, "k": k, "keyed_topk_us": keyed, "stable_sort_us": sort, "same_indices": same})
        print(f"N {n:>3} T {t:>5} k {k:>3}: keyed topk {keyed:7.1f} µs, stable sort {sort:7.1f} µs, same: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
