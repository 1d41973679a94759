# smp-book: the two entry points are `make book` (the main job) and `make test`.
# Plain python3 -m venv + pip (no conda needed); the venv is created when missing and reused otherwise.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SCALE  ?= laptop
# Notebooks of the book, in order (jupytext MyST sources in notebooks/; chapters notebooks/NAME of _toc.yml).
# SCALE_FREE: notebooks that take no scale (they run the library live, at one size); make test runs them once, in
# the book under -W, and nbval runs the others at ci scale.
SCALE_FREE ?= usage
NOTEBOOKS ?= usage toy toy_baselines toy_kfac toy_tail mnist mnist_baselines last_layer mnist_seeds mnist_growth mnist_kfac mnist_tail regression summary how_to_run reproduction
STAMP  := $(VENV)/.installed-stamp
# Jupyter Book's cache of the executed notebooks (keyed by their code cells only), and what their outputs also
# depend on (the results the book shows, at laptop and paper scale; the code; the saved benchmark outputs; the
# venv's install stamp, so that new packages run every notebook again, usage included, which only the book runs):
# when anything there is newer than the cache's stamp, `make book` empties the cache first.
JB_CACHE    := _build/.jupyter_cache
BOOK_INPUTS := $(wildcard results/laptop results/paper) smp_book smp_core benchmarks $(STAMP)

.PHONY: book reproduce test unit-then-book venv lint unit unit-capabilities nbval mathjax browser-deps browser-test bench bench-smoke clean

venv: $(STAMP)

# The installed packages are byte-compiled once, on both cores (about 45 s): where PYTHONDONTWRITEBYTECODE is set,
# as on the machines this book is built on, Python otherwise compiles torch, JAX and the rest from source in every
# process it starts (about 8 s of CPU for `import torch, jax`), and make test starts about a hundred. The one file
# left out is torch's test of Python 3.12 syntax, which 3.11 cannot compile.
$(STAMP): pyproject.toml smp_book/pyproject.toml smp_book/constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -c smp_book/constraints.txt -e ".[fast]" -e "./smp_book[dev]"
	$(BIN)/python -m compileall -q -j 0 -x py312_intrinsics \
	  "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	@touch $(STAMP)

## make book: `jupyter-book build book` (sources in book/, output in _build/html). Jupyter Book runs each notebook
## at its default scale, laptop, with SMP_BOOK_READ_ONLY=1: the chapters show the committed results/laptop/, and
## one whose results are missing or were computed with other settings fails (a warning, an error under -W) instead
## of computing for hours; the build goes on (--keep-going) and exits non-zero. --all: Sphinx reads every page
## again (a notebook comes from the cache unless its code or BOOK_INPUTS changed), or a page that failed before
## and did not change would not be read, nor its notebook run, and the build would pass.
book: venv mathjax
	@if [ -d $(JB_CACHE) ] && { [ ! -f $(JB_CACHE).stamp ] || \
	    [ -n "$$(find $(BOOK_INPUTS) -newer $(JB_CACHE).stamp -not -path '*/__pycache__*' -print -quit)" ]; }; then \
	  echo "results/ or the code changed since the notebooks' outputs were cached: they run again"; \
	  rm -rf $(JB_CACHE); \
	fi
	@mkdir -p _build && touch $(JB_CACHE).stamp && rm -rf _build/html
	SMP_BOOK_READ_ONLY=1 $(BIN)/jupyter-book build book --all -W -n --keep-going

## make reproduce: recompute every chapter at SCALE (progress on the terminal; resumable), write the
## reproduction report beside the committed results, replace results/SCALE/ once complete, build the book
## (which shows results/laptop/). SEED_OFFSET=N: the chapters with a seed (toy, MNIST) on other random streams,
## without the caches, judged against the committed spread; a report only (results/SCALE/reproduction-seed-N/).
reproduce: venv mathjax
	$(BIN)/python -m smp_book.mnist data
	$(BIN)/python -m smp_book.reproduce --scale $(SCALE) $(if $(SEED_OFFSET),--seed-offset $(SEED_OFFSET))
	$(MAKE) book

## make test: ruff, pytest, each notebook run once: at ci scale under nbval (computing results/ci/), or, for the
## SCALE_FREE ones, in the book readers get (make book: the laptop notebooks from the committed results only,
## -W -n), which is then opened in a browser.
## pytest then the book, and nbval, run side by side with one thread each (they share no file: nbval's JAX
## programs go to a folder of their own, since JAX writes its cache unlocked); each line of output is kept whole.
test: venv mathjax
	$(BIN)/python -m smp_book.mnist data
	$(MAKE) lint
	OMP_NUM_THREADS=1 $(MAKE) -j2 --output-sync=line unit-then-book nbval
	$(MAKE) browser-deps
	$(MAKE) browser-test

unit-then-book:
	$(MAKE) unit
	$(MAKE) book

lint:
	$(BIN)/ruff check .

unit:
	$(BIN)/python -m pytest -q --durations=15 tests --ignore=tests/book/test_book_browser.py

## make unit-capabilities: pytest under ATen's portable kernels and its AVX2 ones (make unit takes the CPU's best,
## AVX-512 where it has it), side by side with one thread each (on 2 cores 1.4 times as fast as one after the other),
## each with JAX's compiled programs in a folder of its own (JAX writes them unlocked): no test may depend on which
## kernels torch picks.
unit-capabilities: venv
	OMP_NUM_THREADS=1 $(MAKE) -j2 -O capability-default capability-avx2

capability-%:
	ATEN_CPU_CAPABILITY=$* JAX_COMPILATION_CACHE_DIR=.cache/jax-$* $(BIN)/python -m pytest -q -p no:cacheprovider \
	  tests --ignore=tests/book/test_book_browser.py

# Each notebook but the SCALE_FREE ones once at ci scale: jupytext converts it (into the gitignored build folder),
# papermill injects scale = "ci" without running it (--prepare-only), and nbval runs it, failing on any error
# (outputs not compared).
NBVAL_NOTEBOOKS = $(filter-out $(SCALE_FREE),$(NOTEBOOKS))
nbval: venv
	@mkdir -p build/notebooks
	@for nb in $(NBVAL_NOTEBOOKS); do \
	  $(BIN)/jupytext --quiet --to ipynb notebooks/$$nb.md -o build/notebooks/$$nb.ipynb || exit 1; \
	  $(BIN)/papermill --log-level WARNING --prepare-only -k python3 build/notebooks/$$nb.ipynb \
	    build/notebooks/$$nb.ipynb -p scale ci || exit 1; \
	done
	JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.cache/jax-nbval $(BIN)/python -m pytest -q --nbval-lax -p no:cacheprovider \
	  --durations=10 $(addprefix build/notebooks/,$(addsuffix .ipynb,$(NBVAL_NOTEBOOKS)))

# MathJax 3 from the npm registry (pinned SHA-512), served from book/static so the book reads offline.
mathjax:
	$(BIN)/python book/tools/fetch_mathjax.py

# Debian's chromium and its WebDriver for the browser test (needs root; the test skips with a message without them).
browser-deps:
	@(command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1) \
	  || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver) \
	  || echo "chromium or chromium-driver could not be installed: the browser test will be skipped"

browser-test:
	$(BIN)/python -m pytest -q tests/book/test_book_browser.py

# The benchmarks, benchmarks/bench_NAME.py (tests/book/test_benchmarks.py checks that none is left out), and the
# revision that bench_revisions.py compares the working tree with.
BENCHMARKS ?= recursion mnist kfac statistic_dtype metrics baselines scaling revisions jax cost
BENCH_BASE ?= HEAD

## make bench: every benchmark at full size, end to end (hours on 2 cores).
bench: venv
	$(BIN)/python -m smp_book.mnist data
	@for b in $(BENCHMARKS); do \
	  echo "== benchmark $$b"; \
	  case $$b in revisions) extra="--base $(BENCH_BASE)";; *) extra="";; esac; \
	  $(BIN)/python benchmarks/bench_$$b.py $$extra || exit 1; \
	done

## make bench-smoke: every benchmark with --smoke, at tiny sizes (a minute or two; offline).
bench-smoke: venv
	@for b in $(BENCHMARKS); do \
	  echo "== benchmark $$b (smoke)"; \
	  $(BIN)/python benchmarks/bench_$$b.py --smoke || exit 1; \
	done

clean:
	rm -rf _build build
