"""The pipeline: a study computed once and read back equal, replaced only when complete, stale when its
settings or sources change, never computed when read-only; a chapter's parameters; the reproduction report."""

import json
import sys
import types

import numpy as np
import pandas as pd
import pytest

from smp_book import judge, pipeline, reproduce
from smp_book.judge import judge_by_map_seeds
from smp_book.results import Results
from smp_book.show import timings

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
    monkeypatch.setattr(pipeline, "STUDIES", {"fake": "fake_study"})
    monkeypatch.setattr(reproduce, "STUDIES", {"fake": "fake_study"})
    monkeypatch.setattr(judge, "STUDIES", {"fake": "fake_study"})
    monkeypatch.setattr(pipeline, "code_hash", lambda module: "c0de")
    CALLS.clear()
    return install


def test_computed_once_then_read_back_equal(fake, tmp_path):
    first = pipeline.results("fake", "ci", root=tmp_path)
    again = pipeline.results("fake", "ci", root=tmp_path)
    assert CALLS == ["fake"]
    for name in ("scores_mean", "scores_replicates", "wide", "claims"):
        assert again.table(name).equals(first.table(name))
    assert again.table("scores_replicates").index.names == ["replicate", "method"]
    assert again.table("wide").columns.nlevels == 2
    assert again.values["best"] == pytest.approx(again.table("scores_mean")["score"].max())
    manifest = json.loads((tmp_path / "ci" / "fake" / "manifest.json").read_text())
    assert manifest["config"] == {"n": 3, "scale": "ci", "shift": 0.0} and manifest["code"] == "c0de"
    # the versions of what computes the numbers, the baselines' laplace-torch and curvlinops included
    packages = manifest["environment"]["packages"]
    assert {"torch", "jax", "jaxlib", "numpyro", "laplace-torch", "curvlinops-for-pytorch"} <= set(packages)
    assert packages["laplace-torch"] and packages["torch"]


def test_other_settings_recompute_and_other_code_is_shown_with_a_note(fake, tmp_path, monkeypatch):
    pipeline.results("fake", "ci", root=tmp_path)
    fake(shift=1.0)
    pipeline.results("fake", "ci", root=tmp_path)
    assert CALLS == ["fake", "fake"]
    notes = []
    monkeypatch.setattr(pipeline, "note", notes.append)
    monkeypatch.setattr(pipeline, "code_hash", lambda module: "other")
    pipeline.results("fake", "ci", root=tmp_path)  # the book shows results of other code, with a note
    assert len(CALLS) == 2 and "earlier version of the code" in notes[0]


def test_read_only_reads_matching_results_and_refuses_to_compute_the_rest(fake, tmp_path, monkeypatch):
    monkeypatch.setenv(pipeline.READ_ONLY, "1")
    with pytest.raises(RuntimeError, match="no readable manifest.json.*forbids computing"):
        pipeline.results("fake", "ci", root=tmp_path)
    assert CALLS == []
    monkeypatch.delenv(pipeline.READ_ONLY)
    pipeline.results("fake", "ci", root=tmp_path)
    monkeypatch.setenv(pipeline.READ_ONLY, "1")
    assert pipeline.results("fake", "ci", root=tmp_path).config["shift"] == 0.0  # read, not computed
    fake(shift=1.0)
    with pytest.raises(RuntimeError, match="computed with other settings"):
        pipeline.results("fake", "ci", root=tmp_path)
    assert CALLS == ["fake"]


def test_an_interrupted_run_leaves_the_results_as_they_were(fake, tmp_path):
    before = pipeline.results("fake", "ci", root=tmp_path).table("scores_mean")
    fake(shift=1.0, fail=True)
    with pytest.raises(RuntimeError, match="interrupted"):
        pipeline.results("fake", "ci", root=tmp_path)
    kept = Results(tmp_path / "ci" / "fake")
    assert kept.table("scores_mean").equals(before) and kept.config["shift"] == 0.0


def test_bad_names_are_refused(fake, tmp_path):
    with pytest.raises(ValueError, match="study: unknown study 'nope'"):
        pipeline.results("nope", "ci", root=tmp_path)
    with pytest.raises(ValueError, match="scale: unknown scale 'huge'"):
        pipeline.results("fake", "huge", root=tmp_path)
    res = pipeline.results("fake", "ci", root=tmp_path)
    with pytest.raises(KeyError, match="no table 'missing'"):
        res.table("missing")


def test_the_report_judges_each_cell(fake, tmp_path):
    old = pipeline.results("fake", "ci", root=tmp_path / "old")
    same = pipeline.results("fake", "ci", root=tmp_path / "same")
    cells = judge.compare_study(old, same)
    verdicts = cells.set_index(["table", "row", "column"])["verdict"]
    assert set(verdicts.loc["scores_mean"].loc[:, "score"]) == {"equal"}
    assert set(verdicts.loc["scores_mean"].loc[:, "seconds"]) == {"timing"}
    assert set(verdicts.loc["scores"].loc[:, "score"]) == {"equal"}
    assert verdicts.loc[("wide", "m", "('x', 'ours')")] == "equal"
    assert verdicts.loc[("claims", "c", "verdict")] == "same"  # a claims table is keyed by its claim
    assert verdicts.loc[("claims", "c", "evidence")] == "text"
    assert verdicts.loc[("flags", "m", "resolved")] == "same"  # a yes/no cell is judged, not passed as text
    fake(shift=5.0, verdict="does not hold")  # 50 standard deviations away
    moved = pipeline.results("fake", "ci", root=tmp_path / "moved")
    verdicts = judge.compare_study(old, moved).set_index(["table", "row", "column"])["verdict"]
    assert set(verdicts.loc["scores_mean"].loc[:, "score"]) == {"outside"}
    assert set(verdicts.loc["scores"].loc[:, "score"]) == {"outside"}  # one replicate, 35 sds away
    assert verdicts.loc[("claims", "c", "verdict")] == "changed"
    assert verdicts.loc[("flags", "m", "resolved")] == "changed"


def test_numbers_formatted_for_a_page_are_text_in_the_report():
    assert judge.judge("ratios_mean", "ratio", 0.99, 0.98, None, None)[0] == "differs"
    assert judge.judge("ratios", "ratio", "0.994 ± 0.044", "0.987 ± 0.030", None, None)[0] == "text"
    assert judge.judge("agreement_shown", "agrees", "none", "1000", None, None)[0] == "text"
    assert judge.judge("agreement", "agrees", "none", "1000", None, None)[0] == "changed"


def test_reproduce_replaces_the_results_only_when_complete(fake, tmp_path, monkeypatch):
    committed, work = tmp_path / "results", tmp_path / "work"
    monkeypatch.setattr(reproduce, "RESULTS", committed)
    pipeline.results("fake", "ci", root=committed)
    fake(shift=5.0)
    monkeypatch.setattr(reproduce, "STUDIES", {"fake": "fake_study", "other": "other_study"})
    assert reproduce.main(["--scale", "ci", "--work", str(work), "--only", "fake"]) == 0  # partial: kept
    assert Results(committed / "ci" / "fake").config["shift"] == 0.0
    monkeypatch.setattr(reproduce, "STUDIES", {"fake": "fake_study"})
    (committed / "ci" / "reproduction-seed-4").mkdir()  # what no study writes is kept
    (committed / "ci" / "reproduction-seed-4" / "cells.csv").write_text("study\n")
    assert reproduce.main(["--scale", "ci", "--work", str(work)]) == 0
    assert Results(committed / "ci" / "fake").config["shift"] == 5.0
    assert (committed / "ci" / "reproduction-seed-4" / "cells.csv").read_text() == "study\n"
    _, counts, runs = reproduce.read_report("ci", root=committed)
    assert counts.loc["fake", "outside"] == 4
    run = runs.set_index("study").loc["fake"]  # what differs between the two runs compared
    assert (run["code"], run["settings"], run["seeds"]) == ("same", "changed", "same")
    assert not (work / "ci").exists()


def test_a_seed_offset_reruns_the_seeded_chapters_apart_and_keeps_the_results(fake, tmp_path, monkeypatch):
    from smp_book import config

    committed, work = tmp_path / "results", tmp_path / "work"
    monkeypatch.setattr(reproduce, "RESULTS", committed)
    monkeypatch.setitem(config.PARAMETERS, "fake", {"seed": "n"})  # the fake study's seed is its setting n
    monkeypatch.setattr(reproduce, "get_config", lambda study, scale: {"seed": 3})
    pipeline.results("fake", "ci", root=committed)
    assert reproduce.main(["--scale", "ci", "--work", str(work), "--seed-offset", "4"]) == 0
    assert Results(committed / "ci" / "fake").config["n"] == 3  # a report only: the results stay
    assert Results(work / "ci" / "fake").config["n"] == 7
    cells, counts, runs = reproduce.read_report("ci", root=committed, name="reproduction-seed-4")
    assert runs.set_index("study").loc["fake", "settings"] == "changed"
    assert "equal" not in counts.columns or counts.loc["fake", "equal"] < len(cells)  # other draws
    assert counts.loc["fake", "within"] > 0
    with pytest.raises(SystemExit):
        reproduce.main(["--scale", "ci", "--work", str(work), "--seed-offset", "-1"])


def test_a_partial_seed_offset_rerun_replaces_only_its_chapters_rows_of_the_report(fake, tmp_path, monkeypatch):
    from smp_book import config

    committed, work = tmp_path / "results", tmp_path / "work"
    monkeypatch.setattr(reproduce, "RESULTS", committed)
    monkeypatch.setitem(config.PARAMETERS, "fake", {"seed": "n"})
    monkeypatch.setattr(reproduce, "get_config", lambda study, scale: {"seed": 3})
    pipeline.results("fake", "ci", root=committed)
    saved = committed / "ci" / "reproduction-seed-4"
    saved.mkdir(parents=True)
    pd.DataFrame([{"study": s, "table": "t", "row": "r", "column": "c", "committed": 1.0, "new": 2.0, "p": 0.5,
                   "verdict": "within"} for s in ("fake", "other")]).to_csv(saved / "cells.csv", index=False)
    assert reproduce.main(["--scale", "ci", "--work", str(work), "--seed-offset", "4", "--only", "fake"]) == 0
    cells, counts, runs = reproduce.read_report("ci", root=committed, name="reproduction-seed-4")
    assert list(runs["study"]) == ["fake"]  # the kept rows had no runs.csv
    assert (cells["study"] == "other").sum() == 1 and counts.loc["other", "within"] == 1  # kept as it was
    assert (cells["study"] == "fake").sum() > 1 and counts.loc["fake"].sum() == (cells["study"] == "fake").sum()


def test_timings_come_from_the_manifests(fake, tmp_path):
    pipeline.results("fake", "ci", root=tmp_path)
    table = timings("ci", root=tmp_path)
    assert list(table.index) == ["fake"] and table.loc["fake", "minutes"] >= 0


def test_results_read_from_another_study_go_stale_with_it(fake, tmp_path, monkeypatch):
    reader = types.ModuleType("reader_study")
    reader.config = lambda scale: {"scale": scale}
    reader.compute = lambda ctx: (CALLS.append("reader"), ctx.value("best", ctx.read("fake").values["best"]))
    monkeypatch.setitem(sys.modules, "reader_study", reader)
    monkeypatch.setattr(pipeline, "STUDIES", {"fake": "fake_study", "reader": "reader_study"})
    first = pipeline.results("reader", "ci", root=tmp_path).values["best"]
    pipeline.results("reader", "ci", root=tmp_path)
    assert CALLS == ["reader", "fake"]
    fake(shift=1.0)
    pipeline.results("fake", "ci", root=tmp_path)  # the source recomputed with other settings
    again = pipeline.results("reader", "ci", root=tmp_path).values["best"]
    assert CALLS == ["reader", "fake", "fake", "reader"] and again > first


def test_results_that_quote_another_scales_settings_are_stale_once_those_change(fake, tmp_path, monkeypatch):
    """ctx.settings records what a chapter quotes from other settings (the code hash leaves the settings
    tables out), and a change there makes its results stale."""
    module = sys.modules["fake_study"]
    plain = module.compute

    def compute(ctx):
        plain(ctx)
        ctx.value("paper_k", ctx.settings("mnist", "paper")["n_steps"])

    monkeypatch.setattr(module, "compute", compute)
    first = pipeline.results("fake", "ci", root=tmp_path)
    assert first.values["paper_k"] == 1_000_000 and "mnist/paper" in first.manifest["settings_read"]
    pipeline.results("fake", "ci", root=tmp_path)
    assert CALLS == ["fake"]
    original = pipeline.get_config
    changed = {**original("mnist", "paper"), "n_steps": 10}

    def patched(study, scale):
        return changed if (study, scale) == ("mnist", "paper") else original(study, scale)

    monkeypatch.setattr(pipeline, "get_config", patched)
    monkeypatch.setenv(pipeline.READ_ONLY, "1")
    with pytest.raises(RuntimeError, match="the mnist/paper settings it quotes have changed"):
        pipeline.results("fake", "ci", root=tmp_path)


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
    monkeypatch.setattr(pipeline, "STUDIES", {"fake": "fake_study", "reader": "reader_study"})
    assert pipeline.results("reader", "ci", root=tmp_path).values["found"] is False
    assert CALLS == ["reader"]  # the paper scale was not computed
    pipeline.results("fake", "paper", root=tmp_path)
    monkeypatch.setenv(pipeline.READ_ONLY, "1")
    with pytest.raises(RuntimeError, match="the ../paper/fake results it read have changed since"):
        pipeline.results("reader", "ci", root=tmp_path)
    monkeypatch.delenv(pipeline.READ_ONLY)
    assert pipeline.results("reader", "ci", root=tmp_path).values["found"] is True
    pipeline.compute("fake", "paper", root=tmp_path)
    monkeypatch.setenv(pipeline.READ_ONLY, "1")
    with pytest.raises(RuntimeError, match="the ../paper/fake results it read have changed since"):
        pipeline.results("reader", "ci", root=tmp_path)


def test_a_chapters_parameters_change_its_settings_and_go_to_a_folder_of_their_own(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "STUDIES", {"toy": "smp_book.toy_study", "mnist": "smp_book.mnist_study"})
    config = pipeline.study_config("toy", "ci", {"tau": {"SMP-fixed-diag": 0.1, "ema-block": 1}, "n_steps": 7})
    assert config["tau"]["fixed-diag"] == 0.1 and config["tau"]["ema-block"] == 1.0 and config["n_steps"] == 7
    assert config["tau"]["none"] == 1.0  # the others keep the paper's
    assert pipeline.folder_of("toy", "ci", {"tau": {}, "seed": None}, tmp_path) == tmp_path / "ci" / "toy"
    custom = pipeline.folder_of("toy", "ci", {"n_steps": 7}, tmp_path)
    assert custom.parent == tmp_path / "custom" and custom.name.startswith("ci-toy-")
    for params, message in [({"taus": 1}, "taus: not a parameter of the toy chapter"),
                            ({"tau": {"SMP-dense": 0.1}}, "tau: unknown variant 'SMP-dense'"),
                            ({"tau": {"none": -1}}, "tau: the tau of 'none' must be a positive finite number"),
                            ({"tau": {"none": float("inf")}}, "must be a positive finite number"),
                            ({"tau": 0.5}, "tau: a mapping from variant to tau"),
                            ({"n_chains": 0}, "n_chains: a positive integer"),
                            ({"n_steps": 2.5}, "n_steps: a positive integer"),
                            ({"seed": -1}, "seed: a non-negative integer")]:
        with pytest.raises((ValueError, TypeError), match=message):
            pipeline.study_config("toy", "ci", params)
    assert pipeline.study_config("mnist", "ci", {"map_seed": 5})["select_map_from_seeds"] == [5]


def test_a_parameter_the_chapter_does_not_define_refuses_the_run():
    from smp_book.config import parameters

    namespace = {"scale": "ci", "tau": {}, "n_chains": None, "n_steps": None, "replicates": None, "seed": None,
                 "nuts_start": None, "In": [], "get_ipython": print, "_": None, "pd": pd}
    assert parameters(namespace, "toy") == {"tau": {}, "n_chains": None, "n_steps": None, "replicates": None,
                                            "seed": None, "nuts_start": None}
    with pytest.raises(ValueError, match="unknown parameter.s. taus: this chapter takes n_chains, n_steps, "
                                         "nuts_start, replicates, scale, seed, tau"):
        parameters({**namespace, "taus": 0.5}, "toy")
    with pytest.raises(ValueError, match="unknown parameter.s. tau: this chapter takes scale"):
        parameters({"scale": "ci", "tau": {}}, "summary")


def test_the_declared_dependencies_are_the_imports():
    """code_hash follows DEPENDS: each module's imports of smp_book modules (but the pipeline, the settings
    and what only shows or describes: plots, paper, show, results, machine) must be declared there."""
    import ast
    from pathlib import Path

    book = Path(pipeline.__file__).parent
    shows = {"pipeline", "config", "plots", "paper", "show", "results", "machine", "__init__"}
    for path in sorted(book.glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("smp_book."):
                found.add(node.module.split(".")[1])
        found = {name.split(".")[0] for name in found} - shows - {path.stem}
        if path.stem in pipeline.DEPENDS or path.stem in {s.split(".")[1] for s in pipeline.STUDIES.values()}:
            assert found == set(pipeline.DEPENDS.get(path.stem, ())), path.stem
    own = {s for s, module in pipeline.STUDIES.items() if "\ndef config(" in (book / f"{module[9:]}.py").read_text()}
    assert own == pipeline.OWN_CONFIG  # study_config imports these for their settings


def test_code_hash_follows_the_code_it_declares(tmp_path, monkeypatch):
    pipeline.code_hash.cache_clear()
    before = pipeline.code_hash("smp_book.toy_study")
    assert before == pipeline.code_hash("smp_book.toy_study") and before != pipeline.code_hash("smp_book.mnist_study")
    monkeypatch.setitem(pipeline.DEPENDS, "toy_study", ("toy", "nuts", "summaries", "baselines"))
    pipeline.code_hash.cache_clear()
    assert pipeline.code_hash("smp_book.toy_study") != before
    pipeline.code_hash.cache_clear()


def test_every_chapter_defines_its_parameters_and_refuses_others():
    """Each notebook's parameters cell defines ``scale`` and the parameters its study takes (``PARAMETERS``),
    and the cell after it refuses any other name (papermill only warns of one)."""
    import re
    from pathlib import Path

    from smp_book.config import PARAMETERS

    for path in sorted((Path(pipeline.__file__).parents[1] / "notebooks").glob("*.md")):
        text = path.read_text()
        cells = re.findall(r"```\{code-cell\} ipython3\n:tags: \[([^\]]*)\]\n\n(.*?)```", text, re.S)
        position = next(i for i, (tags, _) in enumerate(cells) if "parameters" in tags)
        defined = re.findall(r"^(\w+) = ", cells[position][1], re.M)
        study = path.stem if path.stem in PARAMETERS else None
        assert sorted(defined) == sorted({"scale", *PARAMETERS.get(study, {})}), path.name
        check = f'parameters(globals(), "{study}")' if study else "parameters(globals())"
        assert check in cells[position + 1][1], path.name


def test_no_study_imports_another():
    """What two studies share lives in a module of its own (``toy``, ``mnist_runs``, ``shifted``, ``tails``,
    ``summaries``); a chapter that shows another chapter's numbers reads its results files."""
    import ast
    from pathlib import Path

    studies = {module.split(".")[1] for module in pipeline.STUDIES.values()}
    for path in sorted(Path(pipeline.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
                assert not (names & studies - {path.stem}) or path.stem not in studies, (path.stem, names & studies)


def test_the_mnist_chapter_runs_some_variants_with_their_own_seeds_and_fisher_images():
    """``variants`` keeps each variant's seed (its place among the paper's four), ``fisher_images`` sets the periodic
    Fisher's validation images; bad values are refused, naming the parameter."""
    from smp_book import mnist_runs

    cfg = pipeline.study_config("mnist", "laptop", {"variants": ["SMP-periodic-diag"], "fisher_images": 1000})
    assert cfg["variants"] == ["periodic-diag"] and cfg["tau"] == {"periodic-diag": 0.05}
    assert cfg["n_fisher_periodic"] == 1000
    full = pipeline.study_config("mnist", "laptop")
    assert mnist_runs.smp_seed(cfg, mnist_runs.variant_index(cfg, "periodic-diag")) == mnist_runs.smp_seed(full, 3)
    for params, match in (({"variants": ["SMP-dense"]}, "variants: a list of distinct"),
                          ({"variants": ["none", "none"]}, "variants: a list of distinct"),
                          ({"variants": "none"}, "variants: a list of distinct"),
                          ({"fisher_images": 0}, "fisher_images: an integer from 1"),
                          ({"fisher_images": 6001}, "fisher_images: an integer from 1")):
        with pytest.raises(ValueError, match=match):
            pipeline.study_config("mnist", "laptop", params)


def test_a_rerun_with_another_map_is_judged_against_the_spread_over_maps(fake, tmp_path):
    from scipy.stats import t as student

    seeds = pipeline.results("fake", "ci", root=tmp_path).folder.rename(tmp_path / "ci" / "mnist_seeds")
    sd = Results(seeds).table("scores_std").at["a", "score"]  # over 3 "MAPs": 2 degrees of freedom
    cells = pd.DataFrame({"study": "mnist", "table": "scores_mean", "row": ["a", "a", "b", "a"],
                          "column": ["score", "score", "score", "seconds"],
                          "committed": 1.0, "new": [1.0 + sd, 1.0 + 40 * sd, 1.0, 9.0],
                          "verdict": ["outside", "outside", "equal", "timing"]})
    judged = judge_by_map_seeds(cells, "ci", root=tmp_path)
    assert list(judged["verdict"]) == ["within", "outside", "equal"]  # the timing is not judged
    assert judged["p"].iloc[0] == pytest.approx(2 * student.sf(1 / np.sqrt(2), df=2))
    assert (judged["n_maps"] == 3).all()


def test_settings_a_rerun_only_adds_are_not_changed():
    same = judge._same
    assert same({"a": 1}, {"a": 1}) == "same"
    assert same({"a": 1, "tau": {"x": 0.1}}, {"a": 1, "tau": {"x": 0.1, "y": 0.2}, "b": 2}) == "added"
    assert same({"a": 1, "gone": 3}, {"a": 1}) == "changed"
    assert same({"tau": {"x": 0.1}}, {"tau": {"x": 0.2}}) == "changed"
