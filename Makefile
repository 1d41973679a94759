# smp-book: the two entry points are `make book` (the main job) and `make test`.
# Plain python3 -m venv + pip (no conda needed); the venv is created when missing and reused otherwise.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SCALE  ?= laptop
# Notebooks of the book, in order (jupytext MyST sources in notebooks/).
NOTEBOOKS ?= usage toy toy_baselines toy_kfac toy_tail mnist mnist_baselines last_layer mnist_seeds mnist_growth mnist_kfac mnist_tail regression summary how_to_run reproduction
GEN    := book/generated
STAMP  := $(VENV)/.installed-stamp

.PHONY: book reproduce test venv lint unit notebooks nbval book-html mathjax browser-deps browser-test bench bench-smoke clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[book,dev]"
	@touch $(STAMP)

## make book: the book from the results in results/SCALE/ (a chapter whose results are missing or were
## computed with other settings computes them first), run with papermill and built as a Jupyter Book.
book: venv mathjax
	$(MAKE) notebooks SCALE=$(SCALE)
	$(MAKE) book-html

## make reproduce: recompute every chapter at SCALE (progress on the terminal; resumable), write the
## reproduction report beside the committed results, replace results/SCALE/ once complete, build the book.
reproduce: venv mathjax
	$(BIN)/python -m smp_book.mnist data
	$(BIN)/python -m smp_book.reproduce --scale $(SCALE)
	$(MAKE) book SCALE=$(SCALE)

## make test: ruff, pytest, the notebooks at ci scale (computed; nbval re-executes them), then the book readers
## get: the laptop notebooks from the committed results only (SMP_BOOK_READ_ONLY: a chapter whose results do
## not match fails instead of computing for hours), built with -W -n and opened in a browser.
test: venv mathjax
	$(BIN)/python -m smp_book.mnist data
	$(MAKE) lint
	$(MAKE) unit
	$(MAKE) notebooks SCALE=ci
	$(MAKE) nbval
	SMP_BOOK_READ_ONLY=1 $(MAKE) notebooks SCALE=laptop
	$(MAKE) book-html
	$(MAKE) browser-deps
	$(MAKE) browser-test

lint:
	$(BIN)/ruff check .

unit:
	$(BIN)/python -m pytest -q tests --ignore=tests/book/test_book_browser.py

# papermill cannot read .md notebooks: jupytext converts them first (into the gitignored build folder).
notebooks:
	@mkdir -p $(GEN) build/notebooks
	@for nb in $(NOTEBOOKS); do \
	  echo "== notebook $$nb (scale $(SCALE))"; \
	  $(BIN)/jupytext --quiet --to ipynb notebooks/$$nb.md -o build/notebooks/$$nb.ipynb || exit 1; \
	  $(BIN)/papermill --log-level WARNING -k python3 build/notebooks/$$nb.ipynb $(GEN)/$$nb.ipynb \
	    -p scale $(SCALE) || exit 1; \
	  $(BIN)/python book/tools/tidy_notebook.py $(GEN)/$$nb.ipynb || exit 1; \
	done

# nbval re-executes the ci-scale notebooks (with papermill's injected parameters) and fails on any error.
nbval:
	$(BIN)/python -m pytest -q --nbval-lax -p no:cacheprovider $(addprefix $(GEN)/,$(addsuffix .ipynb,$(NOTEBOOKS)))

book-html:
	$(BIN)/jupyter-book build . -W -n --keep-going

# MathJax 3 from the npm registry (pinned SHA-512), served from book/_static so the book reads offline.
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
BENCHMARKS ?= recursion mnist kfac statistic_dtype metrics baselines scaling revisions
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
	rm -rf _build build $(GEN)
