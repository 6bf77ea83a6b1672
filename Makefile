# Developer entry points. `make test` is what CI runs (after installing the package).
#
# The Python everything runs with: PY=... if given, else the active virtual environment's
# (VIRTUAL_ENV or CONDA_PREFIX), else ./.venv, which the set-up targets create (never the
# system's python3, where pip would install into the system or be refused).
ifeq ($(origin PY),undefined)
  ifneq ($(VIRTUAL_ENV),)
    PY := $(VIRTUAL_ENV)/bin/python
  else ifneq ($(CONDA_PREFIX),)
    PY := $(CONDA_PREFIX)/bin/python
  else
    PY := $(CURDIR)/.venv/bin/python
    MAKE_VENV := 1
  endif
endif
CC ?= gcc
CORE_SRC := $(filter-out csrc/python/% csrc/tests/%,$(wildcard csrc/*/*.c))
TEST_SRC := $(wildcard csrc/tests/test_*.c)
HEADERS := $(wildcard csrc/include/axc/*.h csrc/*/*.h)
TEST_HEADERS := $(wildcard csrc/tests/*.h csrc/tests/mock/*.h)
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wno-missing-field-initializers -Icsrc/include -g
LIBS := -ldl -lpthread -lrt -lm
BUILD := build/ctests

.PHONY: FORCE test test-c test-c-san test-mock test-py test-py-asan venv setup setup-demo setup-test \
	install demo bench clean

# the core is compiled once per flavour into a static library the tests link against
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
PLAIN_OBJS := $(patsubst csrc/%.c,$(BUILD)/plain/obj/%.o,$(CORE_SRC))
SAN_OBJS := $(patsubst csrc/%.c,$(BUILD)/san/obj/%.o,$(CORE_SRC))

# The CUDA/NCCL/cuBLASLt header flags setup.py finds (those `make setup-test` installs), so the
# C tests build the core as the extension is built; the file changes only when the flags do
CUDA_FLAGS_FILE := $(BUILD)/cuda_flags
$(CUDA_FLAGS_FILE): FORCE
	@mkdir -p $(dir $@)
	@AXONN_C_PRINT_CFLAGS=1 $(PY) setup.py > $@.new 2>/dev/null || : > $@.new
	@cmp -s $@.new $@ && rm $@.new || mv $@.new $@
CUDA_FLAGS = $(shell cat $(CUDA_FLAGS_FILE))

$(BUILD)/plain/obj/%.o: csrc/%.c $(HEADERS) $(CUDA_FLAGS_FILE)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(CUDA_FLAGS) -O1 -c -o $@ $<

$(BUILD)/san/obj/%.o: csrc/%.c $(HEADERS) $(CUDA_FLAGS_FILE)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(CUDA_FLAGS) -O1 $(SAN_FLAGS) -c -o $@ $<

$(BUILD)/plain/libaxc.a: $(PLAIN_OBJS)
	ar rcs $@ $^

$(BUILD)/san/libaxc.a: $(SAN_OBJS)
	ar rcs $@ $^

$(BUILD)/plain/%: csrc/tests/%.c $(BUILD)/plain/libaxc.a $(HEADERS) $(TEST_HEADERS)
	$(CC) $(CFLAGS_BASE) $(CUDA_FLAGS) -O1 -o $@ $< $(BUILD)/plain/libaxc.a $(LIBS)

$(BUILD)/san/%: csrc/tests/%.c $(BUILD)/san/libaxc.a $(HEADERS) $(TEST_HEADERS)
	$(CC) $(CFLAGS_BASE) $(CUDA_FLAGS) -O1 $(SAN_FLAGS) -o $@ $< $(BUILD)/san/libaxc.a $(LIBS)

PLAIN_BINS := $(patsubst csrc/tests/%.c,$(BUILD)/plain/%,$(TEST_SRC))
SAN_BINS := $(patsubst csrc/tests/%.c,$(BUILD)/san/%,$(TEST_SRC))

# the plain run also exercises the CPU GEMM through torch's library when torch is installed
TORCH_LIB = $(shell $(PY) -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_cpu.so'))" 2>/dev/null)

test-c: $(PLAIN_BINS)
	@set -e; for t in $(PLAIN_BINS); do echo "== $$t"; AXONN_C_TORCH_LIB=$(TORCH_LIB) $$t; done

test-c-san: $(SAN_BINS)
	@set -e; for t in $(SAN_BINS); do echo "== $$t (ASan+UBSan)"; \
	    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $$t; done

# The set-up, in two steps, each also right on a fresh machine. torch is the CPU build of
# torch==2.13.0 from PyTorch's CPU index, installed only where no torch is (never an unpinned
# torch: PyPI's Linux torch pulls gigabytes of CUDA wheels); an installed torch is kept.
# (Linux wheels of the CPU build carry "+cpu"; macOS's torch is CPU-only under the plain version)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU := $(if $(filter Linux,$(shell uname -s)),torch==2.13.0+cpu,torch==2.13.0) \
    --extra-index-url $(TORCH_CPU_INDEX)
# the NVIDIA header wheels the CUDA parts compile against (they only run on a GPU machine)
CUDA_HEADER_WHEELS := nvidia-nccl-cu13==2.28.9 nvidia-cuda-runtime nvidia-cuda-crt nvidia-cublas

.venv/bin/python:
	python3 -m venv .venv

venv: $(if $(MAKE_VENV),.venv/bin/python)

# what the demo runs with: torch (CPU), numpy (torch warns on import without it), tqdm, axonn_c
setup-demo: venv
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q numpy tqdm
	$(MAKE) install PY=$(PY)

# transformers for the GPT-2 and Llama tests (tests/workers/gpt2_worker.py,
# checkpoint_llama_worker.py; skipped without it) and the pure-Python packages it imports,
# pinned and installed with --no-deps: pip must never pull another torch
TRANSFORMERS_TEST_DEPS := transformers==5.24.0 huggingface-hub==2.4.0 tokenizers==0.23.3 \
    safetensors==0.8.0 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 \
    truststore==0.10.5 idna==3.13 regex==2026.5.9 pyyaml==6.0.3

# what the tests need on top: pytest, matplotlib (the planner's plots), the header wheels and
# transformers; then the package is rebuilt with its CUDA parts
setup-test: setup-demo
	$(PY) -m pip install -q pytest matplotlib $(CUDA_HEADER_WHEELS)
	$(PY) -m pip install -q --no-deps $(TRANSFORMERS_TEST_DEPS)
	$(MAKE) install PY=$(PY)

setup: setup-test

# setuptools and wheel are what pip's isolated build would fetch: installed once, the package
# then builds without the network (the C extension only; torch is not needed to build it)
install:
	$(PY) -c "import setuptools, wheel" 2>/dev/null || $(PY) -m pip install -q setuptools wheel
	$(PY) -m pip install -q --no-deps --no-build-isolation .

# pytest runs from tests/ so that `import axonn_c` finds the installed package, not the sources
test-py:
	cd tests && $(PY) -m pytest -q -ra .

# the CUDA paths (nccl backend, cuBLASLt GEMM) against CPU mocks of libcudart/libnccl/libcublasLt,
# plain and under ASan+UBSan: they compile everywhere and run here, though only a GPU runs them
# for real
test-mock:
	PYTHON=$(PY) bash csrc/tests/mock/run_mock_test.sh
	PYTHON=$(PY) bash csrc/tests/mock/run_gemm_mock_test.sh

# the multi-rank workers whose collectives write into torch tensors asynchronously, with the
# extension built under ASan (a write into a freed tensor fails the run)
test-py-asan:
	bash tests/run_asan_workers.sh $(PY)

test: setup-test test-c test-c-san test-mock test-py-asan test-py

demo: setup-demo
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 4 examples/train_gpt.py

bench: setup-test
	$(PY) benchmarks/bench_collectives.py --json benchmarks/results/collectives.json
	$(PY) benchmarks/bench_linear.py --json benchmarks/results/linear_cpu.json

clean:
	rm -rf build *.egg-info axonn_c/_C*.so
