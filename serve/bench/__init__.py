"""`dsflash bench`: trtllm-bench-style benchmarks of an engine dir (conventions.md §3).

`dataset` writes and reads the JSON Lines request files (`prepare-dataset`), `runner` drives the serving engine at a
fixed concurrency and times every request, `stats` turns the timings into trtllm-bench's report, `report` prints it
and draws the sweep plot, `cli` is the command.
"""
