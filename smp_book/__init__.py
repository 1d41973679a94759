"""smp_book: the book's own code, built on :mod:`smp_core`.

Data (the toy example, MNIST), NUTS, the baselines (Laplace, MC dropout, ensembles), the studies
behind each chapter, run sizes (:mod:`smp_book.config`), results and caches, plots, the paper's
tables, and diagnostics. It imports :mod:`smp_core`; nothing in :mod:`smp_core` imports it.

JAX (NUTS) keeps its compiled programs in ``.cache/jax/`` (unless ``JAX_COMPILATION_CACHE_DIR`` is set before this
package is imported, or JAX was imported first), so that each notebook and test process does not compile NUTS
again: about 13 s of a 19 s NUTS run at the ``ci`` scale. A program read back is the one compiled, so its numbers
are bitwise the same (``tests/book/test_nuts.py`` checks it on the jitted log posterior).
"""

import os as _os
from pathlib import Path as _Path

_os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_Path(__file__).resolve().parents[1] / ".cache" / "jax"))
_os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # NUTS compiles many small programs
