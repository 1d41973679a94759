"""Summaries the studies share: mean and spread over replicates, and the split of a spread between two levels."""

from __future__ import annotations

import numpy as np
import pandas as pd


def summarise_replicates(per_replicate: list[dict[str, pd.DataFrame]]) -> dict[str, pd.DataFrame]:
    """Mean and standard deviation (``ddof=1``; NaN for one replicate) over replicates of every cell.

    ``per_replicate[r][name]`` is table ``name`` of replicate ``r`` (rows named ``method``); returns
    ``{name}_mean``, ``{name}_std`` and ``{name}_replicates`` (all replicates stacked, indexed by
    ``(replicate, method)``) for every ``name``, rows in the order of the first replicate.
    """
    if not per_replicate:
        raise ValueError("no replicates to summarise")
    out = {}
    for name in per_replicate[0]:
        frames = [tables[name] for tables in per_replicate]
        stacked = pd.concat(frames, keys=range(len(frames)), names=["replicate"])
        out[f"{name}_mean"] = stacked.groupby(level="method", sort=False).mean()
        out[f"{name}_std"] = stacked.groupby(level="method", sort=False).std(ddof=1)
        out[f"{name}_replicates"] = stacked
    return out


def variance_components(values: pd.DataFrame) -> pd.DataFrame:
    """Between-group and within-group spread of each column of a balanced two-level design, by the
    one-way random-effects analysis of variance.

    ``values`` is indexed by ``(group, replicate)`` (two index levels, every group with the same number
    ``r >= 2`` of replicates, at least two groups), one column per quantity; the model is
    ``y_gr = mu + a_g + e_gr`` with ``a_g ~ (0, sigma_group^2)`` and ``e_gr ~ (0, sigma_within^2)``
    independent. With ``G`` groups, ``MS_between = r sum_g (ybar_g - ybar)^2 / (G - 1)`` and
    ``MS_within = sum_gr (y_gr - ybar_g)^2 / (G (r - 1))``; ``MS_within`` and ``(MS_between - MS_within) / r``
    are unbiased for the two variances. Returns, per column: ``mean``, ``sd_group`` (the square root of
    the second estimate, 0 where it is negative), ``sd_within``, ``group_share``
    (``sigma_group^2 / (sigma_group^2 + sigma_within^2)`` from the estimates, the intraclass correlation),
    ``F = MS_between / MS_within`` and ``p_value``, the chance of an ``F`` at least as large if the groups
    did not differ (``F(G - 1, G (r - 1))``, exact for normal errors of one variance in every group).
    A small ``p_value`` says that ``sigma_group > 0``, not that it exceeds ``sigma_within``; the two
    standard deviations say which is larger. With no spread at all ``F`` and ``p_value`` are NaN.
    """
    from scipy.stats import f as f_distribution

    if not isinstance(values.index, pd.MultiIndex) or values.index.nlevels != 2:
        raise ValueError("values must be indexed by (group, replicate): a MultiIndex of two levels")
    if values.empty or not np.isfinite(values.to_numpy(dtype=float)).all():
        raise ValueError("values must be non-empty and contain no NaN or infinite entries")
    sizes = values.groupby(level=0, sort=False).size()
    if len(sizes) < 2 or sizes.nunique() != 1 or sizes.iloc[0] < 2:
        raise ValueError("a balanced design is needed: at least 2 groups, each with the same number (at least 2) "
                         f"of replicates; got {({group: int(n) for group, n in sizes.items()})}")
    n_groups, r = len(sizes), int(sizes.iloc[0])
    rows = {}
    for column in values.columns:
        y = values[column].astype(float)
        group_means = y.groupby(level=0, sort=False).mean()
        grand = float(y.mean())
        ms_between = r * float(((group_means - grand) ** 2).sum()) / (n_groups - 1)
        deviations = y - group_means.reindex(y.index.get_level_values(0)).to_numpy()
        ms_within = float((deviations**2).sum()) / (n_groups * (r - 1))
        var_group = max(0.0, (ms_between - ms_within) / r)
        total = var_group + ms_within
        if ms_within > 0:
            f_stat = ms_between / ms_within
            p_value = float(f_distribution.sf(f_stat, n_groups - 1, n_groups * (r - 1)))
        else:  # no spread within groups: any between them is certain; none at all leaves nothing to test
            f_stat, p_value = (float("inf"), 0.0) if ms_between > 0 else (float("nan"), float("nan"))
        rows[column] = {"mean": grand, "sd_group": var_group**0.5, "sd_within": ms_within**0.5,
                        "group_share": var_group / total if total > 0 else float("nan"), "F": f_stat,
                        "p_value": p_value}
    return pd.DataFrame.from_dict(rows, orient="index")


def paired_lead(differences) -> float:
    """Mean of paired per-replicate differences over its standard error (NaN for fewer than two
    replicates or no spread): how many standard errors one method leads another by."""
    diffs = np.asarray(differences, dtype=np.float64)
    if len(diffs) < 2:
        return float("nan")
    se = diffs.std(ddof=1) / np.sqrt(len(diffs))
    return float(diffs.mean() / se) if se > 0 else float("nan")
