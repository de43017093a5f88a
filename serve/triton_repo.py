"""`dsflash triton-repo --engine DIR --out REPO`: a Triton Inference Server model repository serving an engine.

REPO/<name>/config.pbtxt      Python backend, decoupled (streaming), tensorrtllm-backend tensors (conventions §5.3),
                              parameters: engine_dir, KV-cache size, queue, limits, batch_invariant
REPO/<name>/1/model.py        dsflash.serve.triton_model.TritonPythonModel (the in-flight batching engine)
REPO/<name>_bls/...           unary front (not decoupled) for HTTP /infer and gRPC ModelInfer, like tensorrt_llm_bls

The Python stub embeds its own interpreter, so model.py first puts this environment's site-packages (where dsflash
and its dependencies are installed) on sys.path, after any `--extra-site-dir`. The stub of the Triton 2.51 build in
`nvidia-pytriton` reads numpy 1.x array headers (with numpy 2 its tensors come out empty or garbled), so with
numpy 2 in this environment pass a directory holding numpy 1.26 (`make` creates `.venv/triton-site`).
`--backend-dir` also writes a Python-backend directory from `nvidia-pytriton` (its tritonserver binary runs on
CPU), with the stub for this Python version copied in. Single-rank engines only: a multi-rank engine runs under
`dsflash serve` (MPI). Several engines can share one repository (one `triton-repo` call each, distinct names).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import sysconfig
from pathlib import Path

from dsflash.serve.api import tensors

TYPES = {"BOOL": "TYPE_BOOL", "INT32": "TYPE_INT32", "UINT64": "TYPE_UINT64", "FP32": "TYPE_FP32",
         "BYTES": "TYPE_STRING"}

MODEL_PY = '''# Written by `dsflash triton-repo`; Triton's Python stub loads this file.
import site
import sys

SITE_DIRS = {site_dirs!r}
for _d in reversed(SITE_DIRS):  # ahead of the system's dist-packages; .pth files (editable installs) processed
    site.addsitedir(_d)
    sys.path.remove(_d)
    sys.path.insert(0, _d)

from dsflash.serve.triton_model import {cls} as TritonPythonModel  # noqa: E402,F401
'''


def _tensor(name: str, dtype: str, dims: list[int], optional: bool) -> str:
    opt = " optional: true" if optional else ""
    return f'  {{ name: "{name}" data_type: {TYPES[dtype]} dims: {json.dumps(dims)}{opt} }}'


def config_pbtxt(name: str, max_batch_size: int, decoupled: bool, params: dict[str, str], instances: int = 1) -> str:
    inputs = ",\n".join(_tensor(n, d, s, True) for n, (d, s, _) in tensors.INPUTS.items())
    outputs = ",\n".join(_tensor(n, d, s, False) for n, (d, s) in tensors.OUTPUTS.items())
    lines = [f'name: "{name}"', 'backend: "python"', f"max_batch_size: {max_batch_size}",
             f"model_transaction_policy {{ decoupled: {'true' if decoupled else 'false'} }}",
             f"input [\n{inputs}\n]", f"output [\n{outputs}\n]",
             f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]"]
    for k, v in params.items():
        lines.append(f'parameters {{ key: "{k}" value: {{ string_value: {json.dumps(str(v))} }} }}')
    return "\n".join(lines) + "\n"


def site_dirs(extra: list[str] = ()) -> list[str]:
    """`extra` first, then where this interpreter finds dsflash and its dependencies (an editable install's
    finder is a .pth file there)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([*(str(Path(d).resolve()) for d in extra), paths["purelib"], paths["platlib"]]))


def write_repo(engine_dir: str | Path, out: str | Path, name: str = "dsflash", *, kv_cache_bytes: int | None = None,
               kv_cache_free_gpu_mem_fraction: float | None = None, max_queue_size: int | None = None,
               max_batch_size: int | None = None, bls_instances: int = 4, extra_site_dirs: list[str] = (),
               batch_invariant: bool = False) -> Path:
    from dsflash.build.engine import EngineError, open_engine
    from dsflash.convert.atomic import atomic_dir
    eng = open_engine(engine_dir)
    if eng.world_size != 1:
        raise EngineError(f"{engine_dir}: engine has {eng.world_size} ranks; the Triton repository serves "
                          f"single-rank engines (serve multi-rank engines with `dsflash serve`, which runs mpirun)")
    out = Path(out)
    for model in (name, f"{name}_bls"):
        if (out / model).exists():
            raise EngineError(f"{out / model}: model directory already exists")
    for d in extra_site_dirs:
        if not Path(d).is_dir():
            raise EngineError(f"{d}: --extra-site-dir is not a directory")
    built = eng.meta["build_config"]
    mbs = max_batch_size or int(built["max_batch_size"])
    params = {"engine_dir": str(Path(engine_dir).resolve())}
    if kv_cache_bytes is not None:
        params["kv_cache_bytes"] = str(kv_cache_bytes)
    if kv_cache_free_gpu_mem_fraction is not None:
        params["kv_cache_free_gpu_mem_fraction"] = str(kv_cache_free_gpu_mem_fraction)
    if max_queue_size is not None:
        params["max_queue_size"] = str(max_queue_size)
    if max_batch_size is not None:
        params["max_batch_size"] = str(max_batch_size)
    if batch_invariant:
        params["batch_invariant"] = "true"
    models = ((name, True, "TritonPythonModel", params, 1),
              (f"{name}_bls", False, "TritonBLSModel", {"target_model": name}, bls_instances))
    # both model dirs are written beside their places and renamed only when both are complete
    with contextlib.ExitStack() as stack:
        for model, decoupled, cls, extra, count in models:
            tmp = stack.enter_context(atomic_dir(out / model, "tmp-triton-repo"))
            (tmp / "1").mkdir()
            (tmp / "config.pbtxt").write_text(config_pbtxt(model, mbs, decoupled, extra, count))
            (tmp / "1" / "model.py").write_text(MODEL_PY.format(site_dirs=site_dirs(extra_site_dirs), cls=cls))
    return out


def pytriton_dir() -> Path:
    """The Triton distribution inside the nvidia-pytriton wheel (bin/tritonserver, backends/python, stubs)."""
    import importlib.util
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("nvidia-pytriton is not installed (pip install nvidia-pytriton==0.7.0)")
    root = Path(spec.origin).parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise FileNotFoundError(f"{root}/bin/tritonserver not found in the nvidia-pytriton install")
    return root


def write_backend_dir(out: str | Path) -> Path:
    """A `--backend-directory` for tritonserver: pytriton's Python backend plus the stub for this Python."""
    root = pytriton_dir()
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"{stub}: nvidia-pytriton ships no Python backend stub for Python {ver}")
    dst = Path(out) / "python"
    dst.mkdir(parents=True, exist_ok=True)
    for f in (root / "backends" / "python").iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    shutil.copy2(stub, dst / stub.name)
    return Path(out)


def launch_env() -> dict[str, str]:
    """Environment for tritonserver and its stub: the wheel's bundled shared libraries on the loader path."""
    import os
    libs = pytriton_dir().parents[1] / "nvidia_pytriton.libs"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsflash triton-repo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="engine directory made by `dsflash build` (one rank)")
    p.add_argument("--out", required=True, help="model repository to write into (the model folders must not exist)")
    p.add_argument("--model-name", default="dsflash", help="Triton model name (the unary front is <name>_bls)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-bytes", type=int, default=None)
    kv.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, default=None)
    p.add_argument("--max-queue-size", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--batch-invariant", action="store_true",
                   help="a forward per request and step (as `dsflash serve --batch-invariant`)")
    p.add_argument("--extra-site-dir", action="append", default=[],
                   help="put this directory first on the stub's sys.path (e.g. one holding numpy 1.26); repeatable")
    p.add_argument("--backend-dir", default=None,
                   help="also write a Python-backend directory from nvidia-pytriton here (for --backend-directory)")
    a = p.parse_args(argv)
    from dsflash.build.engine import EngineError
    try:
        repo = write_repo(a.engine, a.out, a.model_name, kv_cache_bytes=a.kv_cache_bytes,
                          kv_cache_free_gpu_mem_fraction=a.kv_cache_free_gpu_mem_fraction,
                          max_queue_size=a.max_queue_size, max_batch_size=a.max_batch_size,
                          extra_site_dirs=a.extra_site_dir, batch_invariant=a.batch_invariant)
        backends = write_backend_dir(a.backend_dir) if a.backend_dir else None
    except (EngineError, OSError) as e:
        print(f"dsflash triton-repo: {e}", file=sys.stderr)
        return 2
    print(f"wrote {repo}: models '{a.model_name}' (decoupled, streaming) and '{a.model_name}_bls' (unary)")
    if backends is not None:
        libs = pytriton_dir().parents[1] / "nvidia_pytriton.libs"
        print(f"start it with:\n  LD_LIBRARY_PATH={libs} {pytriton_dir() / 'bin' / 'tritonserver'} "
              f"--model-repository={repo.resolve()} --backend-directory={Path(backends).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
