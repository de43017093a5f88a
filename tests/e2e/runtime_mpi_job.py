"""Run under mpirun by tests/e2e/test_runtime.py: rank 0 serves requests through LLMEngine, ranks > 0 run
worker_loop. argv: ENGINE_DIR JOB_JSON OUT_JSON, JOB_JSON = {"requests": [[id, prompt_ids, max_tokens], ...],
"max_num_tokens": int, "crash": bool}. Rank 0 runs the requests together, then each alone, and writes the tokens;
with "crash" it then sends the workers a plan they cannot run (a token id outside the vocabulary) and waits: the
failing worker must take the whole job down."""
import json
import sys
import time

import torch
from mpi4py import MPI


def main(engine_dir: str, job_path: str, out_path: str) -> int:
    torch.set_num_threads(1)
    from dsflash.serve.llm_engine import LLMEngine, Request, SamplingParams, worker_loop
    if MPI.COMM_WORLD.Get_rank() > 0:
        return worker_loop(engine_dir)
    job = json.load(open(job_path))
    eng = LLMEngine(engine_dir, kv_cache_bytes=1 << 26, max_num_tokens=job["max_num_tokens"])

    def run(reqs):
        tokens = {rid: [] for rid, _, _ in reqs}
        for rid, ids, n in reqs:
            eng.add_request(Request(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True)))
        while eng.has_work():
            for o in eng.step():
                tokens[o.request_id] += o.new_token_ids
        return tokens

    batched = run(job["requests"])
    alone = {k: v for r in job["requests"] for k, v in run([r]).items()}
    json.dump({"batched": batched, "alone": alone, "stats": eng.stats()}, open(out_path, "w"))
    if job.get("crash"):
        eng._control.send_step([], [("bad", [eng.args.vocab_size + 7], True)])
        time.sleep(120)
        return 0
    eng.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
