"""The summary judges the claim 'periodic recomputation over-disperses least' once, from every source."""

import pandas as pd

from smp_book.summary_study import PERIODIC, _periodic_least


class _Res:
    def __init__(self, tables):
        self.tables_ = tables

    def has(self, name):
        return name in self.tables_

    def table(self, name):
        return self.tables_[name]


class _Ctx:
    def __init__(self, seeds_least, growth_least, lead_z):
        self.sources = {
            "mnist_seeds": _Res({"least_dispersed": pd.DataFrame({"least": seeds_least})}),
            "mnist_growth": _Res({"least_dispersed": pd.DataFrame({"least": [growth_least], "lead_z": [lead_z]},
                                                                  index=pd.Index([10_000], name="K"))})}

    def read(self, study):
        return self.sources[study]


def _claims(verdict):
    return pd.DataFrame({"claim": ["Periodic recomputation over-disperses least among the diagonal variants"],
                         "verdict": [verdict], "evidence": ["..."]})


def test_one_verdict_from_every_source():
    assert _periodic_least(_Ctx([PERIODIC] * 3, PERIODIC, 3.0), _claims("holds"))["verdict"] == "holds"
    # one MAP of three disagrees: partly, whatever the chapter's own MAP says
    partly = _periodic_least(_Ctx([PERIODIC, "SMP-fixed-diag", PERIODIC], PERIODIC, 3.0), _claims("holds"))
    assert partly["verdict"] == "partly" and "2 of 3 MAPs" in partly["evidence"]
    # a growth lead below 2 standard errors is not resolved and does not count either way
    unresolved = _periodic_least(_Ctx([PERIODIC], "SMP-fixed-diag", 1.0), _claims("holds"))
    assert unresolved["verdict"] == "holds" and "not resolved" in unresolved["evidence"]
    none = _periodic_least(_Ctx(["SMP-fixed-diag"], "SMP-ema-diag", 5.0), _claims("does not hold"))
    assert none["verdict"] == "does not hold"


def test_no_source_and_a_reworded_claim():
    import pytest

    class _Nothing:
        def read(self, study):
            return _Res({})

    assert _periodic_least(_Nothing(), _claims("holds"))["verdict"] == "holds"  # the chapter alone
    unchecked = pd.DataFrame({"claim": ["Periodic recomputation over-disperses least, reworded"],
                              "verdict": ["holds"], "evidence": ["..."]})
    assert _periodic_least(_Nothing(), unchecked)["verdict"] == "holds"
    with pytest.raises(ValueError, match="reworded"):
        _periodic_least(_Nothing(), pd.DataFrame({"claim": ["Something else"], "verdict": ["holds"],
                                                  "evidence": ["..."]}))


class _Results(_Res):
    def __init__(self, tables, scale, values=None, config=None):
        super().__init__(tables)
        self.manifest, self.values, self.config = {"scale": scale}, values or {}, config or {}


def test_the_mnist_claims_come_from_the_paper_scale_when_it_is_there():
    from smp_book.summary_study import claims

    class _Nothing:
        def read(self, study):
            return _Res({})

    scores = pd.DataFrame({"accuracy": [0.94, 0.94], "brier": [0.08, 0.08]}, index=["NUTS", "NUTS-mean"])
    toy = _Results({"claims": pd.DataFrame({"claim": ["a toy claim"], "verdict": ["holds"], "criterion": ["c"],
                                            "evidence": ["e"]}), "scores_mean": scores},
                   "laptop", values={"r_ratio": 0.09}, config={"n_steps": 5000})

    def mnist(scale, verdict, scores=None):
        from smp_book.paper import paper_table

        p3 = {"MAP": 0.9, "SMP-none": 0.9, "SMP-fixed-diag": 0.2, "SMP-ema-diag": 0.4, "SMP-periodic-diag": 0.6}
        ambiguous = pd.DataFrame({m: [(1 - p) / 9] * 3 + [p] + [(1 - p) / 9] * 6 for m, p in p3.items()},
                                 index=[str(c) for c in range(10)]).T  # as the paper describes its 3
        table = _claims(verdict).assign(criterion="c")
        return _Results({"claims": table, "scores_mean": paper_table("ex2_scores") if scores is None else scores,
                         "variances_mean": paper_table("ex2_variances"), "ambiguous_three": ambiguous,
                         "elapsed_mean": paper_table("ex2_elapsed")}, scale, values={"fisher_zero_fraction": 0.6})

    judged = claims(_Nothing(), toy, mnist("paper", "does not hold"), mnist("laptop", "holds"))
    row = judged[judged["claim"].str.startswith("Periodic")].iloc[0]
    assert row["verdict"] == "does not hold" and row["scale"] == "paper"
    assert row["evidence"].endswith("at the laptop scale: holds")
    assert set(judged.loc[judged["section"] == "3.2 toy", "scale"]) == {"laptop"}
    # the further claims of Section 3.3, judged from the same tables, with this scale's verdict beside
    paper_scale_scores = mnist("paper", "holds").table("scores_mean")
    reordered = paper_scale_scores.copy()
    reordered.loc["SMP-ema-diag", "mutual_info"] = 5.0  # EMA disperses most at this scale
    judged = claims(_Nothing(), toy, mnist("paper", "holds", paper_scale_scores.copy()),
                    mnist("laptop", "holds", reordered))
    row = judged[judged["claim"].str.startswith("Dispersion is largest")].iloc[0]
    assert row["verdict"] == "holds" and row["scale"] == "paper" and row["chapter"] == "mnist"
    assert row["evidence"].endswith("at the laptop scale: partly")
    assert judged["claim"].str.startswith("Calibration").sum() == 1
    alone = claims(_Nothing(), toy, mnist("laptop", "holds"))  # no paper-scale results: this scale's
    row = alone[alone["claim"].str.startswith("Periodic")].iloc[0]
    assert row["scale"] == "laptop" and "at the laptop scale" not in row["evidence"]


def test_the_tail_table_gains_the_paper_scale_recursion_when_it_is_there():
    from smp_book.summary_study import tail_table

    methods = pd.Index(["SMP-none", "SMP-fixed-diag"], name="method")
    ratios = pd.DataFrame({"ratio (logits)": [1.0, 0.9]},
                          index=pd.MultiIndex.from_product([methods, [2000]], names=["method", "tail_from"]))
    beside = pd.DataFrame({"MI": [0.0002, 0.0001, 1.877, 0.03]},
                          index=pd.MultiIndex.from_product([methods, ["paper", "recursion"]],
                                                           names=["method", "sampler"]))
    tail = _Results({"ratios": ratios, "beside_paper": beside}, "laptop")
    plain = tail_table(tail)
    assert list(plain.columns) == ["ratio (logits)", "paper", "recursion"]
    scores = pd.DataFrame({"mutual_info": [0.0, 0.0005, 1.1]}, index=["MAP", "SMP-none", "SMP-fixed-diag"])
    paper = _Results({"scores": scores}, "paper", values={"map_seed": 2426}, config={"n_steps": 1_000_000})
    table = tail_table(tail, paper)
    column = "recursion to 1,000,000 (paper scale, MAP of seed 2426)"
    assert table.loc["SMP-fixed-diag", column] == 1.1 and table.loc["SMP-none", column] == 0.0005
    assert tail_table(_Results({}, "laptop")) is None
