import pytest

from smp_book import mnist_runs as mr
from smp_book.config import MNIST_TAU, SCALES, TOY_VARIANTS, get_config, toy_tau


def test_paper_scale_uses_the_papers_settings():
    toy = get_config("toy", "paper")
    assert (toy["n_train"], toy["n_test"], toy["n_chains"], toy["n_steps"]) == (500, 5000, 1000, 5000)
    assert (toy["ridge"], toy["beta"], toy["period"], toy["nuts_target_accept"]) == (1e-4, 0.98, 500, 0.95)
    mnist = get_config("mnist", "paper")
    assert (mnist["n_train"], mnist["n_val"], mnist["n_chains"], mnist["n_steps"]) == (54_000, 6_000, 100, 10**6)
    assert (mnist["map_epochs"], mnist["map_batch"], mnist["map_lr"], mnist["map_weight_decay"]) == (20, 48, 1e-3, 1e-3)
    assert MNIST_TAU == {"none": 1.0, "fixed-diag": 0.05, "ema-diag": 0.08, "periodic-diag": 0.05}
    assert [toy_tau(v) for v in ("none", "ema-diag", "fixed-block", "periodic-dense")] == [1.0, 0.3, 0.3, 0.1]
    assert len(TOY_VARIANTS) == 10


def test_every_scale_exists_and_configs_are_copies():
    for study in ("toy", "toy_baselines", "toy_kfac", "toy_tail", "mnist", "mnist_baselines", "mnist_growth",
                  "mnist_kfac", "mnist_seeds", "mnist_tail"):
        for scale in SCALES:
            assert get_config(study, scale)["scale"] == scale
    a = get_config("toy", "ci")
    a["n_steps"] = -1
    assert get_config("toy", "ci")["n_steps"] > 0


def test_every_smp_chapter_states_its_variants_and_tau():
    for study in ("toy", "toy_kfac", "toy_tail", "mnist", "mnist_kfac", "mnist_seeds", "mnist_growth"):
        for scale in SCALES:
            cfg = get_config(study, scale)
            assert cfg["variants"] and all(cfg["tau"][v] > 0 for v in cfg["variants"]), (study, scale)
    toy, mnist = get_config("toy", "paper"), get_config("mnist", "paper")
    assert toy["tau"] == {v: toy_tau(v) for v in TOY_VARIANTS} and mnist["tau"] == MNIST_TAU  # the paper's
    assert mnist["tau"]["fixed-diag"] == 0.05


def test_unknown_names():
    with pytest.raises(ValueError, match="unknown scale"):
        get_config("toy", "huge")
    with pytest.raises(ValueError, match="unknown study"):
        get_config("cifar", "ci")


def test_kfac_study_shares_the_toy_settings_and_seeds():
    from smp_book.config import TOY_KFAC_VARIANTS, toy_tau

    for scale in SCALES:
        toy, kfac = get_config("toy", scale), get_config("toy_kfac", scale)
        assert {k: v for k, v in kfac.items() if k not in ("study", "variants", "tau")} == {
            k: v for k, v in toy.items() if k not in ("study", "variants", "tau")}  # the same data, NUTS and SMP
        assert kfac["variants"] == TOY_KFAC_VARIANTS and kfac["tau"] == {v: toy_tau(v) for v in TOY_KFAC_VARIANTS}
    assert {toy_tau(v) for v in TOY_KFAC_VARIANTS} == {0.3}


def test_baselines_study_shares_the_toy_settings_and_seeds():
    added = {"study", "smp_variants", "prior_precision", "laplace_structures", "ensemble_members"}
    for scale in SCALES:
        toy, baselines = get_config("toy", scale), get_config("toy_baselines", scale)
        assert {k: v for k, v in baselines.items() if k not in added} == {
            k: v for k, v in toy.items() if k != "study"}  # the same data, NUTS and SMP settings
        assert set(baselines["smp_variants"]) <= set(TOY_VARIANTS)  # rerun with the toy chapter's seeds
        assert baselines["prior_precision"] == 1.0  # NUTS's prior N(0, I)


def test_growth_study_shares_the_mnist_settings_but_s_and_k():
    for scale in SCALES:
        mnist, growth = get_config("mnist", scale), get_config("mnist_growth", scale)
        assert mr.map_key(growth) == mr.map_key(mnist)  # the same MAP, from the same cache
        assert "n_steps" not in growth and "smp_replicates" not in growth
        same = set(mnist) - {"n_steps", "smp_replicates", "n_chains", "study"}
        assert {k: growth[k] for k in same} == {k: mnist[k] for k in same}
        grid = growth["growth_steps"]
        assert grid == sorted(set(grid)) and all(k % 50 == 0 for k in grid)  # whole divergence-check blocks
    assert get_config("mnist_growth", "paper")["growth_steps"][-1] == get_config("mnist", "paper")["n_steps"]
    assert get_config("mnist_growth", "paper")["n_chains"] == 100


def test_mnist_kfac_study_changes_only_the_structure():
    from smp_book import mnist_study as ms
    from smp_book.config import MNIST_KFAC_VARIANTS, MNIST_VARIANTS

    for scale in SCALES:
        mnist, kfac = get_config("mnist", scale), get_config("mnist_kfac", scale)
        assert mr.map_key(kfac) == mr.map_key(mnist)  # the same MAP, from the same cache
        same = set(mnist) - {"study", "smp_replicates", "variants", "tau"}
        assert {k: kfac[k] for k in same} == {k: mnist[k] for k in same}
        assert {v: kfac["tau"][v] for v in mnist["tau"]} == mnist["tau"]  # the MNIST variants' own, kept
        assert ms.study_variants(kfac) == MNIST_KFAC_VARIANTS and ms.study_variants(mnist) == MNIST_VARIANTS
        # tau of each KFAC variant is the paper's for the diagonal variant with the same strategy
        assert {v: mr.variant_tau(kfac, v) for v in MNIST_KFAC_VARIANTS} == {
            v: MNIST_TAU[v.replace("kfac", "diag")] for v in MNIST_KFAC_VARIANTS}
        # seeds follow the MNIST study's four variants: no run shares a seed with one of its runs
        mnist_seeds = {ms.smp_seed(mnist, i, r) for r in range(3) for i in range(len(MNIST_VARIANTS))}
        kfac_seeds = {ms.smp_seed(kfac, i, r) for r in range(3) for i in range(len(MNIST_KFAC_VARIANTS))}
        assert len(kfac_seeds) == 3 * len(MNIST_KFAC_VARIANTS) and not kfac_seeds & mnist_seeds
        assert kfac["ema_refresh"] == 50
    assert get_config("mnist_kfac", "paper")["n_steps"] == 10**6


def test_tail_study_shares_the_toy_settings():
    for scale in SCALES:
        toy, tail = get_config("toy", scale), get_config("toy_tail", scale)
        changed = ("study", "variants", "tail_from", "tail_scores", "replicates")
        assert {k: v for k, v in tail.items() if k not in changed} == {
            k: v for k, v in toy.items() if k not in changed}  # the same data, NUTS and SMP settings
        assert tail["variants"] == TOY_VARIANTS
        assert all(0 < k < tail["n_steps"] and k % 50 == 0 for k in tail["tail_from"])  # stops on check blocks


def test_mnist_tail_checks_inside_the_mnist_run():
    for scale in SCALES:
        mnist, tail = get_config("mnist", scale), get_config("mnist_tail", scale)
        assert 0 < tail["check_from"] < mnist["n_steps"] and tail["check_from"] % 50 == 0
        assert tail["tail_to"] == 10**6 >= mnist["n_steps"]  # the paper's K


def test_mnist_baselines_study_shares_the_mnist_settings():
    from smp_book.config import MNIST_BASELINE_KEYS

    for scale in SCALES:
        mnist, baselines = get_config("mnist", scale), get_config("mnist_baselines", scale)
        assert {k: v for k, v in baselines.items() if k not in (*MNIST_BASELINE_KEYS, "study")} == {
            k: v for k, v in mnist.items() if k != "study"}  # the same data, MAP and SMP settings
        assert set(baselines["laplace_structures"]) <= {"diag", "kfac"}  # no d x d matrix for LeNet-5


def test_mnist_seeds_study_shares_the_mnist_settings():
    from smp_book import mnist_seeds_study as mss
    from smp_book import mnist_study as ms
    from smp_book.config import MNIST_VARIANTS

    for scale in SCALES:
        mnist, seeds = get_config("mnist", scale), get_config("mnist_seeds", scale)
        assert {k: v for k, v in seeds.items() if k not in ("map_seeds", "study")} == {
            k: v for k, v in mnist.items() if k not in ("study", "select_map_from_seeds")}
        assert seeds["map_seeds"] >= 2
        # every SMP run of every MAP and replicate draws its own random numbers
        runs = [ms.smp_seed({**seeds, "seed": mss.map_seed(seeds, m)}, i, r) for m in range(seeds["map_seeds"])
                for r in range(seeds["smp_replicates"]) for i in range(len(MNIST_VARIANTS))]
        assert len(set(runs)) == len(runs)


def test_the_paper_scale_chooses_its_map_among_five_seeds():
    paper, laptop = get_config("mnist", "paper"), get_config("mnist", "laptop")
    assert paper["select_map_from_seeds"] == [paper["seed"] + 100 * m for m in range(5)]
    assert "select_map_from_seeds" not in laptop and "select_map_from_seeds" not in get_config("mnist", "ci")
    for study in ("mnist_kfac", "mnist_growth", "mnist_baselines"):  # the same MAP as the MNIST chapter's
        assert get_config(study, "paper")["select_map_from_seeds"] == paper["select_map_from_seeds"]
    assert "select_map_from_seeds" not in get_config("mnist_seeds", "paper")  # each of its MAPs is its seed's
