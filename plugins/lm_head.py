"""Vocabulary-chunked LM head: logits = x·Wᵀ computed `chunk` rows of W at a time (bounds the fp32 temporary).

Pure PyTorch (runs on CPU engines); the chunk size is a tuning parameter chosen by `dsflash build`.
"""
from __future__ import annotations

import torch

CHUNK_CANDIDATES = (8192, 32768, 131072)


def lm_head_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, D], w: [V, D] -> fp32 [M, V]."""
    return x.float() @ w.float().t()


def chunked_lm_head(x: torch.Tensor, w: torch.Tensor, chunk: int) -> torch.Tensor:
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    assert chunk > 0, chunk
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    xf = x.float()
    for s in range(0, w.shape[0], chunk):
        torch.matmul(xf, w[s:s + chunk].float().t(), out=out[:, s:s + chunk])
    return out
