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
