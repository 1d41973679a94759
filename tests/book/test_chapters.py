"""Chapters shown from their results files: computed once, read back equal, replaced only when complete,
and the reproduction report's verdicts."""

import json
import sys
import types

import numpy as np
import pandas as pd
import pytest

from smp_book import chapters, reproduce

CALLS = []


def _fake_study(name, shift=0.0, fail=False, verdict="holds"):
    """A study module with a config of its own, writing a replicated table, a plain one and a value."""
    module = types.ModuleType(name)

    def config(scale):
        return {"n": 3, "scale": scale, "shift": shift}

    def compute(ctx):
        CALLS.append(ctx.study)
        rng = np.random.default_rng(int(ctx.config["n"]))
        rep = pd.DataFrame({"score": rng.normal(1.0 + ctx.config["shift"], 0.1, 6), "seconds": rng.uniform(1, 2, 6)},
                           index=pd.MultiIndex.from_product([range(3), ["a", "b"]], names=["replicate", "method"]))
        mean = rep.groupby(level="method").mean()
        ctx.table("scores_mean", mean)
        ctx.table("scores_std", rep.groupby(level="method").std(ddof=1))
        ctx.table("scores_replicates", rep)
        ctx.table("scores", rep.xs(0, level="replicate"))  # the first replicate alone
        wide = pd.DataFrame([[1.0, 2.0]], columns=pd.MultiIndex.from_tuples([("x", "paper"), ("x", "ours")]),
                            index=pd.Index(["m"], name="method"))
        ctx.table("wide", wide)
        claims = pd.DataFrame({"claim": ["c"], "verdict": [verdict], "evidence": [f"mean {mean.iloc[0, 1]:.3f}"]})
        ctx.table("claims", claims, index=False)
        ctx.table("flags", pd.DataFrame({"resolved": [ctx.config["shift"] < 1]}, index=pd.Index(["m"], name="method")))
        ctx.value("best", mean["score"].max())
        if fail:
            raise RuntimeError("interrupted")

    module.config, module.compute = config, compute
    return module


@pytest.fixture
def fake(monkeypatch, tmp_path):
    def install(**kw):
        monkeypatch.setitem(sys.modules, "fake_study", _fake_study("fake_study", **kw))
    install()
    monkeypatch.setattr(chapters, "STUDIES", {"fake": "fake_study"})
    monkeypatch.setattr(reproduce, "STUDIES", {"fake": "fake_study"})
    monkeypatch.setattr(chapters, "code_hash", lambda module: "c0de")
    monkeypatch.setattr(chapters, "LOADS", tmp_path / "loads")
    CALLS.clear()
    return install


def test_computed_once_then_read_back_equal(fake, tmp_path):
    first = chapters.results("fake", "ci", root=tmp_path)
    again = chapters.results("fake", "ci", root=tmp_path)
    assert CALLS == ["fake"]
    for name in ("scores_mean", "scores_replicates", "wide", "claims"):
        assert again.table(name).equals(first.table(name))
    assert again.table("scores_replicates").index.names == ["replicate", "method"]
    assert again.table("wide").columns.nlevels == 2
    assert again.values["best"] == pytest.approx(again.table("scores_mean")["score"].max())
    manifest = json.loads((tmp_path / "ci" / "fake" / "manifest.json").read_text())
    assert manifest["config"] == {"n": 3, "scale": "ci", "shift": 0.0} and manifest["code"] == "c0de"


def test_other_settings_recompute_and_code_only_when_asked(fake, tmp_path, monkeypatch):
    chapters.results("fake", "ci", root=tmp_path)
    fake(shift=1.0)
    chapters.results("fake", "ci", root=tmp_path)
    assert CALLS == ["fake", "fake"]
    monkeypatch.setattr(chapters, "code_hash", lambda module: "other")
    chapters.results("fake", "ci", root=tmp_path)  # the book shows results of other code
    assert len(CALLS) == 2
    chapters.results("fake", "ci", root=tmp_path, code=True)  # reproduce does not
    assert len(CALLS) == 3


def test_read_only_reads_matching_results_and_refuses_to_compute_the_rest(fake, tmp_path, monkeypatch):
    monkeypatch.setenv(chapters.READ_ONLY, "1")
    with pytest.raises(RuntimeError, match="no readable manifest.json.*forbids computing"):
        chapters.results("fake", "ci", root=tmp_path)
    assert CALLS == []
    monkeypatch.delenv(chapters.READ_ONLY)
    chapters.results("fake", "ci", root=tmp_path)
    monkeypatch.setenv(chapters.READ_ONLY, "1")
    assert chapters.results("fake", "ci", root=tmp_path).config["shift"] == 0.0  # read, not computed
    fake(shift=1.0)
    with pytest.raises(RuntimeError, match="computed with other settings"):
        chapters.results("fake", "ci", root=tmp_path)
    assert CALLS == ["fake"]


def test_an_interrupted_run_leaves_the_results_as_they_were(fake, tmp_path):
    before = chapters.results("fake", "ci", root=tmp_path).table("scores_mean")
    fake(shift=1.0, fail=True)
    with pytest.raises(RuntimeError, match="interrupted"):
        chapters.results("fake", "ci", root=tmp_path)
    kept = chapters.Results(tmp_path / "ci" / "fake")
    assert kept.table("scores_mean").equals(before) and kept.config["shift"] == 0.0


def test_bad_names_are_refused(fake, tmp_path):
    with pytest.raises(ValueError, match="study: unknown study 'nope'"):
        chapters.results("nope", "ci", root=tmp_path)
    with pytest.raises(ValueError, match="scale: unknown scale 'huge'"):
        chapters.results("fake", "huge", root=tmp_path)
    res = chapters.results("fake", "ci", root=tmp_path)
    with pytest.raises(KeyError, match="no table 'missing'"):
        res.table("missing")


def test_the_report_judges_each_cell(fake, tmp_path):
    old = chapters.results("fake", "ci", root=tmp_path / "old")
    same = chapters.results("fake", "ci", root=tmp_path / "same")
    cells = reproduce.compare_study(old, same)
    verdicts = cells.set_index(["table", "row", "column"])["verdict"]
    assert set(verdicts.loc["scores_mean"].loc[:, "score"]) == {"equal"}
    assert set(verdicts.loc["scores_mean"].loc[:, "seconds"]) == {"timing"}
    assert set(verdicts.loc["scores"].loc[:, "score"]) == {"equal"}
    assert verdicts.loc[("wide", "m", "('x', 'ours')")] == "equal"
    assert verdicts.loc[("claims", "c", "verdict")] == "same"  # a claims table is keyed by its claim
    assert verdicts.loc[("claims", "c", "evidence")] == "text"
    assert verdicts.loc[("flags", "m", "resolved")] == "same"  # a yes/no cell is judged, not passed as text
    fake(shift=5.0, verdict="does not hold")  # 50 standard deviations away
    moved = chapters.results("fake", "ci", root=tmp_path / "moved")
    verdicts = reproduce.compare_study(old, moved).set_index(["table", "row", "column"])["verdict"]
    assert set(verdicts.loc["scores_mean"].loc[:, "score"]) == {"outside"}
    assert set(verdicts.loc["scores"].loc[:, "score"]) == {"outside"}  # one replicate, 35 sds away
    assert verdicts.loc[("claims", "c", "verdict")] == "changed"
    assert verdicts.loc[("flags", "m", "resolved")] == "changed"


def test_reproduce_replaces_the_results_only_when_complete(fake, tmp_path):
    committed, work = tmp_path / "results", tmp_path / "work"
    chapters.results("fake", "ci", root=committed)
    fake(shift=5.0)
    assert reproduce.main(["--scale", "ci", "--results", str(committed), "--work", str(work)]) == 0
    new = chapters.Results(committed / "ci" / "fake")
    assert new.config["shift"] == 5.0
    counts = pd.read_csv(committed / "ci" / "reproduction" / "counts.csv", index_col="study")
    assert counts.loc["fake", "outside"] == 4
    assert not (work / "ci").exists()
    assert reproduce.read_report("ci", root=committed)[1].loc["fake", "judged these results"] == "yes"
    chapters.results("fake", "ci", root=committed, recompute=True)  # recomputed after the report
    assert reproduce.read_report("ci", root=committed)[1].loc["fake", "judged these results"] == "no (recomputed since)"


def test_timings_come_from_the_manifests(fake, tmp_path):
    chapters.results("fake", "ci", root=tmp_path)
    table = chapters.timings("ci", root=tmp_path)
    assert list(table.index) == ["fake"] and table.loc["fake", "minutes"] >= 0


def test_results_read_from_another_study_go_stale_with_it(fake, tmp_path, monkeypatch):
    reader = types.ModuleType("reader_study")
    reader.config = lambda scale: {"scale": scale}
    reader.compute = lambda ctx: (CALLS.append("reader"), ctx.value("best", ctx.read("fake").values["best"]))
    monkeypatch.setitem(sys.modules, "reader_study", reader)
    monkeypatch.setattr(chapters, "STUDIES", {"fake": "fake_study", "reader": "reader_study"})
    first = chapters.results("reader", "ci", root=tmp_path).values["best"]
    chapters.results("reader", "ci", root=tmp_path)
    assert CALLS == ["reader", "fake"]
    fake(shift=1.0)
    chapters.results("fake", "ci", root=tmp_path)  # the source recomputed with other settings
    again = chapters.results("reader", "ci", root=tmp_path).values["best"]
    assert CALLS == ["reader", "fake", "fake", "reader"] and again > first


def test_the_report_reads_committed_results_of_an_older_format(fake, tmp_path):
    committed, work = tmp_path / "results", tmp_path / "work"
    chapters.results("fake", "ci", root=committed)
    manifest = committed / "ci" / "fake" / "manifest.json"
    old = json.loads(manifest.read_text())
    del old["tables"], old["format"]  # as the manifests written before chapters.py
    manifest.write_text(json.dumps(old))
    chapters.results("fake", "ci", root=work)
    cells, counts = reproduce.report(committed, work, "ci")
    assert counts.loc["fake", "equal"] > 0 and "only new" not in counts.columns


def test_beside_scales_puts_the_paper_then_each_scale_per_column():
    paper = pd.DataFrame({"nll": [0.038, 0.5]}, index=["MAP", "SMP-none"])
    big = pd.DataFrame({"nll": [0.04, 0.6]}, index=["MAP", "SMP-none"])
    small = pd.DataFrame({"nll": [0.041, 0.55], "mi": [0.0, 0.01]}, index=["MAP", "SMP-none"])
    small_sd = pd.DataFrame({"nll": [np.nan, 0.02], "mi": [np.nan, 0.001]}, index=["MAP", "SMP-none"])
    table = chapters.beside_scales(paper, {"paper scale": (big, None), "laptop": (small, small_sd)})
    assert list(table.columns) == [("nll", "paper"), ("nll", "paper scale"), ("nll", "laptop")]
    assert table.loc["SMP-none", ("nll", "laptop")] == "0.5500 ± 0.0200"
    assert table.loc["MAP", ("nll", "laptop")] == "0.0410"  # one value, no spread
    assert table.loc["MAP", ("nll", "paper")] == "0.0380"
    with pytest.raises(ValueError, match="scaled"):
        chapters.beside_scales(paper, {})



def test_paper_scale_choices_name_the_map_rule_and_the_fisher_subset(tmp_path):
    def run(config, values, candidates=None):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        tables = {}
        if candidates is not None:
            candidates.to_csv(folder / "map_candidates.csv", index=False)
            tables["map_candidates"] = {"index": 0, "header": 1}
        (folder / "manifest.json").write_text(json.dumps({"config": config, "tables": tables}))
        (folder / "values.json").write_text(json.dumps(values))
        return chapters.Results(folder)

    chosen = run({"n_val": 6000, "n_fisher_periodic": 1000, "select_map_from_seeds": [7, 107]}, {"map_seed": 107},
                 pd.DataFrame({"seed": [7, 107], "val_loss": [0.05, 0.04]}))
    text = chapters.paper_scale_choices(chosen)
    assert "seed 107" in text and "7: 0.0500, 107: 0.0400" in text
    assert "first 1,000 of the 6,000 validation images" in text
    plain = chapters.paper_scale_choices(run({"n_val": 6000, "n_fisher_periodic": None}, {"map_seed": 7}))
    assert "seed 7" in plain and "all 6,000 validation images, as in the paper" in plain


def test_the_tail_table_gets_the_paper_scale_recursion_under_each_method(tmp_path):
    methods = pd.Index(["MAP", "SMP-none"], name="method")
    scores = pd.DataFrame({"nll": [0.03, 0.04], "ece": [0.01, 0.02], "mutual_info": [0.0, 0.5],
                           "accuracy": [0.99, 0.98]}, index=methods)
    variances = pd.DataFrame({"params_variance": [np.nan, 1e-4], "logits_variance": [np.nan, 7.0]}, index=methods)
    scores.to_csv(tmp_path / "scores.csv")  # the first replicate's
    variances.to_csv(tmp_path / "variances.csv")
    (scores * 0).to_csv(tmp_path / "scores_mean.csv")  # not read: the tails are of the first replicate
    layout = {"index": 1, "header": 1}
    tables = {"scores": layout, "variances": layout, "scores_mean": layout}
    (tmp_path / "manifest.json").write_text(json.dumps({"config": {"n_steps": 1_000_000}, "tables": tables}))
    (tmp_path / "values.json").write_text(json.dumps({"map_seed": 2426}))
    run = chapters.Results(tmp_path)
    beside = pd.DataFrame({"MI": [0.2, 0.1, 0.3], "logit variance": [1.0, 0.5, 2.0]},
                          index=pd.MultiIndex.from_tuples([("SMP-none", "paper"), ("SMP-none", "recursion"),
                                                           ("SMP-none", "tail")], names=["method", "sampler"]))
    table = chapters.with_paper_scale_rows(beside, run, map_seed=2026)
    label = "recursion at the paper scale (K = 1,000,000, MAP of seed 2426)"
    assert list(table.index) == [*beside.index, ("SMP-none", label)]
    assert table.loc[("SMP-none", label), "MI"] == 0.5 and table.loc[("SMP-none", label), "logit variance"] == 7.0
    same = chapters.with_paper_scale_rows(beside, run, map_seed=2426)  # the same MAP: no seed in the label
    assert same.index[-1] == ("SMP-none", "recursion at the paper scale (K = 1,000,000)")

def test_benchmark_table_reads_the_table_after_the_last_heading(tmp_path):
    from smp_book.chapters import benchmark_table

    path = tmp_path / "bench.md"
    path.write_text("Runs\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
                    "Runs\n\n| a | b |\n|---|---|\n| 3 | 4 |\n| 5 | 6 |\n\ntext\n")
    table = benchmark_table(path, "Runs")
    assert table.columns.tolist() == ["a", "b"] and table.to_numpy().tolist() == [["3", "4"], ["5", "6"]]
    assert benchmark_table(path, "Runs", index=["a"]).loc["5", "b"] == "6"
    assert benchmark_table(path, "Other") is None
    assert benchmark_table(tmp_path / "missing.md", "Runs") is None
    assert table.attrs["heading"] == "Runs"
    path.write_text("Runs\n\nno table here\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert benchmark_table(path, "Runs") is None  # not the table of the next section
    path.write_text("Runs\n| a | b |\n| 1 | 2 |\n| 3 | |\n")
    assert benchmark_table(path, "Runs") is None  # no separator row: not a table


def test_results_that_quote_another_scales_settings_are_stale_once_those_change(fake, tmp_path, monkeypatch):
    """ctx.settings records what a chapter quotes from other settings (the code hash leaves the settings
    tables out), and a change there makes its results stale."""
    module = sys.modules["fake_study"]
    plain = module.compute

    def compute(ctx):
        plain(ctx)
        ctx.value("paper_k", ctx.settings("mnist", "paper")["n_steps"])

    monkeypatch.setattr(module, "compute", compute)
    first = chapters.results("fake", "ci", root=tmp_path)
    assert first.values["paper_k"] == 1_000_000 and "mnist/paper" in first.manifest["settings_read"]
    chapters.results("fake", "ci", root=tmp_path)
    assert CALLS == ["fake"]
    original = chapters.get_config
    changed = {**original("mnist", "paper"), "n_steps": 10}

    def patched(study, scale):
        return changed if (study, scale) == ("mnist", "paper") else original(study, scale)

    monkeypatch.setattr(chapters, "get_config", patched)
    monkeypatch.setenv(chapters.READ_ONLY, "1")
    with pytest.raises(RuntimeError, match="the mnist/paper settings it quotes have changed"):
        chapters.results("fake", "ci", root=tmp_path)


def test_another_scales_results_are_read_when_there_and_their_arrival_makes_a_reader_stale(fake, tmp_path,
                                                                                           monkeypatch):
    """read_other_scale never computes; what it found, or that it found nothing, is in the manifest, so the
    reader is stale once the other scale's results appear or are recomputed."""
    reader = types.ModuleType("reader_study")
    reader.config = lambda scale: {"scale": scale}

    def compute(ctx):
        CALLS.append("reader")
        other = ctx.read_other_scale("fake", "paper")
        ctx.value("found", other is not None)

    reader.compute = compute
    monkeypatch.setitem(sys.modules, "reader_study", reader)
    monkeypatch.setattr(chapters, "STUDIES", {"fake": "fake_study", "reader": "reader_study"})
    assert chapters.results("reader", "ci", root=tmp_path).values["found"] is False
    assert CALLS == ["reader"]  # the paper scale was not computed
    chapters.results("fake", "paper", root=tmp_path)
    monkeypatch.setenv(chapters.READ_ONLY, "1")
    with pytest.raises(RuntimeError, match="the ../paper/fake results it did not find are there now"):
        chapters.results("reader", "ci", root=tmp_path)
    monkeypatch.delenv(chapters.READ_ONLY)
    assert chapters.results("reader", "ci", root=tmp_path).values["found"] is True
    chapters.results("fake", "paper", root=tmp_path, recompute=True)
    monkeypatch.setenv(chapters.READ_ONLY, "1")
    with pytest.raises(RuntimeError, match="the ../paper/fake results it read have been recomputed since"):
        chapters.results("reader", "ci", root=tmp_path)


def test_timings_are_marked_when_any_session_that_computed_them_shared_the_machine(fake, tmp_path, monkeypatch):
    """A run resumed from checkpoints sums the seconds of every session: one with a high load, even one
    killed before it finished, marks the timings of the session that completes the study alone."""
    threads = chapters.environment()["torch_threads"]
    loads = iter([threads + 3.0] + [0.0] * 1000)
    monkeypatch.setattr(chapters.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    fake(fail=True)
    with pytest.raises(RuntimeError, match="interrupted"):  # a busy session, killed
        chapters.results("fake", "ci", root=tmp_path / "busy")
    fake()  # the session that completes it sees an idle machine
    res = chapters.results("fake", "ci", root=tmp_path / "busy")
    assert f"other work ran: load average up to 3.0 above the {threads} thread(s)" in res.manifest["timing_note"]
    monkeypatch.setattr(chapters, "LOADS", tmp_path / "other-loads")  # no busy session recorded
    assert "timing_note" not in chapters.results("fake", "ci", root=tmp_path / "idle").manifest


def test_the_load_record_keeps_the_highest_and_never_stops_a_study(tmp_path, monkeypatch):
    monkeypatch.setattr(chapters.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # the loads come from _see
    record = tmp_path / "loads" / "x.json"
    with chapters._LoadMonitor(2, record) as first:
        first._see(2.5)  # not busy: nothing recorded
        assert not record.exists() and first.note is None
        first._see(5.0)  # a rise after the start is saved
    assert json.loads(record.read_text()) == {"excess": 3.0, "threads": 2}
    with chapters._LoadMonitor(4, record) as later:  # a lower session keeps the higher record and its threads
        later._see(5.0)
    assert json.loads(record.read_text()) == {"excess": 3.0, "threads": 2}
    assert "up to 3.0 above the 2 thread(s)" in later.note
    for broken in ("{", '{"excess": NaN, "threads": 2}', '{"excess": "high"}'):  # unreadable: ignored
        record.write_text(broken)
        with chapters._LoadMonitor(2, record) as monitor:
            pass
        assert monitor.note is None
    (tmp_path / "file").write_text("")
    with chapters._LoadMonitor(2, tmp_path / "file" / "x.json") as monitor:  # unwritable: still watched
        monitor._see(9.0)
    assert "up to 7.0" in monitor.note


def test_ratio_to_paper_divides_the_shared_cells_and_leaves_zeros_out():
    paper = pd.DataFrame({"mi": [0.0, 2.0], "nll": [0.04, 1.0]}, index=["MAP", "SMP-fixed-diag"])
    ours = pd.DataFrame({"mi": [0.0, 1.0], "nll": [0.05, 0.5], "extra": [1.0, 2.0]},
                        index=["MAP", "SMP-fixed-diag"])
    ratio = chapters.ratio_to_paper(ours, paper)
    assert list(ratio.columns) == ["mi", "nll"]
    assert ratio.loc["SMP-fixed-diag", "mi"] == 0.5 and ratio.loc["MAP", "nll"] == pytest.approx(1.25)
    assert np.isnan(ratio.loc["MAP", "mi"])  # the paper's 0
