"""The index top-k of a decode step (`csa2.topk_indices`): a stable descending sort of all T scores (the old path)
against `torch.topk` of distinct int64 sort keys (`csa2.sort_keys`), at one TP8 rank's decode shapes. Checks that
the two give the same indices on the GPU (rows with ties), then times both in CUDA graphs.

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


def stable_sort_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return torch.where(vals[..., :k] > float("-inf"), idx[..., :k], torch.full_like(idx[..., :k], -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for n, t, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(t + n)
        scores = torch.randn(n, t, device="cuda", generator=g).round(decimals=1)    # many ties
        scores[:, t * 3 // 4:] = float("-inf")                                        # invisible entries
        same = torch.equal(csa2.topk_indices(scores, k), stable_sort_topk(scores, k))
        (keyed, _), (sort, _) = graph_time_many([[lambda: csa2.topk_indices(scores, k)],
                                                 [lambda: stable_sort_topk(scores, k)]])
        rows.append({"N": n, "T": t, "k": k, "keyed_topk_us": keyed, "stable_sort_us": sort, "same_indices": same})
        print(f"N {n:>3} T {t:>5} k {k:>3}: keyed topk {keyed:7.1f} µs, stable sort {sort:7.1f} µs, same: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
