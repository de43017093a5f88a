"""`dsflash bench`: trtllm-bench-style benchmarks of an engine dir (conventions.md §3).

`dataset` writes and reads the JSON Lines request files (`prepare-dataset`); `runner` drives the serving engine at a
fixed concurrency and times every request, `serving` does the same against a running server over HTTP; `stats`
turns the timings into trtllm-bench's and benchmark_serving's reports, `report` prints them and draws the sweep plot;
`collectives` measures all-reduce cost for the TP-rank simulation; `cli` is the command.
"""
