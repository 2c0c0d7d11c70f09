# pyoffcpu: `sudo make demo` and `sudo make test` do every setup step themselves.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# bcc lives in Debian's python3 (python3-bpfcc): the venv is made from it and sees it.
SYSTEM_PYTHON ?= /usr/bin/python3
PYTEST_ARGS ?=

.PHONY: install demo test bench root clean helper deb bpf-objects wheel

# The BPF programs the package ships (pytool/pyoffcpu/bpfobj/), compiled by bcc
# from bpf/: run after changing bpf/ and commit the result; the tests fail
# while they differ from a rebuild (tests/test_shipped_bpf.py).  Where they are
# stale or do not load, pyoffcpu compiles on the target with bcc instead.
bpf-objects: $(VENV)/.installed
	$(PY) tools/build_bpf_objects.py

# The compiled helper (pytool/pyoffcpu/native/helper/): the unwind tables and symbol
# indexes of a target's libraries, built against the venv's own capstone (the
# same decoder the Python side uses, so both give the same rows).  It dlopens
# libcapstone.so: pyoffcpu starts it with LD_LIBRARY_PATH at its Python's
# capstone/lib, and its RUNPATH is where a wheel's install puts that (no path
# of this machine goes into the binary).
HELPER_DIR := pytool/pyoffcpu/native/helper
HELPER := $(HELPER_DIR)/pyoffcpu-elf
HELPER_SRC := $(wildcard $(HELPER_DIR)/*.c $(HELPER_DIR)/*.h)
CAPSTONE_DIR = $(shell $(PY) -c 'import capstone, os; print(os.path.dirname(capstone.__file__))')

$(HELPER): $(HELPER_SRC) $(VENV)/.installed
	$(CC) -O2 -g -Wall -Wextra -std=gnu11 -I$(CAPSTONE_DIR)/include -o $@ $(filter %.c,$(HELPER_SRC)) \
		-ldl -Wl,-rpath,'$$ORIGIN/../../../capstone/lib'

helper: $(HELPER)

root:
	@[ "$$(id -u)" = 0 ] || { echo "make: pyoffcpu needs root: run 'sudo make $(or $(MAKECMDGOALS),install)'" >&2; exit 1; }

$(VENV)/.installed: pyproject.toml
	$(SYSTEM_PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -c 'import bcc, elftools, click' || { echo "make: the venv cannot import bcc (python3-bpfcc)" >&2; exit 1; }
	touch $@

# Byte-compiled here, every time (up-to-date files are skipped): a start
# that compiled pyoffcpu's modules itself would spend ~70 ms on it whenever
# PYTHONDONTWRITEBYTECODE is set or the tree is not writable.
install: root
	tools/setup-system.sh
	@$(MAKE) --no-print-directory $(VENV)/.installed
	@$(MAKE) --no-print-directory helper
	@$(PY) -m compileall -q pytool/pyoffcpu
	@echo "pyoffcpu installed: $(VENV)/bin/pyoffcpu"

# The debug symbols of the Python the demo runs (Debian's python3.X-dbg), so
# that the interpreter's own functions have names in demo.svg; python3-dbg
# (the default Python's) while there is no $(SYSTEM_PYTHON) yet.
DEMO_DBG = $(or $(shell $(SYSTEM_PYTHON) -c 'import sys; print("python%d.%d-dbg" % sys.version_info[:2])' 2>/dev/null),python3-dbg)

demo: root
	tools/setup-system.sh $(DEMO_DBG)
	@$(MAKE) --no-print-directory $(VENV)/.installed
	@$(MAKE) --no-print-directory helper
	$(VENV)/bin/pyoffcpu -o demo.svg -- $(PY) tools/demo_app.py 6
	@echo "open demo.svg in a browser"

# build-chroot.sh: Debian testing's 3.14/3.14d and a free-threaded 3.13t in a cached
# chroot (first run ~8 min, then instant); its debootstrap downloads with wget;
# `bookworm`: a plain Debian 12 root the .deb is installed into (tests/test_packaging.py).
test: root
	tools/setup-system.sh chromium python3.11-dbg wget golang-go tmux libomp5-14 zstd lz4 gdb
	tools/build-chroot.sh
	tools/build-chroot.sh bookworm
	@$(MAKE) --no-print-directory $(VENV)/.installed
	@$(MAKE) --no-print-directory helper
	$(PY) -m pytest -v -rs $(PYTEST_ARGS) tests

# dist/pyoffcpu_<version>_amd64.deb: pyoffcpu as a system tool over Debian 12's own packages
# (tools/build_deb.py: man pages and completion made from --help itself; the
# compiled helper with the capstone library it decodes with)
deb: $(VENV)/.installed $(HELPER)
	$(PY) tools/build_deb.py dist

# dist/pyoffcpu-<version>-py3-none-linux_x86_64.whl: everything a target needs (the
# compiled BPF programs, the helper; capstone, pyelftools and click from PyPI): no
# bcc, compiler or kernel headers where it is installed
wheel: $(VENV)/.installed helper
	rm -rf build
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .

# make bench [BENCH_REV=HEAD] [BENCH_LONG_S=600] [BENCH_PAIRS=7] [BENCH_ARGS="--cases 1,5"]: see tools/bench/run.py
bench: install
	$(PY) tools/bench/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info demo.svg $(HELPER)
