# Developer entry points. `make test` is what CI runs (after installing the package).
PY ?= python3
CC ?= gcc
CORE_SRC := $(filter-out csrc/python/% csrc/tests/%,$(wildcard csrc/*/*.c))
TEST_SRC := $(wildcard csrc/tests/test_*.c)
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wno-missing-field-initializers -Icsrc/include -g
LIBS := -ldl -lpthread -lrt -lm
BUILD := build/ctests

.PHONY: test test-c test-c-san test-py install clean

$(BUILD)/plain/%: csrc/tests/%.c $(CORE_SRC) csrc/tests/ctest.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -O1 -o $@ $< $(CORE_SRC) $(LIBS)

$(BUILD)/san/%: csrc/tests/%.c $(CORE_SRC) csrc/tests/ctest.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -O1 -fsanitize=address,undefined -fno-sanitize-recover=all \
	    -fno-omit-frame-pointer -o $@ $< $(CORE_SRC) $(LIBS)

PLAIN_BINS := $(patsubst csrc/tests/%.c,$(BUILD)/plain/%,$(TEST_SRC))
SAN_BINS := $(patsubst csrc/tests/%.c,$(BUILD)/san/%,$(TEST_SRC))

test-c: $(PLAIN_BINS)
	@set -e; for t in $(PLAIN_BINS); do echo "== $$t"; $$t; done

test-c-san: $(SAN_BINS)
	@set -e; for t in $(SAN_BINS); do echo "== $$t (ASan+UBSan)"; \
	    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $$t; done

install:
	$(PY) -m pip install --no-deps .

test-py:
	$(PY) -m pytest -q tests

test: test-c test-c-san test-py

clean:
	rm -rf build *.egg-info axonn_c/_C*.so
