"""smp_book: the book's own code, built on :mod:`smp_core`.

Data (the toy example, MNIST), NUTS, the baselines (Laplace, MC dropout, ensembles), the studies
behind each chapter, run sizes (:mod:`smp_book.config`), results and caches, plots, the paper's
tables, and diagnostics. It imports :mod:`smp_core`; nothing in :mod:`smp_core` imports it.
"""
