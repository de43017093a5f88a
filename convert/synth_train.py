"""Trained synthetic checkpoints: random V4.1 weights fitted, through the reference model, to a token map.

On random weights greedy tokens are chaotic: FP8/FP4 quantizers with power-of-two scales, top-k routing and the
top-2 gap of random logits over a 129,280-token vocabulary let any rounding difference flip the argmax, so two
correct implementations disagree on most tokens (benchmarks/README.md, "Engine-level check"). Trained models are
not like that. `train_values` starts from the random checkpoint (`synth_value`) and runs AdamW on every floating
tensor of the model (hf numerics, fp32) so that the next token is σ(current token), for a fixed random permutation σ
of a sub-vocabulary. The fitted model's logits are decisive (top-2 gaps of several nats after FP8/FP4
quantization), so implementations that round differently give the same greedy tokens, while a gross bug (a
mis-stacked expert, a dropped shared expert) still changes them. The task is written beside the weights as
`synth_task.json`; the values still depend only on (seed, steps, task, device), not on sharding.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dsflash.model_def.config import ModelArgs

TASK_FILE = "synth_task.json"


@dataclass(frozen=True)
class PermutationTask:
    """next token = σ(current token) on [vocab_start, vocab_start + vocab_size)."""
    vocab_start: int = 1000
    vocab_size: int = 512
    seed: int = 0

    @cached_property
    def permutation(self) -> torch.Tensor:
        return torch.randperm(self.vocab_size, generator=torch.Generator().manual_seed(self.seed))

    def target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.permutation.to(ids.device)[ids - self.vocab_start] + self.vocab_start

    def prompts(self, n: int, length: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(self.vocab_start, self.vocab_start + self.vocab_size, (n, length), generator=g)

    def continuation(self, last: torch.Tensor, steps: int) -> torch.Tensor:
        """The greedy tokens a fitted model produces after prompts ending in `last` [n] -> [n, steps]."""
        out = [last]
        for _ in range(steps):
            out.append(self.target(out[-1]))
        return torch.stack(out[1:], 1)

    def check(self, args: ModelArgs) -> None:
        if self.vocab_start < 0 or self.vocab_size < 2 or self.vocab_start + self.vocab_size > args.vocab_size:
            raise ValueError(f"permutation task [{self.vocab_start}, {self.vocab_start + self.vocab_size}) does not "
                             f"fit the model's vocab_size {args.vocab_size}")

    @staticmethod
    def load(checkpoint_dir: str | Path) -> tuple[PermutationTask, dict]:
        """(task, training record) of a trained synthetic checkpoint; ValueError when the folder has none."""
        path = Path(checkpoint_dir) / TASK_FILE
        if not path.is_file():
            raise ValueError(f"{path}: not found (write the checkpoint with `dsflash synth --train-steps N`)")
        meta = json.loads(path.read_text())
        return PermutationTask(**meta["task"]), meta


def train_values(args: ModelArgs, seed: int, steps: int, task: PermutationTask = PermutationTask(),
                 device: str = "cpu", batch: int = 8, seq_len: int = 32, lr: float = 3e-3,
                 progress: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """Fit the random checkpoint of (args, seed) to `task` for `steps` AdamW steps.
    -> ({tensor name: logical value on the CPU}, training record)."""
    from dsflash.convert.synth import synth_value
    from dsflash.model_def import build_model
    from dsflash.model_def.names import tensor_table
    if args.family != "v41":
        raise ValueError(f"trained synthetic checkpoints are V4.1 only (got family '{args.family}')")
    if steps < 1:
        raise ValueError(f"train steps must be >= 1, got {steps}")
    task.check(args)
    model = build_model(args, "hf", device=device)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    table = tensor_table(args)
    with torch.no_grad():
        for entry in table:
            tensors[entry.name].copy_(synth_value(entry, args, seed).to(tensors[entry.name].dtype))
    trained = [p for p in model.parameters() if p.requires_grad and p.dtype.is_floating_point]
    opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0, fused=True)   # one pass per tensor: ~5x the for-loop
    bar = tqdm(range(steps), desc="train", unit="step", disable=not progress)
    for i in bar:
        ids = task.prompts(batch, seq_len, seed * 1_000_003 + i).to(device)   # ids: [b, s]
        logits = model.forward_step(ids, model.new_state(batch))               # logits: [b, s, V] fp32
        loss = F.cross_entropy(logits.flatten(0, 1), task.target(ids).flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    with torch.no_grad():
        top2 = logits.topk(2, -1).values
        record = {"task": asdict(task), "steps": steps, "lr": lr, "batch": batch, "seq_len": seq_len,
                  "device": str(device), "final_loss": round(loss.item(), 5),
                  "final_accuracy": float((logits.argmax(-1) == task.target(ids)).float().mean()),
                  "final_top2_gap_min": round(float((top2[..., 0] - top2[..., 1]).min()), 3)}
    return {e.name: tensors[e.name].detach().cpu() for e in table}, record
