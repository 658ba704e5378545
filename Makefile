PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

VLLM_VENV := .venv-vllm
BFCL_VENV := .venv-bfcl

.PHONY: install test demo demo-real bench bench-data lint clean vllm bfcl

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	# torch first: the pinned CPU wheel, never a CUDA build pulled in by a dependency
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# vLLM in its own environment (it cannot share prefect's fastapi), built once per machine.
$(VLLM_VENV)/.installed: scripts/vllm_env.sh
	scripts/vllm_env.sh

vllm: $(VLLM_VENV)/.installed

# BFCL v4's checker in its own environment (bfcl-eval pins numpy 1.26.4 and every vendor SDK),
# built once per machine; envs/bfcl/ runs its grader server and exports from it.
$(BFCL_VENV)/.installed: scripts/bfcl_env.sh
	scripts/bfcl_env.sh

bfcl: $(BFCL_VENV)/.installed

# The model families' real vocabularies, templates and tiny models, built once per machine
# from the package index (tests/model_families.py), before any test waits on a download.
# Two test workers, a file each at a time: most tests wait on servers and subprocesses, and
# one worker left a core idle (40 min against 22 on 2 cores).
test: $(STAMP) $(VLLM_VENV)/.installed $(BFCL_VENV)/.installed
	$(BIN)/python -m tests.model_families
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/agentrft demo

# A real pretrained model (SmolLM2-135M-Instruct from the package index) on the units environment.
demo-real: $(STAMP)
	$(BIN)/agentrft demo-real

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	$(BIN)/python benchmarks/run_all.py

bench-data: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	$(BIN)/python benchmarks/run_all.py --only data_scaling

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(BFCL_VENV) mlruns mlflow.db .prefect-home .pytest_cache runs
