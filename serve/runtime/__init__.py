"""Serving runtime (nano-vllm shape): sequence -> block_manager -> scheduler -> model_runner, plus sampling and the
MPI control plane (worker). The engine loop that ties them together is `dsflash.serve.llm_engine`."""
