# The two commands of the README. Both create .venv and install everything on a fresh machine.
# torch is pinned *before* the project so pip never resolves a bare torch (a multi-GB CUDA build).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
# LitData (the streaming-loader tests) without its dependencies: it requires torchvision (image decoding only), and
# resolving that replaces the CPU torch with the newest CUDA build (or, pinned, installs a CUDA torchvision that
# fails to import beside a CPU torch, and with it torchmetrics and Lightning). Its other dependencies are in [test].
LITDATA := litdata>=0.2.76,<0.2.77
# torchdata (StatefulDataLoader, the loader tests) likewise without its dependencies: it requires a bare torch, which
# a resolver may take for the newest CUDA build. Its other dependencies (requests, urllib3) are in [test].
TORCHDATA := torchdata>=0.11.0,<0.12

.PHONY: demo demo-pipeline demo-sharded demo-experts demo-dualpipe test test-gpu setup browser clean bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps "$(LITDATA)"
	$(PY) -m pip install --quiet --no-deps "$(TORCHDATA)"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/lightning-ciuic fit --config examples/configs/demo.yaml

# The main job with pipeline parallelism (pp=2 x tp=2): same model, only the strategy's arguments differ.
demo-pipeline: setup
	$(VENV)/bin/lightning-ciuic fit --config examples/configs/pipeline.yaml

# The main job with sharded data parallelism (FSDP2 dp_shard=2 x tp=2): same model, only the strategy's arguments differ.
demo-sharded: setup
	$(VENV)/bin/lightning-ciuic fit --config examples/configs/sharded.yaml

demo-experts: setup
	$(VENV)/bin/lightning-ciuic fit --config examples/configs/experts.yaml

# DeepSeek-V3's way at the demo's size: pp=2 x dp=2 with the experts sharded, DualPipeV with its pairs overlapped.
demo-dualpipe: setup
	$(VENV)/bin/lightning-ciuic fit --config examples/configs/dualpipe.yaml

# The browser test renders the monitor's report in headless Chromium: Debian's package, installed here where apt
# can (as root); without it that one test is skipped, and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  apt-get install -y -qq chromium >/dev/null 2>&1 || \
	  (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1) || \
	  echo "note: could not install chromium (apt-get install chromium); the report's browser test will be skipped"

# Two pytest workers (pytest-xdist), each taking the next test when it is free: on 2 cores the suite's multi-process
# tests leave a core idle about half of the time. The tests that act on measured time (marker `serial`: the elastic
# scenarios' rendezvous deadlines, the data balancer's step times) then run alone. `make test PYTEST_WORKERS=0` runs the first part in one process too.
PYTEST_WORKERS ?= 2
test: setup browser
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal -m "not serial" tests
	$(PY) -m pytest -m serial tests

# The GPU smoke suite (tests/gpu; it skips without CUDA, and its multi-rank cases below two GPUs). It installs
# nothing: run it with a Python whose torch has CUDA and the project installed (`pip install -e ".[test]"`),
# e.g. `make test-gpu GPU_PYTHON=python3`.
GPU_PYTHON ?= $(PY)
test-gpu:
	$(GPU_PYTHON) -m pytest tests/gpu -rs

# Every benchmark; each rewrites its section of docs/benchmarks.md (compression.py needs root for netns + tc).
bench: setup
	$(PY) benchmarks/strategy_vs_ddp.py
	$(PY) benchmarks/lr_schedule.py
	$(PY) benchmarks/sync_failures.py
	$(PY) benchmarks/compression.py
	$(PY) benchmarks/data_balance.py --steps 60 --settle 25 --rounds 3
	$(PY) benchmarks/monitor.py --steps 25 --rounds 3 --batch 4 --overhead-steps 80
	$(PY) benchmarks/checkpoint.py --steps 90 --every 30 --rounds 3
	$(PY) benchmarks/recovery.py --model xl --rounds 2
	$(PY) benchmarks/elastic.py --rounds 2
	$(PY) benchmarks/pipeline.py --steps 16 --rounds 2
	$(PY) benchmarks/pipeline.py --steps 12 --rounds 1 --batch 64 --bubble-only
	$(PY) benchmarks/sharding.py --steps 30 --rounds 3 --model large

clean:
	rm -rf $(VENV) lightning_logs demo_logs .pytest_cache
