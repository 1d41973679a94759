"""The toy KFAC study's own pieces: what each structure stores, and how its tables show missing values."""

from __future__ import annotations

import numpy as np
import pandas as pd

from smp_book import toy_kfac_study as tks
from smp_book.config import TOY_VARIANTS


def test_stored_numbers_per_structure():
    sizes = tks.stored_numbers()
    assert list(sizes.index) == list(tks.STRUCTURES)
    toy = sizes["toy MLP (d = 20)"]
    # 2-3-2-1: blocks W1, b1, W2, b2, W3, b3 of 6, 3, 6, 2, 2, 1 parameters; per layer, KFAC keeps
    # A of (inputs + 1)^2 and G of outputs^2 numbers
    assert toy.to_dict() == {"diag": 20, "block": 36 + 9 + 36 + 4 + 4 + 1, "dense": 400,
                             "kfac": (9 + 9) + (16 + 4) + (9 + 1)}
    lenet = sizes["LeNet-5 (d = 47,154)"]
    assert lenet["diag"] == 47_154 and lenet["dense"] == 47_154 ** 2
    assert lenet["diag"] < lenet["kfac"] < lenet["block"] < lenet["dense"]


def test_with_spread_shows_missing_values_as_a_dash():
    mean = pd.DataFrame({"params_variance": [0.4, np.nan]}, index=["NUTS", "NUTS-mean"])
    std = pd.DataFrame({"params_variance": [0.01, np.nan]}, index=["NUTS", "NUTS-mean"])
    from smp_book.show import with_spread

    shown = with_spread(mean, std)
    assert shown.loc["NUTS", "params_variance"] == "0.4000 ± 0.0100"
    assert shown.loc["NUTS-mean", "params_variance"] == "-"
    assert list(shown.columns) == ["params_variance"]


def test_kfac_chains_draw_after_the_paper_variants():
    assert tks.SEED_OFFSET == len(TOY_VARIANTS)
