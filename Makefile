# Developer entry points. `make test` is what CI runs (after installing the package).
PY ?= python3
CC ?= gcc
CORE_SRC := $(filter-out csrc/python/% csrc/tests/%,$(wildcard csrc/*/*.c))
TEST_SRC := $(wildcard csrc/tests/test_*.c)
HEADERS := $(wildcard csrc/include/axc/*.h)
TEST_HEADERS := $(wildcard csrc/tests/*.h csrc/tests/mock/*.h)
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wno-missing-field-initializers -Icsrc/include -g
LIBS := -ldl -lpthread -lrt -lm
BUILD := build/ctests

.PHONY: test test-c test-c-san test-mock test-py test-py-asan setup install demo bench clean

# the core is compiled once per flavour into a static library the tests link against
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
PLAIN_OBJS := $(patsubst csrc/%.c,$(BUILD)/plain/obj/%.o,$(CORE_SRC))
SAN_OBJS := $(patsubst csrc/%.c,$(BUILD)/san/obj/%.o,$(CORE_SRC))

$(BUILD)/plain/obj/%.o: csrc/%.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -O1 -c -o $@ $<

$(BUILD)/san/obj/%.o: csrc/%.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -O1 $(SAN_FLAGS) -c -o $@ $<

$(BUILD)/plain/libaxc.a: $(PLAIN_OBJS)
	ar rcs $@ $^

$(BUILD)/san/libaxc.a: $(SAN_OBJS)
	ar rcs $@ $^

$(BUILD)/plain/%: csrc/tests/%.c $(BUILD)/plain/libaxc.a $(HEADERS) $(TEST_HEADERS)
	$(CC) $(CFLAGS_BASE) -O1 -o $@ $< $(BUILD)/plain/libaxc.a $(LIBS)

$(BUILD)/san/%: csrc/tests/%.c $(BUILD)/san/libaxc.a $(HEADERS) $(TEST_HEADERS)
	$(CC) $(CFLAGS_BASE) -O1 $(SAN_FLAGS) -o $@ $< $(BUILD)/san/libaxc.a $(LIBS)

PLAIN_BINS := $(patsubst csrc/tests/%.c,$(BUILD)/plain/%,$(TEST_SRC))
SAN_BINS := $(patsubst csrc/tests/%.c,$(BUILD)/san/%,$(TEST_SRC))

# the plain run also exercises the CPU GEMM through torch's library when torch is installed
TORCH_LIB = $(shell $(PY) -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_cpu.so'))" 2>/dev/null)

test-c: $(PLAIN_BINS)
	@set -e; for t in $(PLAIN_BINS); do echo "== $$t"; AXONN_C_TORCH_LIB=$(TORCH_LIB) $$t; done

test-c-san: $(SAN_BINS)
	@set -e; for t in $(SAN_BINS); do echo "== $$t (ASan+UBSan)"; \
	    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $$t; done

# Everything a fresh CPU machine needs: the CPU torch on disk (never an unpinned torch, which
# would pull gigabytes of CUDA wheels), test tools, and the CUDA/NCCL/cuBLAS headers that let the
# GPU parts compile here too (they only run on a GPU machine).
setup:
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q pytest numpy tqdm matplotlib nvidia-nccl-cu13==2.28.9 \
	    nvidia-cuda-runtime nvidia-cuda-crt nvidia-cublas
	$(MAKE) install

install:
	$(PY) -m pip install -q --no-deps .

# pytest runs from tests/ so that `import axonn_c` finds the installed package, not the sources
test-py:
	cd tests && $(PY) -m pytest -q -ra .

# the CUDA paths (nccl backend, cuBLASLt GEMM) against CPU mocks of libcudart/libnccl/libcublasLt,
# plain and under ASan+UBSan: they compile everywhere and run here, though only a GPU runs them
# for real
test-mock:
	bash csrc/tests/mock/run_mock_test.sh
	bash csrc/tests/mock/run_gemm_mock_test.sh

# the multi-rank workers whose collectives write into torch tensors asynchronously, with the
# extension built under ASan (a write into a freed tensor fails the run)
test-py-asan:
	bash tests/run_asan_workers.sh $(PY)

test: setup test-c test-c-san test-mock test-py-asan test-py

demo: setup
	torchrun --standalone --nproc_per_node 4 examples/train_gpt.py

bench: setup
	$(PY) benchmarks/bench_collectives.py --json benchmarks/results/collectives.json
	$(PY) benchmarks/bench_linear.py --json benchmarks/results/linear_cpu.json

clean:
	rm -rf build *.egg-info axonn_c/_C*.so
