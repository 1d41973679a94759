import pytest

from smp_book.paper import TABLES, paper_table


def test_tables_are_the_papers_numbers():
    scores = paper_table("ex1_scores")
    assert scores.shape == (12, 8)
    assert scores.loc["SMP-ema-block", "accuracy"] == pytest.approx(0.9292)
    assert scores.loc["NUTS", "mutual_info"] == pytest.approx(0.0115)
    assert paper_table("ex2_scores").loc["MAP", "accuracy"] == pytest.approx(0.9877)
    assert paper_table("ex2_elapsed").loc["SMP-none", "seconds"] == pytest.approx(4130.18)
    assert list(paper_table("ex1_variances").columns) == ["params_variance", "logits_variance"]
    for name in TABLES:
        assert len(paper_table(name)) in (5, 12)
    with pytest.raises(ValueError, match="unknown paper table"):
        paper_table("ex3_scores")
