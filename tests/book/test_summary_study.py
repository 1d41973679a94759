"""The summary's tail table."""

import pandas as pd


class _Res:
    def __init__(self, tables):
        self.tables_ = tables

    def has(self, name):
        return name in self.tables_

    def table(self, name):
        return self.tables_[name]


class _Results(_Res):
    def __init__(self, tables, scale, values=None, config=None):
        super().__init__(tables)
        self.manifest, self.values, self.config = {"scale": scale}, values or {}, config or {}


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
