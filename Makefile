# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard 0*/*.ipynb))

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-fast lab bench models editor-model mutants clean

install: $(STAMP)

# torch goes in first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $(STAMP)

# The engine on the tiny model (the Chapter 1 waste table: `$(PY) -m mini_vllm.paged_attention.waste`).
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m mini_vllm.demo

# The whole suite: unit and property tests, Triton kernels (interpreted without CUDA), notebooks.
test: $(STAMP)
	@start=$$(date +%s); \
	$(PY) -m pytest -q tests $(if $(NOTEBOOKS),--nbmake --nbmake-timeout=600 $(NOTEBOOKS)); rc=$$?; \
	echo "make test wall time: $$(( $$(date +%s) - start )) s"; exit $$rc

test-fast: $(STAMP)
	$(PY) -m pytest -q tests

# Mutation testing (not part of `make test`): plants classic mistakes in the
# reference one at a time and checks that each chapter's tests catch every one.
mutants: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m mutants

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=.

bench: $(STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# Retrains the course's tiny target/draft models (about 2 minutes on one GPU; many hours on 2 CPU cores).
models: $(STAMP)
	$(PY) training/train_tiny_lm.py --out models

# Fine-tunes tiny-py-target into tiny-py-editor, which copies code (about 25 minutes on one CPU core).
editor-model: $(STAMP)
	$(PY) training/finetune_editor.py --out models/tiny-py-editor

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
