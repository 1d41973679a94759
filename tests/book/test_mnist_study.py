import math

import numpy as np
import pandas as pd
import pytest
import torch

from smp_book import mnist_growth_study as mgs
from smp_book import mnist_kfac_study as mks
from smp_book import mnist_runs as mr
from smp_book import mnist_seeds_study as mss
from smp_book import mnist_study as ms
from smp_core import metrics


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
    from smp_book.config import MNIST_VARIANTS, get_config

    cfg = get_config("mnist", "laptop")
    seeds = [ms.smp_seed(cfg, i, r) for r in range(5) for i in range(len(MNIST_VARIANTS))]
    assert len(set(seeds)) == len(seeds)
    assert [ms.smp_seed(cfg, i) for i in range(4)] == [2036, 2037, 2038, 2039]  # the single run's seeds
    key = mr.run_key(cfg, "none", 1, "a path")
    assert "smp_replicates" not in key and key["replicate"] == 1 and key["smp_path"] == "a path"
    # asking for more replicates keeps the keys, hence the cache, of those already run
    assert mr.run_key({**cfg, "smp_replicates": 9}, "none", 1, "a path") == key
    assert mr.run_key(cfg, "none", 0, "a path") != key
    # the code that computes a run is part of its key (no hand-bumped version numbers)
    from smp_book.pipeline import code_hash

    assert key["code"] == code_hash("smp_book.mnist_runs") == mr.map_key(cfg)["code"]


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
    shares = mr.largest_chain_shares(logits)
    assert abs(shares["largest_chain_share"] - 0.1) < 1e-12 and abs(shares["largest_two_share"] - 0.2) < 1e-12
    logits[3] += 100.0
    assert mr.largest_chain_shares(logits)["largest_chain_share"] > 0.85
    # the shares add up to the unbiased variance of smp_core.metrics
    per_chain = ((logits - logits.mean(0)) ** 2).flatten(1).mean(1) / 9
    assert abs(float(per_chain.sum()) - metrics.logits_variance(logits)) < 1e-9
    assert math.isnan(mr.largest_chain_shares(logits[:1])["largest_chain_share"])


def test_mutual_information_tail():
    # 20 chains: 19 close together and one far out, which carries nearly all the mutual information
    gen = torch.Generator().manual_seed(0)
    logits = 0.05 * torch.randn(20, 50, 10, generator=gen, dtype=torch.float64)
    logits[11] = 5.0 * torch.randn(50, 10, generator=gen, dtype=torch.float64)
    probs = torch.softmax(logits, dim=-1)
    tail = mr.mutual_information_tail(probs, trim=0.05)
    assert tail["mi_largest_chain_share"] > 0.9
    keep = torch.arange(20) != 11
    assert tail["trimmed_mutual_info"] == pytest.approx(metrics.mutual_information(probs[keep]), rel=1e-12)
    # chains that spread alike: the largest share stays near 1/S (here below 3/S)
    alike = torch.softmax(torch.randn(20, 500, 10, generator=gen, dtype=torch.float64), dim=-1)
    assert mr.mutual_information_tail(alike)["mi_largest_chain_share"] < 3 / 20
    assert all(math.isnan(v) for v in mr.mutual_information_tail(probs[:1]).values())
    # identical chains: no mutual information to share (3 chains: the mean of 3 equal numbers may round)
    for n in (3, 4, 7):
        same = torch.softmax(logits[:1] + 0.1, dim=-1).expand(n, -1, -1)
        assert math.isnan(mr.mutual_information_tail(same)["mi_largest_chain_share"])


def test_divergence_record():
    from types import SimpleNamespace

    theta = torch.tensor([[0.5, -0.2], [float("nan"), float("nan")], [0.1, 2.0], [float("nan"), 0.0]])
    res = SimpleNamespace(theta=theta, diverged=torch.tensor([False, True, False, True]),
                          diverged_step=torch.tensor([-1, 6550, -1, 4050]))
    row = mr.divergence_record(res, torch.tensor([0.0, 1.0]), 0, "SMP-periodic-kfac", period=500)
    assert row["diverged"] == 2 and row["caught_at_steps"] == "4050 6550" and row["steps_modulo_T"] == "50 50"
    assert row["largest_move_of_a_kept_chain"] == pytest.approx(1.2)  # |-0.2 - 1| in chain 0


def _tiny_mnist(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def part(n):
        return torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    return {"train": part(40), "val": part(20), "test": part(30)}


def test_reached_share_is_the_sum_of_the_squared_step_sizes():
    n_obs, n_steps = 500, 700
    direct = sum((n_obs + k) ** -2.0 for k in range(1, n_steps + 1)) / sum((n_obs + k) ** -2.0 for k in range(1, 10**6))
    assert abs(mgs.reached_share(n_obs, n_steps) - direct) < 2e-3  # the 10^6 terms leave out < 1/(N + 10^6)
    assert abs(mgs.reached_share(54_000, 10**4) - 10**4 / 64_000) < 1e-4


def test_run_growth_extends_one_run_through_the_grid(tmp_path, monkeypatch):
    from smp_book.config import get_config

    cfg = {**get_config("mnist_growth", "ci"), "n_train": 40, "n_chains": 3, "growth_steps": [50, 100]}
    data = _tiny_mnist()
    theta0 = torch.cat([p.detach().reshape(-1) for p in mr.lenet5().parameters()])
    zero = torch.zeros(theta0.numel(), dtype=torch.bool)
    zero[:100] = True
    # (SMP-none: a preconditioned variant from a random network on random images kills every unit)
    kw = dict(device=torch.device("cpu"), progress=False, cache_root=str(tmp_path))
    table = mgs.run_growth(cfg, "none", theta0, data, 0, zero, **kw)
    assert list(table.index) == [50, 100] and (table["method"] == "SMP-none").all()
    # the point at K = 100 of the extended run is a run of exactly 100 steps
    direct = mr.run_variant({**cfg, "n_steps": 100, "checkpoint_every": None}, "none", theta0, data, 0,
                            torch.device("cpu"), progress=False)
    point = mgs.growth_point(direct.theta, data, zero, torch.device("cpu"))
    assert table.loc[100, "params_variance"] == point["params_variance"]
    assert table.loc[100, "mutual_info"] == point["mutual_info"]
    assert table.loc[100, "params_variance"] != table.loc[50, "params_variance"]  # the run went on
    assert table.loc[100, "seconds"] >= table.loc[50, "seconds"]  # the elapsed time runs on across the resume
    # the split over the zero-Fisher coordinates averages back to the whole
    whole = (100 * table.loc[100, "params_variance_zero_fisher"]
             + (theta0.numel() - 100) * table.loc[100, "params_variance_other"]) / theta0.numel()
    assert abs(whole - table.loc[100, "params_variance"]) < 1e-9 * table.loc[100, "params_variance"]
    # a rerun is read from the cache; a longer grid extends the same checkpoint
    assert mgs.run_growth(cfg, "none", theta0, data, 0, zero, **kw).equals(table)
    from smp_core import recursion

    advanced = []
    real_advance = recursion.SMP.advance

    def spy(self, state, until, **kwargs):
        advanced.append((state.step, until))
        return real_advance(self, state, until, **kwargs)

    monkeypatch.setattr(recursion.SMP, "advance", spy)
    longer = mgs.run_growth({**cfg, "growth_steps": [50, 100, 150]}, "none", theta0, data, 0, zero, **kw)
    assert longer.loc[[50, 100]].equals(table)
    assert advanced == [(100, 150)]  # only the new steps were run, from the checkpoint at K = 100
    # without the cache the same numbers come from a temporary checkpoint
    uncached = mgs.run_growth(cfg, "none", theta0, data, 0, zero, **{**kw, "cache_root": str(tmp_path / "no")},
                             use_cache=False)
    assert uncached.drop(columns="seconds").equals(table.drop(columns="seconds"))
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match="increasing"):
        mgs.run_growth({**cfg, "growth_steps": [100, 50]}, "none", theta0, data, 0, zero, **kw)
    with pytest.raises(ValueError, match="multiple of 50"):
        mgs.run_growth({**cfg, "growth_steps": [50, 120]}, "none", theta0, data, 0, zero, **kw)


def test_growth_against_linear_and_least_dispersed():
    import pandas as pd

    grid = [1_000, 10_000, 100_000]
    shares = [mgs.reached_share(54_000, k) for k in grid]

    def table(method, scale, se):
        df = pd.DataFrame({"method": method, "reached_share": shares, "mutual_info": [scale * s for s in shares],
                           "mutual_info_se": se}, index=pd.Index(grid, name="K"))
        return df

    linear = table("SMP-fixed-diag", 2.0, 0.01)
    assert mgs.growth_against_linear(linear, "mutual_info").tolist() == pytest.approx([1.0, 1.0, 1.0])
    faster = linear.assign(mutual_info=linear["mutual_info"] * [1, 2, 4])
    assert mgs.growth_against_linear(faster, "mutual_info").tolist() == pytest.approx([1.0, 2.0, 4.0])
    both = pd.concat([faster, table("SMP-periodic-diag", 3.0, 0.01), table("SMP-none", 0.0, 0.0)])
    least = mgs.least_dispersed(both)
    assert least["least"].tolist() == ["SMP-fixed-diag", "SMP-periodic-diag", "SMP-periodic-diag"]  # 2s, 4s, 8s vs 3s
    # at K = 10^3: 3 s - 2 s = s apart, s = share; z = s / (0.01 sqrt 2)
    assert least.loc[1_000, "lead_z"] == pytest.approx(shares[0] / (0.01 * math.sqrt(2)))


def test_run_replicates_tables_and_cache(tmp_path):
    from smp_book.config import MNIST_VARIANTS, get_config

    cfg = {**get_config("mnist", "ci"), "n_train": 40, "n_chains": 3, "n_steps": 50}
    data = _tiny_mnist(1)
    theta0 = torch.cat([p.detach().reshape(-1) for p in mr.lenet5().parameters()])
    kw = dict(device=torch.device("cpu"), progress=False, cache_root=str(tmp_path))
    runs = ms.run_replicates(cfg, theta0, data, **kw)
    assert len(runs["tables"]) == cfg["smp_replicates"] == 2
    assert list(runs["tables"][1]["scores"].index) == mr.method_names()
    assert list(runs["diverged"].index) == [0, 1]
    assert list(runs["diverged"].columns) == [f"SMP-{v}" for v in MNIST_VARIANTS]
    assert all("probs" in ev for ev in runs["figure_evals"].values())
    # the tails table carries the mutual information's split over the chains
    tails = runs["tables"][0]["tails"]
    assert {"largest_chain_share", "mi_largest_chain_share", "trimmed_mutual_info"} <= set(tails.columns)
    assert math.isnan(tails.loc["MAP", "trimmed_mutual_info"])
    # with 3 chains nothing is trimmed: the trimmed MI is the MI
    smp = [f"SMP-{v}" for v in MNIST_VARIANTS]
    assert tails.loc[smp, "trimmed_mutual_info"].tolist() == pytest.approx(
        runs["tables"][0]["scores"].loc[smp, "mutual_info"].tolist(), rel=1e-12)
    # one divergence record per run, each with the largest move of a kept chain
    div = runs["divergence"]
    assert len(div) == 2 * len(MNIST_VARIANTS) and (div["diverged"] == 0).all()
    assert (div["largest_move_of_a_kept_chain"] > 0).all() and (div["largest_move_of_a_kept_chain"] < 1e3).all()
    # other seeds per replicate; a rerun reads every run from the cache
    assert not runs["tables"][0]["scores"].equals(runs["tables"][1]["scores"])
    again = ms.run_replicates(cfg, theta0, data, **kw)
    assert again["tables"][1]["scores"].equals(runs["tables"][1]["scores"])
    # one cached result per run; the checkpoints of finished runs are gone
    assert len(list((tmp_path / "mnist").glob("*.pt"))) == 2 * len(MNIST_VARIANTS)
    assert not list((tmp_path / "mnist").glob("*.checkpoint.pt"))


def test_growth_summary_ratios():
    import pandas as pd

    grid = [1_000, 100_000]
    t = pd.DataFrame({"method": "SMP-x", "reached_share": [0.1, 0.5], "params_variance": [1.0, 8.0],
                      "params_variance_zero_fisher": [0.0, 2.0], "logits_variance": [2.0, 4.0],
                      "mutual_info": [0.5, 0.5]}, index=pd.Index(grid, name="K"))
    row = mgs.growth_summary(t, zero_fraction=0.5).loc["SMP-x"]
    assert row["one-Fisher growth"] == pytest.approx(5.0) and row["params_variance growth"] == 8.0
    assert row["logits_variance growth"] == 2.0 and row["mutual_info growth"] == 1.0
    assert row["zero-Fisher share of params variance"] == pytest.approx(0.5 * 2.0 / 8.0)
    assert (row["from K"], row["to K"]) == (1_000, 100_000)
    assert "params_variance growth se" not in row  # no errors given, none made up
    with_se = t.assign(params_variance_se=[0.1, 0.4], largest_chain_share=[0.2, 0.7])
    row = mgs.growth_summary(with_se, zero_fraction=0.5).loc["SMP-x"]
    assert row["params_variance growth se"] == pytest.approx(8.0 * math.hypot(0.1, 0.05))
    assert row["largest chain share"] == 0.7


def test_load_data_takes_whole_sets_at_the_papers_sizes(monkeypatch):
    from smp_book.config import get_config

    asked = []
    monkeypatch.setattr(mr, "mnist_tensors", lambda data_dir, seed, subset: asked.append((data_dir, seed, subset)))
    for scale in ("paper", "laptop", "ci"):
        ms.load_data(get_config("mnist", scale), "somewhere")
    ms.load_data(get_config("mnist_growth", "ci"))
    ci = get_config("mnist", "ci")
    assert asked == [("somewhere", 0, None), ("somewhere", 0, None),
                     ("somewhere", 0, (ci["n_train"], ci["n_val"], ci["n_test"])),
                     (mr.DATA, 0, (ci["n_train"], ci["n_val"], ci["n_test"]))]


def test_kfac_study_runs_its_variants_with_their_tau_and_refresh(tmp_path):
    from smp_book.config import MNIST_KFAC_VARIANTS, get_config

    cfg = {**get_config("mnist_kfac", "ci"), "n_train": 40, "n_chains": 3, "n_steps": 50, "smp_replicates": 1,
           "ema_refresh": 7}
    data = _tiny_mnist(1)
    torch.manual_seed(0)  # with N = 40 the steps are large: some chains may diverge, which must not fail the run
    theta0 = torch.cat([p.detach().reshape(-1) for p in mr.lenet5().parameters()])
    runs = ms.run_replicates(cfg, theta0, data, device=torch.device("cpu"), progress=False, cache_root=str(tmp_path))
    assert list(runs["tables"][0]["scores"].index) == ["MAP"] + [f"SMP-{v}" for v in MNIST_KFAC_VARIANTS]
    assert list(runs["diverged"].columns) == [f"SMP-{v}" for v in MNIST_KFAC_VARIANTS]
    # cached under the study's own folder, with the settings each run used
    stored = [torch.load(p, weights_only=False)["value"].config for p in (tmp_path / "mnist_kfac").glob("*.pt")]
    assert sorted(c["preconditioner"] for c in stored) == sorted(MNIST_KFAC_VARIANTS)
    by_name = {c["preconditioner"]: c for c in stored}
    assert by_name["ema-kfac"]["ema_refresh"] == 7 and "ema_refresh" not in by_name["fixed-kfac"]
    assert {c["tau"] for c in stored} == {0.05, 0.08} and by_name["ema-kfac"]["tau"] == 0.08
    assert not (tmp_path / "mnist").exists()


def test_kfac_against_diag_verdicts():
    import pandas as pd

    scores = pd.DataFrame({"accuracy": 0.98, "nll": [0.04, 0.04, 0.06, 0.05, 0.3, 0.5],
                           "ece": 0.01, "mutual_info": [0.0, 1e-4, 0.02, 0.01, 0.5, 0.9]},
                          index=["MAP", "SMP-none", "SMP-fixed-diag", "SMP-fixed-kfac", "SMP-ema-diag", "SMP-ema-kfac"])
    variances = pd.DataFrame({"logits_variance": [0.0, 0.004, 0.5, 0.1, 11.0, 22.0], "params_variance": 1e-6},
                             index=scores.index)
    elapsed = pd.DataFrame({"seconds": [0.0, 60, 60, 700, 70, 1300]}, index=scores.index)
    table = mks.structure_table(scores, variances, elapsed)
    assert table.loc["SMP-ema-kfac", ["strategy", "structure"]].tolist() == ["ema", "kfac"]
    assert table.loc["SMP-none", "strategy"] == "" and table.loc["MAP", "structure"] == ""
    findings = mks.kfac_against_diag(table)
    assert list(findings.index) == ["fixed", "ema"]  # periodic has neither row
    assert findings.loc["fixed", "mi_kfac_over_diag"] == pytest.approx(0.5)
    assert findings.loc["ema", "logits_variance_kfac_over_diag"] == pytest.approx(2.0)
    assert findings["kfac less dispersed (smaller MI)"].tolist() == ["yes", "no"]
    assert findings["kfac lower NLL"].tolist() == ["yes", "no"]
    assert (findings["nll_map"] == 0.04).all()
    assert mks.kfac_against_diag(table.drop(index=["SMP-fixed-kfac", "SMP-ema-kfac"])).empty


def test_map_seeds_share_the_mnist_chapters_and_the_ensembles_maps_and_runs(tmp_path, monkeypatch):
    """run_map_seeds: MAP 0 and its runs are the MNIST chapter's MAP and replicates (read back from the
    cache without training or running anything), MAP m is the baselines chapter's ensemble member m, and
    each MAP's runs have their own seeds; the per-MAP tables are the means over the MAP's replicates."""
    from smp_book import mnist_baseline_study as mbs
    from smp_book.config import MNIST_VARIANTS, get_config

    cfg = {**get_config("mnist_seeds", "ci"), "n_train": 40, "n_val": 20, "n_test": 30, "map_epochs": 1,
           "n_chains": 3, "n_steps": 30, "period": 10}
    data = _tiny_mnist(2)
    kw = dict(device=torch.device("cpu"), progress=False, cache_root=str(tmp_path))
    study = mss.run_map_seeds(cfg, data, **kw)
    assert len(study["tables"]) == cfg["map_seeds"] == 2
    assert list(study["maps"]["seed"]) == [cfg["seed"], cfg["seed"] + 100]
    assert list(study["diverged"].columns) == [f"SMP-{v}" for v in MNIST_VARIANTS]
    n_runs = cfg["smp_replicates"] * len(MNIST_VARIANTS)
    assert cfg["smp_replicates"] == 2 and [len(runs) for runs in study["runs"]] == [2, 2]
    assert len(list((tmp_path / "mnist").glob("*.pt"))) == cfg["map_seeds"] * (1 + n_runs)
    scores = [t["scores"] for t in study["tables"]]
    assert not scores[0].equals(scores[1])  # another MAP, other runs
    assert scores[0].loc["MAP", "nll"] == study["maps"].loc[0, "nll"]
    runs = [[t["scores"] for t in per_map] for per_map in study["runs"]]
    assert not runs[1][0].equals(runs[1][1])  # each replicate its own stream
    pd.testing.assert_frame_equal(scores[1], (runs[1][0] + runs[1][1]) / 2)
    # the MNIST chapter at the same settings finds MAP 0 and its replicates in the cache
    monkeypatch.setattr(mr, "train_map", lambda *a, **k: pytest.fail("a MAP was not shared"))
    monkeypatch.setattr(mr, "run_variant", lambda *a, **k: pytest.fail("an SMP run was not shared"))
    mnist = {**{k: v for k, v in cfg.items() if k != "map_seeds"}, "study": "mnist"}
    theta0 = mr.fit_map(mnist, data, **kw)["theta"]
    chapter = ms.run_replicates(mnist, theta0, data, **kw)
    assert [t["scores"].equals(r) for t, r in zip(chapter["tables"], runs[0], strict=True)] == [True, True]
    # MAP 1 is stored under the MNIST settings with the seed map_seed(cfg, 1)
    member = mr.fit_map({**mnist, "seed": mss.map_seed(cfg, 1)}, data, **kw)
    assert member["theta"].shape == theta0.shape and not torch.equal(member["theta"], theta0)
    # ... which the baselines chapter's ensemble member 1 uses, at every scale
    for scale in ("ci", "laptop", "paper"):
        seeds, baselines = get_config("mnist_seeds", scale), get_config("mnist_baselines", scale)
        mnist_at_scale = {**{k: v for k, v in seeds.items() if k != "map_seeds"}, "study": "mnist"}
        for m in range(seeds["map_seeds"]):
            ensemble = {**mbs.mnist_settings(baselines), "seed": mbs.ensemble_seed(baselines, m)}
            assert mr.map_key(ensemble) == mr.map_key({**mnist_at_scale, "seed": mss.map_seed(seeds, m)})


def test_least_dispersed_per_map():
    def tables(mi):
        return {"scores": pd.DataFrame({"mutual_info": mi}, index=list(ms.DIAGONAL_METHODS))}

    least = mss.least_dispersed_per_map([tables([0.02, 0.5, 0.04]), tables([0.06, 0.4, 0.03])])
    assert list(least["least"]) == ["SMP-fixed-diag", "SMP-periodic-diag"]
    assert least.loc[1, "SMP-periodic-diag"] == 0.03


def test_dispersion_per_run_and_map_or_stream():
    """Three MAPs x two replicates: the per-run table holds each run's mutual information, its log ratios and
    its least dispersed variant; the decomposition is that of results.variance_components on the logs."""
    from smp_book.summaries import variance_components

    fixed, ema, periodic = ms.DIAGONAL_METHODS
    mi = {(0, 0): [0.02, 0.5, 0.01], (0, 1): [0.03, 0.4, 0.01], (1, 0): [0.02, 0.6, 0.05],
          (1, 1): [0.01, 0.5, 0.04], (2, 0): [0.05, 0.3, 0.02], (2, 1): [0.04, 0.2, 0.06]}
    runs = [[{"scores": pd.DataFrame({"mutual_info": mi[(m, r)]}, index=[fixed, ema, periodic])} for r in range(2)]
            for m in range(3)]
    per_run = mss.dispersion_per_run(runs)
    assert list(per_run.index.names) == ["map", "replicate"] and len(per_run) == 6
    assert per_run.loc[(1, 1), periodic] == 0.04
    assert per_run.loc[(0, 0), "log periodic/fixed"] == pytest.approx(math.log(0.5))
    assert per_run.loc[(2, 1), "log periodic/EMA"] == pytest.approx(math.log(0.06 / 0.2))
    assert list(per_run["least"]) == [periodic, periodic, fixed, fixed, periodic, fixed]
    split = mss.map_or_stream(per_run)
    assert list(split.index) == [f"log {fixed}", f"log {ema}", f"log {periodic}", "log periodic/fixed",
                                 "log periodic/EMA"]
    expected = variance_components(np.log(per_run[[periodic]]))
    assert split.loc[f"log {periodic}", "sd_map"] == pytest.approx(expected.iloc[0]["sd_group"])
    assert split.loc[f"log {periodic}", "p_value"] == pytest.approx(expected.iloc[0]["p_value"])
    assert {"sd_map", "sd_stream", "map_share", "F", "p_value"} <= set(split.columns)
    # the trimmed measure comes from the tails table (here periodic is least in every run); an unknown
    # measure is refused
    trimmed = [[{"tails": pd.DataFrame({"trimmed_mutual_info": [0.02, 0.3, 0.01 + 0.001 * (m + r)]},
                                      index=[fixed, ema, periodic])} for r in range(2)] for m in range(3)]
    robust = mss.dispersion_per_run(trimmed, measure="trimmed_mutual_info")
    assert robust.loc[(1, 1), periodic] == pytest.approx(0.012)
    assert robust.loc[(2, 0), "log periodic/fixed"] == pytest.approx(math.log(0.012 / 0.02))
    assert robust.loc[(0, 1), "log periodic/EMA"] == pytest.approx(math.log(0.011 / 0.3))
    assert (robust["least"] == periodic).all()
    with pytest.raises(ValueError, match="measure must be one of"):
        mss.dispersion_per_run(runs, measure="median")


def test_validation_fisher_diagonal_is_the_mean_squared_score_of_the_observed_labels():
    data = _tiny_mnist(3)
    torch.manual_seed(1)
    net = mr.lenet5()
    theta0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    xv, yv = data["val"]
    expected = torch.zeros_like(theta0)
    for x, y in zip(xv, yv, strict=True):  # one example at a time, plain autograd
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(x[None]), y[None]).backward()
        expected += torch.cat([p.grad.reshape(-1) for p in net.parameters()]) ** 2
    expected /= len(yv)
    diag = mr.validation_fisher_diagonal(theta0, data, torch.device("cpu"))
    assert diag.shape == theta0.shape and diag.device.type == "cpu"
    assert diag.double().numpy() == pytest.approx(expected.double().numpy(), rel=1e-4, abs=1e-12)
    zero = mr.fisher_zero_mask(theta0, data, torch.device("cpu"))
    assert zero.dtype == torch.bool and torch.equal(zero, diag == 0)
    assert ms.fisher_zero_fraction(theta0, data, torch.device("cpu")) == pytest.approx(zero.double().mean().item())


def _tiny_chapter(monkeypatch):
    """The MNIST chapter's study on tiny random data (the plumbing, not the numbers)."""
    from smp_book.config import get_config

    cfg = {**get_config("mnist", "ci"), "n_train": 40, "n_val": 20, "n_test": 30, "map_epochs": 1, "n_chains": 3,
           "n_steps": 20, "period": 10}
    monkeypatch.setattr(ms, "config", lambda scale: cfg, raising=False)
    monkeypatch.setattr(ms, "load_data", lambda cfg, data_dir="data": (_tiny_mnist(1), {"source": "random"}))
    return cfg


def test_compute_writes_the_chapters_results_and_they_are_read_back(tmp_path, monkeypatch):
    from smp_book import pipeline

    cfg = _tiny_chapter(monkeypatch)
    res = pipeline.compute("mnist", "ci", root=tmp_path, use_cache=False)
    assert res.folder == tmp_path / "ci" / "mnist" and res.manifest["device"] == "cpu"
    assert set(res.manifest["seeds"]["smp"]) == {"replicate_0", "replicate_1"}
    for name in ("map_history", "scores", "scores_mean", "scores_std", "scores_replicates", "variances_mean",
                 "elapsed_mean", "tails_replicates", "diverged", "ambiguous_three"):
        assert res.has(name), name
    assert list(res.table("scores_mean").index) == mr.method_names()
    assert list(res.table("scores_replicates").index.names) == ["replicate", "method"]
    assert len(res.table("map_history")) == cfg["map_epochs"]
    assert set(res.manifest["figures"]) == {"calibration_all", "ambiguous_three"}
    assert res.values["n_steps"] == 20 and not res.has("claims")  # the register judges the claims
    assert res.values["dim"] == 47_154
    # the chapter reads what is there: no second computation
    monkeypatch.setattr(ms, "compute", lambda ctx: pytest.fail("the results were computed again"))
    again = pipeline.results("mnist", "ci", root=tmp_path)
    assert again.values == res.values


def test_paper_scale_results_only_from_a_complete_paper_folder(tmp_path):
    import json

    from smp_book import pipeline

    folder = tmp_path / "paper" / "mnist"
    assert mr.paper_scale_results(folder) is None  # nothing there
    assert "No paper-scale results exist yet" in ms.paper_scale_note("ci", None)
    assert "runs at the paper scale" in ms.paper_scale_note("paper", None)
    folder.mkdir(parents=True)
    pd.DataFrame({"accuracy": [0.99]}, index=pd.Index(["MAP"], name="method")).to_csv(folder / "scores_mean.csv")
    paper = json.loads(json.dumps(pipeline.study_config("mnist", "paper")))
    manifest = {"format": pipeline.FORMAT, "study": "mnist", "scale": "paper", "config": paper,
                "tables": {"scores_mean": {"index": 1, "header": 1}}, "wall_time_s": 3600.0,
                "environment": {"device": "a test GPU"}, "device": "cuda"}

    def write(**changes):
        (folder / "manifest.json").write_text(json.dumps({**manifest, **changes}))

    write()
    res = mr.paper_scale_results(folder)
    assert res is not None and res.table("scores_mean").loc["MAP", "accuracy"] == 0.99
    note = ms.paper_scale_note("ci", res)
    assert f"$K$ = {paper['n_steps']:,}" in note and "a test GPU" in note and "3,600 s" in note
    write(scale="laptop")  # another scale's results
    assert mr.paper_scale_results(folder) is None
    write(config={**paper, "n_steps": 10})  # other settings: not the paper scale's results
    assert mr.paper_scale_results(folder) is None
    write(tables={})  # no table of scores
    assert mr.paper_scale_results(folder) is None


def test_chapter_map_takes_the_lowest_validation_loss_of_its_seeds(tmp_path):
    """The paper scale's rule: among select_map_from_seeds, the MAP whose last validation loss is lowest,
    each candidate the fit of its own seed (so shared through the cache); without the key, the seed's MAP."""
    from smp_book.config import get_config

    cfg = {**get_config("mnist", "ci"), "n_train": 40, "n_val": 20, "n_test": 30, "map_epochs": 1}
    data = _tiny_mnist(1)
    chosen = ms.chapter_map({**cfg, "select_map_from_seeds": [5, 6, 7]}, data, progress=False, cache_root=tmp_path)
    losses = {s: float(mr.fit_map({**cfg, "seed": s}, data, progress=False, cache_root=tmp_path)["history"]
                       ["val_loss"].iloc[-1]) for s in (5, 6, 7)}
    assert len(set(losses.values())) == 3  # the seeds give different MAPs: the choice is not vacuous
    best = min(losses, key=losses.get)
    assert chosen["seed"] == best and chosen["candidates"].set_index("seed")["val_loss"].to_dict() == losses
    assert torch.equal(chosen["theta"], mr.fit_map({**cfg, "seed": best}, data, progress=False,
                                                   cache_root=tmp_path)["theta"])
    plain = ms.chapter_map(cfg, data, progress=False, cache_root=tmp_path)
    assert plain["seed"] == cfg["seed"] and len(plain["candidates"]) == 1
    with pytest.raises(ValueError, match="select_map_from_seeds must list distinct integer seeds"):
        ms.chapter_map({**cfg, "select_map_from_seeds": [5, 5]}, data, progress=False, cache_root=tmp_path)
