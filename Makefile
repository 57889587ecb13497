# Two commands on a fresh machine (see README.md):
#   make demo   - create .venv, install, train the demo job on a local Ray cluster
#   make test   - create .venv, install, run every test tier that runs on this machine
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# `make test` runs the test files on three pytest-xdist workers, each file whole on one worker, in two
# lanes: one worker takes the Ray files first, the others the dist, k8s and unit files first
# (tests/conftest.py: [Note: file order under xdist]); PYTEST_WORKERS=0 runs them serially. Two or three
# local Rays at once are safe: they only slowed each other on Ray's fixed dashboard-agent port
# (tests/testkit/local_ray.py). Measured on the shared 2-core development machine, pytest's wall
# time: serially 2245 s without the k8s tier (a load average of 9-12 alongside); on 2 workers 909 s
# before the 2026-11-26 cuts, 819 s after them; one queue for both workers 753 s and 699 s (11-27); two lanes, with the
# memory tests' ranks forked (tests/testkit/harness.py), 652 s and 654 s for 1,337 tests, about
# 1,100 CPU-seconds of every process the run starts (process accounting; the last CI run took
# 930 s for all of `make test` on a fresh clone, ~160 s of it installing and building). Three workers
# and the slowest Ray files first: 622 s against 700 s on two, back to back on the same commits
# (2026-11-27; idle core-seconds 47 against 172).
PYTEST_WORKERS ?= 3
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: venv s3-venv deepspeed-ops demo test test-long test-all test-unit test-dist test-ray test-k8s fuzz lint docs-check crd-check k8s-envtest bench clean

venv: $(STAMP)

# torch first, pinned: any looser spec pulls several GB of CUDA wheels on this kind of machine.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	# DeepSpeed is the oracle of the fidelity, loss-scaler, scheduler and import tests; no ops built.
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e ".[dev,k8s,monitor,hf,lightning,plot,bench]"
	touch $(STAMP)

# moto's S3 server for tests/ray/test_faults_s3.py, in a venv of its own: moto's botocore needs
# python-dateutil<3 and the kubernetes client in .venv needs >=3. The test starts its moto_server on
# 127.0.0.1 (a free port) and skips, saying so, when this venv is missing.
S3_VENV := .venv-s3
s3-venv: $(S3_VENV)/.installed

$(S3_VENV)/.installed:
	$(PYTHON) -m venv $(S3_VENV)
	$(S3_VENV)/bin/pip install -q "moto[server]>=5.1,<6"
	touch $@

demo: $(STAMP)
	$(BIN)/rayzero demo

lint: $(STAMP)
	$(BIN)/lint-imports

docs-check: $(STAMP)
	$(BIN)/python -m rayzero.config.docs --check docs/config.md
	$(BIN)/python -m rayzero.config.environment_docs --check docs/environment.md
	$(BIN)/python scripts/doc_tables.py --check
	$(BIN)/python bench/scale.py --doc docs/scale.md --check
	$(BIN)/python bench/comm_model.py --doc docs/scale.md --check

# The RayZeroJob CRD is generated from rayzero/config/k8s_job.py, deploy/rbac.yaml from the chart.
crd-check: $(STAMP)
	$(BIN)/python -m rayzero_operator.crd --check
	$(BIN)/python scripts/k8s_envtest_render.py --check

# Builds kube-apiserver 1.20 from Debian's source once (~5 min), cached in ~/.cache/rayzero; installs etcd.
k8s-envtest:
	bash scripts/k8s_envtest_build.sh

# DeepSpeed's CPU kernels (the tests' oracles) built before the tests, not inside the first test that
# needs them: ~90 s on a fresh machine (2 cores), a second once cached (scripts/build_deepspeed_ops.py).
deepspeed-ops: $(STAMP)
	$(BIN)/python scripts/build_deepspeed_ops.py

# `make test` leaves out the long tier's end-to-end scenarios ([Note: the long tier], tests/long_tier.py:
# each listed with the test here that covers its capability); `make test-long` runs them, `make test-all`
# runs everything.
test: $(STAMP) k8s-envtest s3-venv deepspeed-ops
	$(MAKE) lint docs-check crd-check
	$(BIN)/python -m pytest $(XDIST) -m "not long" --durations=40 $(PYTEST_ARGS)

test-long: $(STAMP) s3-venv deepspeed-ops
	$(BIN)/python -m pytest $(XDIST) -m long $(PYTEST_ARGS)

test-all: $(STAMP) k8s-envtest s3-venv deepspeed-ops
	$(MAKE) lint docs-check crd-check
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest -m unit $(PYTEST_ARGS)

test-dist: $(STAMP)
	$(BIN)/python -m pytest -m dist $(PYTEST_ARGS)

test-ray: $(STAMP) s3-venv
	$(BIN)/python -m pytest -m ray $(PYTEST_ARGS)

test-k8s: $(STAMP) k8s-envtest
	$(BIN)/python -m pytest -m k8s $(PYTEST_ARGS)

# The property-based fuzz targets of tests/fuzz, long: RAYZERO_FUZZ_FACTOR (default 50) times the
# examples `make test` runs, random (not derandomized), failures kept in .hypothesis/ and replayed
# first. Prints examples per target.
fuzz: $(STAMP)
	RAYZERO_FUZZ_PROFILE=fuzz $(BIN)/python -m pytest tests/fuzz --timeout=0 --hypothesis-show-statistics $(PYTEST_ARGS)

bench: $(STAMP)
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python bench/engine.py --quick --json bench/engine-quick.json

clean:
	rm -rf $(VENV) $(S3_VENV) build *.egg-info
