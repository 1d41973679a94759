"""The MNIST baselines study: shared cache keys, the rotation, the per-image scores, the findings and a
tiny run end to end (random images: the plumbing, not the numbers)."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from smp_book import baselines, shifted
from smp_book import mnist_baseline_study as mbs
from smp_book import mnist_runs as mr
from smp_book.config import SCALES, get_config
from smp_core import metrics
from smp_core.models import lenet5


@pytest.mark.parametrize("scale", SCALES)
def test_the_map_and_smp_runs_share_the_mnist_chapters_cache_keys(scale):
    cfg = get_config("mnist_baselines", scale)
    mnist = get_config("mnist", scale)
    assert mbs.mnist_settings(cfg) == mnist
    path = "a path"
    assert mr.run_key(mbs.mnist_settings(cfg), "none", 0, path) == mr.run_key(mnist, "none", 0, path)
    assert mr.map_key(mbs.mnist_settings(cfg)) == mr.map_key(mnist)


def test_weight_decay_is_the_prior_precision_of_the_summed_objective():
    """The gradient of mean NLL + wd/2 |theta|^2, times N, is that of sum NLL + alpha/2 |theta|^2 with
    alpha = N wd (a logistic model, autograd)."""
    cfg = {"n_train": 50, "map_weight_decay": 1e-3}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (50,), generator=g).double()
    theta = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    nll = torch.nn.functional.binary_cross_entropy_with_logits(x @ theta, y, reduction="none")
    (mean_grad,) = torch.autograd.grad(nll.mean() + cfg["map_weight_decay"] / 2 * theta.square().sum(), theta,
                                       retain_graph=True)
    alpha = mbs.weight_decay_prior(cfg)
    (sum_grad,) = torch.autograd.grad(nll.sum() + alpha / 2 * theta.square().sum(), theta)
    torch.testing.assert_close(50 * mean_grad, sum_grad, rtol=1e-12, atol=1e-12)


def test_adams_weight_decay_is_the_gradient_of_the_l2_term():
    """train_map's coupled weight decay: one step of Adam(weight_decay=wd) on the mean loss is one step
    of plain Adam on mean loss + wd/2 |theta|^2 (what weight_decay_prior's mapping assumes; AdamW's
    decoupled decay would not be)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g)
    nets = [torch.nn.Linear(4, 3) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    wd = 1e-2
    coupled = torch.optim.Adam(nets[0].parameters(), lr=1e-2, weight_decay=wd)
    plain = torch.optim.Adam(nets[1].parameters(), lr=1e-2)
    for _ in range(3):
        for net, opt, decay in ((nets[0], coupled, 0.0), (nets[1], plain, wd)):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            (loss + decay / 2 * sum((p**2).sum() for p in net.parameters())).backward()
            opt.step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    import inspect

    assert "torch.optim.Adam(" in inspect.getsource(mr.train_map)  # the optimiser this is about
    assert "weight_decay=cfg[\"map_weight_decay\"]" in inspect.getsource(mr.train_map)


def test_rotate():
    x = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(shifted.rotate(x, 0), x)
    # a quarter turn anticlockwise moves pixels exactly (up to the interpolation's rounding)
    torch.testing.assert_close(shifted.rotate(x, 90), torch.rot90(x, 1, dims=(-2, -1)), rtol=0, atol=1e-5)
    half = shifted.rotate(x, 45)
    assert half.shape == x.shape and not torch.allclose(half, x)
    assert float(half[..., 0, 0].abs().max()) == 0.0  # a corner comes from outside the image: filled with 0


def test_evaluate_per_image_scores_average_to_the_papers_metrics():
    g = torch.Generator().manual_seed(2)
    x = torch.rand(40, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (40,), generator=g)
    logits = 2 * torch.randn(5, 40, 10, generator=g)
    sets = {0: (x, y), 30: (x[:10], y[:10])}
    out = shifted.evaluate(lambda xs: logits[:, : xs.shape[0]], sets, three=7)
    probs = torch.softmax(logits.double(), -1)
    assert out["scores"] == metrics.all_scores(probs, y)
    for angle, n in ((0, 40), (30, 10)):
        assert float(out["per_image"][angle]["nll"].mean()) == pytest.approx(out["shift"][angle]["nll"], rel=1e-12)
        assert float(out["per_image"][angle]["brier"].mean()) == pytest.approx(out["shift"][angle]["brier"], rel=1e-12)
        assert out["per_image"][angle]["nll"].shape == (n,)
    torch.testing.assert_close(out["three_probs"], probs[:, 7].mean(0).float())
    assert out["n_samples"] == 5 and out["logits_variance"] == metrics.logits_variance(logits)


def _evals(per_image: dict[str, list[float]]) -> dict[str, dict]:
    return {n: {"per_image": {0: {"nll": torch.tensor(v, dtype=torch.float64),
                                  "brier": torch.tensor(v, dtype=torch.float64) / 10}}}
            for n, v in per_image.items()}


def test_findings_lead_is_paired_over_images():
    evals = _evals({"MAP": [1.0, 2.0, 3.0, 4.0], "SMP-none": [1.1, 2.2, 3.1, 4.2],
                    "Ensemble (5)": [0.9, 2.1, 2.9, 3.9]})
    f = mbs.findings(evals).set_index(["metric", "compared"])
    row = f.loc[("nll", "runner-up")]
    assert row["best"] == "Ensemble (5)" and row["other"] == "MAP"
    diffs = np.array([0.1, -0.1, 0.1, 0.1])
    assert row["lead_se"] == pytest.approx(diffs.mean() / (diffs.std(ddof=1) / 2))
    smp = f.loc[("nll", "best SMP")]
    diffs = np.array([0.2, 0.1, 0.2, 0.3])
    assert smp["other"] == "SMP-none" and smp["lead_se"] == pytest.approx(diffs.mean() / (diffs.std(ddof=1) / 2))
    assert bool(smp["resolved"]) and not bool(row["resolved"])
    assert f.loc[("brier", "best SMP"), "lead_se"] == pytest.approx(smp["lead_se"])  # the same pairs scaled
    # when an SMP variant is best or runner-up there is no separate best-SMP row
    best_smp = mbs.findings(_evals({"SMP-none": [0.1, 0.2], "MAP": [1.0, 1.1], "SMP-ema-diag": [2.0, 2.1]}))
    assert list(best_smp["compared"]) == ["runner-up", "runner-up"]
    second = mbs.findings(_evals({"MAP": [0.1, 0.2], "SMP-none": [1.0, 1.1], "SMP-ema-diag": [2.0, 2.1]}))
    assert list(second["other"]) == ["SMP-none", "SMP-none"]


def test_method_names():
    cfg = get_config("mnist_baselines", "laptop")
    names = mbs.method_names(cfg)
    assert names[:5] == mr.method_names()
    assert "Laplace-kfac (evidence)" in names and "Laplace-diag-nn (wd)" in names and names[-1] == "Ensemble (5)"
    assert names[-2] == mbs.DROPOUT and mbs.DROPOUT not in mbs.method_names({**cfg, "dropout_rates": []})
    assert len(set(names)) == len(names)
    assert mbs.ensemble_seed(cfg, 0) == cfg["seed"]  # member 0 is the MAP
    # MC dropout's networks: the MAP's settings and seed, their own cache keys
    for rate in cfg["dropout_rates"]:
        settings = mbs.mnist_settings(cfg, rate)
        assert settings["seed"] == cfg["seed"] and settings["map_dropout"] == rate
        assert mr.map_key(settings) != mr.map_key(mbs.mnist_settings(cfg))


def _tiny_mnist(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def part(n):
        return torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    return {"train": part(60), "val": part(20), "test": part(30)}


def test_run_study_end_to_end_and_from_the_cache(tmp_path, monkeypatch):
    cfg = {**get_config("mnist_baselines", "ci"), "n_train": 60, "n_val": 20, "n_test": 30, "map_epochs": 1,
           "n_chains": 3, "n_steps": 20, "period": 10, "shift_images": 12}
    data = _tiny_mnist()
    kw = dict(device=torch.device("cpu"), progress=False, cache_root=str(tmp_path))
    study = mbs.run_study(cfg, data, **kw)
    tables = shifted.tables(study)
    # every MAP (the ensemble's too) and SMP run went to the cache under tmp_path, none elsewhere
    assert len(list((tmp_path / "mnist").glob("*.pt"))) == cfg["ensemble_members"] + 4 + len(cfg["dropout_rates"])
    drop = tables["dropout"]
    assert list(drop.index) == cfg["dropout_rates"] and drop["selected"].sum() == 1
    assert drop.loc[drop["selected"], "val_nll"].iloc[0] == drop["val_nll"].min()
    assert study["evals"][mbs.DROPOUT]["n_samples"] == cfg["n_chains"]
    assert tables["scores"].loc[mbs.DROPOUT, "logits_variance"] > 0  # the masks vary the logits
    # the MC dropout row is the selected rate's network, predicting under the test masks' seed
    rate = float(drop.index[drop["selected"]][0])
    theta = mr.fit_map(mbs.mnist_settings(cfg, rate), data, **kw)["theta"]
    sets = shifted.test_sets(cfg, data)
    masks_seed = mbs.draw_seeds(cfg)["dropout_masks"]["test"]
    redo = shifted.evaluate(lambda x: baselines.mc_dropout_logits(
        lenet5(rate), theta, x, cfg["n_chains"], torch.Generator().manual_seed(masks_seed)), sets, study["three"])
    assert redo["scores"] == study["evals"][mbs.DROPOUT]["scores"]
    assert np.isfinite(tables["laplace"]["gradient_norm"]).all()
    assert list(tables["scores"].index) == mbs.method_names(cfg)
    assert list(tables["shift"].index.get_level_values("angle").unique()) == [0, 45]
    assert tables["three"].shape == (len(mbs.method_names(cfg)), 10)
    np.testing.assert_allclose(tables["three"].sum(axis=1), 1, rtol=1e-6)
    lap = tables["laplace"]
    assert lap.loc[("diag", "wd"), "prior_precision"] == mbs.weight_decay_prior(cfg) == 60 * cfg["map_weight_decay"]
    for structure in ("diag", "kfac"):  # the evidence's alpha has the larger log evidence, near MacKay's fixed point
        assert lap.loc[(structure, "evidence"), "log_evidence"] >= lap.loc[(structure, "wd"), "log_evidence"]
        assert lap.loc[(structure, "evidence"), "mackay_ratio"] == pytest.approx(1.0, abs=0.05)
    assert all(study["evals"][n]["n_samples"] == cfg["n_chains"] for n in mbs.method_names(cfg) if n.startswith("Lap"))
    assert study["evals"]["Ensemble (2)"]["n_samples"] == 2
    assert not math.isnan(tables["scores"].loc["Laplace-kfac (wd)", "logits_variance"])
    # the chapter's figure of the rotated sets
    fig = shifted.rotation_figure(tables["shift"], list(tables["scores"].index))
    assert len(fig.axes[0].lines) == len(mbs.method_names(cfg)) - len(cfg["laplace_structures"])  # no -nn rows
    plt.close(fig)
    # a second pass reads everything from the cache: no Laplace fit, no MAP training, no SMP run
    monkeypatch.setattr(mbs, "fit_laplaces", lambda *a, **k: pytest.fail("the Laplace fits were not cached"))
    monkeypatch.setattr(mr, "train_map", lambda *a, **k: pytest.fail("a MAP was not cached"))
    monkeypatch.setattr(mr, "run_variant", lambda *a, **k: pytest.fail("an SMP run was not cached"))
    again = shifted.tables(mbs.run_study(cfg, data, **kw))
    assert again["scores"].drop(columns="predict_seconds").equals(tables["scores"].drop(columns="predict_seconds"))
    assert again["laplace"].equals(lap)
    assert again["dropout"].drop(columns="val_seconds").equals(drop.drop(columns="val_seconds"))
    # MC dropout's grid is in MC dropout's cache keys only: without it every other row is still cached
    monkeypatch.setattr(shifted, "evaluate", lambda *a, **k: pytest.fail("a method's scores were not cached"))
    without = shifted.tables(mbs.run_study({**cfg, "dropout_rates": []}, data, **kw))
    assert mbs.DROPOUT not in without["scores"].index and "dropout" not in without
    assert without["scores"].drop(columns="predict_seconds").equals(
        tables["scores"].drop(index=mbs.DROPOUT, columns="predict_seconds"))


def test_leads_over_the_map():
    evals = _evals({"MAP": [1.0, 2.0, 3.0], "SMP-none": [0.9, 1.8, 2.9], "Ensemble (5)": [1.0, 2.0, 3.0]})
    table = shifted.leads_over(evals)
    diffs = np.array([0.1, 0.2, 0.1])
    assert table.loc["SMP-none", 0] == pytest.approx(diffs.mean() / (diffs.std(ddof=1) / math.sqrt(3)))
    assert math.isnan(table.loc["MAP", 0]) and math.isnan(table.loc["Ensemble (5)", 0])  # no spread: no lead
    assert (shifted.leads_over(evals, reference="SMP-none").loc["MAP"] < 0).all()  # worse than the reference
