"""bench.grammar_backends runs end to end on our small vocabularies and reports positive times."""

from __future__ import annotations

from bench.grammar_backends import BACKENDS, GRAMMARS, format_table, run


def test_grammar_backends_bench_quick_smoke() -> None:
    report = run(quick=True, large=False)
    rows = report["results"]
    assert len(rows) == 2 * len(BACKENDS) * len(GRAMMARS)  # two vocabularies
    for r in rows:
        assert r["compile"]["mean_ms"] > 0 and r["mask"]["n"] == r["tokens"] > 0
        assert r["to_first_mask"]["mean_ms"] >= r["compile"]["mean_ms"]
    assert format_table(report).startswith("| vocabulary")
