import math

import torch

from smp_core import metrics
from smp_core import mnist_study as ms
from smp_core.paper import paper_table


def test_claims_on_the_papers_tables():
    verdicts = ms.claims(paper_table("ex2_scores"), paper_table("ex2_variances")).set_index("claim")["verdict"]
    assert (verdicts == "holds").all(), verdicts


def test_claims_count_the_verdicts_of_single_runs():
    scores, variances = paper_table("ex2_scores"), paper_table("ex2_variances")
    worse = scores.copy()
    worse.loc["SMP-periodic-diag", "mutual_info"] = 10.0  # no longer the least over-dispersed
    table = ms.claims(scores, variances, [(scores, variances), (worse, variances), (scores, variances)])
    counts = table.set_index("claim")["replicates"]
    assert counts.filter(like="Periodic recomputation").item() == "holds 2, does not hold 1"
    assert counts.filter(like="SMP-none predicts like MAP").item() == "holds 3"
    assert list(table.columns) == ["claim", "criterion", "verdict", "evidence", "replicates"]
    assert "replicates" not in ms.claims(scores, variances).columns
    assert ms.verdict_counts(["partly", "holds", "partly"]) == "partly 2, holds 1"


def test_summarise_gives_the_map_row_no_spread():
    import pandas as pd

    def one(a, b):
        df = pd.DataFrame({"accuracy": [0.98, a], "nll": [0.04, b]}, index=["MAP", "SMP-none"])
        df.index.name = "method"
        return {"scores": df}

    out = ms.summarise([one(0.97, 0.05), one(0.95, 0.07)])
    assert math.isnan(out["scores_std"].loc["MAP", "accuracy"]) and out["scores_mean"].loc["MAP", "nll"] == 0.04
    assert abs(out["scores_std"].loc["SMP-none", "nll"] - 0.02 / math.sqrt(2)) < 1e-12
    assert out["scores_replicates"].loc[(1, "MAP"), "accuracy"] == 0.98  # the per-replicate table is untouched


def test_smp_seeds_and_run_keys_per_replicate():
    from smp_core.config import MNIST_VARIANTS, get_config

    cfg = get_config("mnist", "laptop")
    seeds = [ms.smp_seed(cfg, i, r) for r in range(5) for i in range(len(MNIST_VARIANTS))]
    assert len(set(seeds)) == len(seeds)
    assert [ms.smp_seed(cfg, i) for i in range(4)] == [2036, 2037, 2038, 2039]  # the single run's seeds
    key = ms.run_key(cfg, "none", 1, "a path")
    assert "smp_replicates" not in key and key["replicate"] == 1 and key["smp_path"] == "a path"
    # asking for more replicates keeps the keys, hence the cache, of those already run
    assert ms.run_key({**cfg, "smp_replicates": 9}, "none", 1, "a path") == key
    assert ms.run_key(cfg, "none", 0, "a path") != key


def test_ambiguous_three_rule():
    probs = torch.tensor([[[0.9, 0.1], [0.5, 0.5], [0.6, 0.4], [0.5, 0.5]]])  # (S=1, n=4, C=2)
    labels = torch.tensor([3, 3, 3, 1])
    assert ms.ambiguous_three(probs, labels) == 1  # highest entropy among the 3s, not index 3


def test_smp_path_names_how_the_steps_run(monkeypatch):
    from smp_core.fused import fused_unavailable

    if fused_unavailable() is None:
        assert ms.smp_path(torch.device("cpu")) == "blocks of steps, each whole step in the compiled CPU kernel"
    monkeypatch.setenv("SMP_CORE_FUSED", "0")
    assert ms.smp_path(torch.device("cpu")) == "batched torch model, step by step"
    assert ms.smp_path(torch.device("cuda")) == "blocks of steps replayed as CUDA graphs"


def test_largest_chain_shares():
    # equal excursions: each of S chains carries 1/S; one chain far out carries nearly all
    logits = torch.zeros(10, 7, 3, dtype=torch.float64)
    logits[:, 0, 0] = torch.tensor([1.0, -1.0] * 5)
    shares = ms.largest_chain_shares(logits)
    assert abs(shares["largest_chain_share"] - 0.1) < 1e-12 and abs(shares["largest_two_share"] - 0.2) < 1e-12
    logits[3] += 100.0
    assert ms.largest_chain_shares(logits)["largest_chain_share"] > 0.85
    # the shares add up to the unbiased variance of smp_core.metrics
    per_chain = ((logits - logits.mean(0)) ** 2).flatten(1).mean(1) / 9
    assert abs(float(per_chain.sum()) - metrics.logits_variance(logits)) < 1e-9
    assert math.isnan(ms.largest_chain_shares(logits[:1])["largest_chain_share"])
