"""`make demo`'s job end to end: synth -> convert -> build -> generate -> serve one request -> clean shutdown."""
import json
import re
import subprocess
import sys


def test_demo_runs_the_whole_pipeline(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsflash.serve.cli", "demo", "--workdir", str(tmp_path),
                        "--max-new-tokens", "6"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for step in ("dsflash synth", "dsflash convert", "dsflash build", "dsflash generate", "curl -s http://127.0.0.1:"):
        assert step in out, step
    generated = json.loads(re.search(r"output_ids \(6\): (\[.*\])", out).group(1))
    completion = json.loads(out[out.index("{\n"):out.index("\n}\n") + 2])
    assert completion["usage"]["completion_tokens"] == 6 == len(generated)
    assert completion["choices"][0]["text"] == re.search(r"text: '(.*)'\n", out).group(1)
    assert "server exited with status 0" in out
