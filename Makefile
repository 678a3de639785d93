# Makefile: the project's commands. `make run` and `make test` work on a fresh
# Debian machine: they install what is missing first (scripts/deps.sh).
#
#   make build        configure and build build/ (RelWithDebInfo: -O2 -g)
#   make run          build, then the streaming benchmark: fixed vs expandable
#                     segments, out/stream.csv and a table (FRAMES="64 128 ...")
#   make test         build/ tests, then every test under ASan+UBSan (build-asan/),
#                     then the tests labelled stress or threads under TSan (build-tsan/)
#   make test-unit    only the first step; test-asan and test-tsan: the others.
#                     It installs torch and transformers (CPU use) into a cached
#                     virtual environment first (scripts/torch_venv.sh)
#   make gpu-test     the GPU tests of tests/gpu (build-gpu/), on a machine with CUDA;
#                     SANITIZE=1: the same under compute-sanitizer memcheck. Then
#                     the PyTorch tests of tests/torch (gpu-test-torch) with the
#                     python TIDE_PYTHON names (default python3); skipped, saying
#                     why, when it has no torch or torch sees no GPU
#   make fuzz         the libFuzzer targets of fuzz/ (build-fuzz/, clang), each for
#                     FUZZ_SECONDS (default 60); prints the executions reached.
#                     FUZZ_CSV=file appends them, FUZZ_TARGETS="conf ops" picks,
#                     FUZZ_JOBS=N runs N workers per target (their total counts)
#   make fuzz-stage   the same programs copied to fuzz-stage/ with the sources
#                     they were built from, to fuzz on another machine's cores
#   make install      install into PREFIX (default /usr/local; DESTDIR is honoured)
#   make format       clang-format every C file in place; format-check only checks
#   make clean        remove the build directories
#
# A test joins the ThreadSanitizer run by its name: a tests/test_*.c whose name
# contains "stress" or "thread" is labelled so (see CMakeLists.txt); the soak
# (`tidalloc soak` for a few seconds) is labelled threads there too.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := build

JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PREFIX ?= /usr/local
FRAMES ?= 64 128 256 512 1024
# Extra cmake options for every build, e.g. CMAKE_ARGS=-DTIDE_TEST_TIMEOUT=600.
CMAKE_ARGS ?=
# The sanitizer builds use clang: its runtimes are the ones deps.sh installs,
# and a second compiler catches what the first lets through.
SAN_CC ?= clang
SAN_CFLAGS_COMMON := -fno-omit-frame-pointer -fno-sanitize-recover=all
ASAN_CFLAGS := -fsanitize=address,undefined $(SAN_CFLAGS_COMMON)
TSAN_CFLAGS := -fsanitize=thread $(SAN_CFLAGS_COMMON)

# Sanitizer builds keep assertions (no -DNDEBUG) and optimize lightly.
SAN_CMAKE := -DCMAKE_C_COMPILER=$(SAN_CC) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
             -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" -DTIDE_WITH_MIMALLOC=OFF

# Sanitizer runtimes before LLVM 18 cannot start under the high address-space
# randomization of recent kernels (vm.mmap_rnd_bits > 28); running the tests
# without randomization avoids that where the system allows it.
NO_ASLR := $(shell setarch $$(uname -m) -R true >/dev/null 2>&1 && echo setarch $$(uname -m) -R)

export ASAN_OPTIONS ?= detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1
export UBSAN_OPTIONS ?= print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS ?= halt_on_error=1:second_deadlock_stack=1:detect_deadlocks=1

# cmake --build runs its own make: keep ours (jobserver, directory messages) out of it.
CMAKE_BUILD := env -u MAKEFLAGS -u MAKELEVEL -u MFLAGS cmake --build

CTEST := ctest --output-on-failure --no-tests=error -j$(JOBS)

.PHONY: all deps build run test test-unit test-asan test-tsan fuzz gpu-test gpu-test-cmake \
        gpu-test-make gpu-test-empty gpu-test-none gpu-test-torch install format format-check fuzz-stage \
        clean help

all: build

help:
	@sed -n '3,26s/^# \{0,1\}//p' Makefile

deps:
	@scripts/deps.sh

build: deps
	cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)
	$(CMAKE_BUILD) build -j$(JOBS)

run: build
	FRAMES="$(FRAMES)" scripts/run_stream.sh

# Every step runs even when an earlier one failed, so one run shows all the
# failures; the target fails if any step did.
test: build
	@start=$$(date +%s); failed=""; \
	for step in test-unit test-asan test-tsan; do \
	  $(MAKE) --no-print-directory $$step || failed="$$failed $$step"; \
	done; \
	echo "make test: $$(( $$(date +%s) - start )) s"; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed"; exit 1; fi; \
	echo "make test: all steps passed"

# The Python tests that need torch and transformers run with the python of a
# virtual environment kept outside the repository (scripts/torch_venv.sh:
# made once, about two minutes; TIDE_TORCH_VENV=off skips them).
test-unit: build
	@echo "== tests (build/)"
	@scripts/torch_venv.sh >/dev/null || echo "test-unit: no torch environment: the python_torch test skips"
	cd build && $(CTEST)

test-asan: deps
	@echo "== AddressSanitizer + UndefinedBehaviorSanitizer, every test (build-asan/)"
	cmake -S . -B build-asan $(SAN_CMAKE) -DCMAKE_C_FLAGS="$(ASAN_CFLAGS)" $(CMAKE_ARGS)
	$(CMAKE_BUILD) build-asan -j$(JOBS)
	cd build-asan && $(NO_ASLR) $(CTEST)

test-tsan: deps
	@echo "== ThreadSanitizer, tests labelled stress or threads (build-tsan/)"
	cmake -S . -B build-tsan $(SAN_CMAKE) -DCMAKE_C_FLAGS="$(TSAN_CFLAGS)" \
	  -DTIDE_BUILD_EXAMPLES=OFF $(CMAKE_ARGS)
	$(CMAKE_BUILD) build-tsan -j$(JOBS)
	@cd build-tsan && ctest -N -L 'stress|threads' | grep 'Total Tests: [1-9]' >/dev/null || { \
	  echo "test-tsan: no test is labelled stress or threads: name a tests/test_*.c" \
	       "*stress* or *thread* to run it under ThreadSanitizer" >&2; exit 1; }
	cd build-tsan && $(NO_ASLR) $(CTEST) -L 'stress|threads'

# The fuzz targets run under AddressSanitizer and UndefinedBehaviorSanitizer,
# each for FUZZ_SECONDS; the library is instrumented for coverage
# (fuzzer-no-link), the programs link libFuzzer (CMakeLists.txt, TIDE_FUZZ).
FUZZ_SECONDS ?= 60
FUZZ_CSV ?=
FUZZ_TARGETS ?=
FUZZ_JOBS ?= 1
FUZZ_CFLAGS := -fsanitize=fuzzer-no-link,address,undefined $(SAN_CFLAGS_COMMON)
# -O2, not the -O1 of the other sanitizer builds: the sweeps of the
# consistency check that fuzz_ops runs after every step (bin heads, page
# tables) become vector code: a replay of a corpus ran 1.2 times the inputs
# per CPU-second (bench/results/history/host/fuzz_ops_speed.md).
FUZZ_CMAKE := $(SAN_CMAKE) -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g"

fuzz: deps
	@echo "== libFuzzer targets, $(FUZZ_SECONDS) s each (build-fuzz/)"
	cmake -S . -B build-fuzz $(FUZZ_CMAKE) -DCMAKE_C_FLAGS="$(FUZZ_CFLAGS)" -DTIDE_FUZZ=ON \
	  -DTIDE_BUILD_TESTS=OFF -DTIDE_BUILD_TOOLS=OFF -DTIDE_BUILD_EXAMPLES=OFF $(CMAKE_ARGS)
	$(CMAKE_BUILD) build-fuzz -j$(JOBS)
	FUZZ_SECONDS=$(FUZZ_SECONDS) NO_ASLR="$(NO_ASLR)" FUZZ_CSV="$(FUZZ_CSV)" \
	  FUZZ_TARGETS="$(FUZZ_TARGETS)" FUZZ_JOBS="$(FUZZ_JOBS)" scripts/fuzz.sh build-fuzz

# The fuzz programs built from the committed sources and copied to fuzz-stage/
# with what they were built from, to run on another machine's cores
# (bench/torch/gpu_stream_session.sh's fuzz lane, with fuzz-stage carried).
fuzz-stage: deps
	cmake -S . -B build-fuzz $(FUZZ_CMAKE) -DCMAKE_C_FLAGS="$(FUZZ_CFLAGS)" -DTIDE_FUZZ=ON \
	  -DTIDE_BUILD_TESTS=OFF -DTIDE_BUILD_TOOLS=OFF -DTIDE_BUILD_EXAMPLES=OFF $(CMAKE_ARGS)
	$(CMAKE_BUILD) build-fuzz -j$(JOBS)
	scripts/fuzz_stage.sh build-fuzz fuzz-stage "$(or $(FUZZ_TARGETS),ops)"

# tests/gpu holds the GPU tests: a CMakeLists.txt that the root project adds
# with -DTIDE_GPU_TESTS=ON (it enables CUDA, links tidalloc_static and labels
# its tests "gpu", and "gpu-memcheck" for the same under compute-sanitizer),
# or a Makefile with a `test` target that is given the source tree and a built
# build/ (TIDALLOC_SRC, TIDALLOC_BUILD). SANITIZE=1 runs the gpu-memcheck tests.
# Only the compilers are installed here: CUDA is the machine's.
SANITIZE ?= 0
GPU_LABEL := $(if $(filter 1,$(SANITIZE)),^gpu-memcheck$$,^gpu$$)

GPU_TESTS_KIND := $(if $(wildcard tests/gpu/CMakeLists.txt),cmake,$(if \
                  $(wildcard tests/gpu/Makefile),make,$(if $(wildcard tests/gpu),empty,none)))

# Both steps run even when the first failed; the target fails if either did.
gpu-test:
	@failed=""; \
	$(MAKE) --no-print-directory gpu-test-$(GPU_TESTS_KIND) || failed="$$failed gpu-test-$(GPU_TESTS_KIND)"; \
	$(MAKE) --no-print-directory gpu-test-torch || failed="$$failed gpu-test-torch"; \
	if [ -n "$$failed" ]; then echo "make gpu-test: FAILED:$$failed"; exit 1; fi; \
	echo "make gpu-test: all steps passed"

gpu-test-cmake:
	@scripts/deps.sh gpu
	cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIDE_GPU_TESTS=ON \
	  -DTIDE_BUILD_TESTS=OFF -DTIDE_BUILD_TOOLS=OFF -DTIDE_BUILD_EXAMPLES=OFF $(CMAKE_ARGS)
	$(CMAKE_BUILD) build-gpu -j$(JOBS)
	cd build-gpu && ctest --output-on-failure --no-tests=error -L '$(GPU_LABEL)'

gpu-test-make: build
	$(MAKE) -C tests/gpu test TIDALLOC_SRC="$(CURDIR)" TIDALLOC_BUILD="$(CURDIR)/build" \
	  SANITIZE=$(SANITIZE)

# The PyTorch tests (tests/torch/run_gpu_tests.sh says which) load the shared
# library through ctypes: build-torch/ builds only that, with no CUDA compiler.
# They are not run under compute-sanitizer (SANITIZE=1): that is for the C tests.
TIDE_PYTHON ?= python3

gpu-test-torch:
	@if [ "$(SANITIZE)" = 1 ]; then \
	  echo "gpu-test-torch: not run with SANITIZE=1 (the torch tests are not for compute-sanitizer)"; \
	elif TIDE_PYTHON="$(TIDE_PYTHON)" tests/torch/run_gpu_tests.sh --check; then \
	  scripts/deps.sh gpu; \
	  cmake -S . -B build-torch -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIDE_BUILD_TESTS=OFF \
	    -DTIDE_BUILD_TOOLS=OFF -DTIDE_BUILD_EXAMPLES=OFF $(CMAKE_ARGS); \
	  $(CMAKE_BUILD) build-torch -j$(JOBS) --target tidalloc; \
	  TIDE_PYTHON="$(TIDE_PYTHON)" TIDALLOC_LIB="$(CURDIR)/build-torch/libtidalloc.so" \
	    tests/torch/run_gpu_tests.sh; \
	fi

gpu-test-empty:
	@echo "gpu-test: tests/gpu has neither a CMakeLists.txt nor a Makefile" >&2; exit 1

gpu-test-none:
	@echo "gpu-test: no GPU tests yet (tests/gpu does not exist)" >&2; exit 1

install: build
	cmake --install build --prefix "$(PREFIX)"

C_FILES = $(shell find src tools tests examples include fuzz bench python \( -name '*.[ch]' -o -name '*.cpp' -o -name '*.cu' \) 2>/dev/null | sort)

format:
	@scripts/deps.sh format
	clang-format -i $(C_FILES)

format-check:
	@scripts/deps.sh format
	clang-format --dry-run --Werror $(C_FILES)

clean:
	rm -rf build build-asan build-tsan build-gpu build-torch build-fuzz
