"""Reports regenerate from the repository: each committed report sits beside its results.jsonl.

``python -m experiments.report --check DIR`` regenerates ``DIR/report.md`` from ``DIR/results.jsonl``;
every committed report must pass it or say at its top that it is not regenerable (its data lost).
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from experiments import report as report_lib

RESULTS_ROOT = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "results"


def _rows():
    out = []
    for variant, values in {"adamw/sync": [1.0, 1.2], "adamw/2bw": [2.0, 2.3], "muon/sync": [1.0, 1.1],
                            "muon/2bw": [1.1, 1.15]}.items():
        for seed, v in enumerate(values):
            out.append({"study": "optimizers", "run_id": f"{variant}-{seed}", "variant": variant, "point": {},
                        "seed": seed, "final_val": v, "best_val": v, "val_curve": [[10, v + 0.3], [20, v]],
                        "train_curve": [], "seconds": 1.0, "config": {}})
    return [json.dumps(r) for r in out]


@pytest.mark.parametrize("report_md", sorted(RESULTS_ROOT.rglob("report.md")), ids=lambda p: p.parent.name)
def test_committed_report_regenerates_or_says_it_cannot(report_md):
    text = report_md.read_text()
    if text.startswith(report_lib.NOT_REGENERABLE):
        # A stale note would hide a report that could now be checked.
        assert not (report_md.parent / report_lib.RESULTS).exists()
        return
    assert report_lib.check(report_md.parent) == ""


def test_report_keeps_its_rows_and_check_catches_any_change(tmp_path):
    lines = _rows()
    src = tmp_path / "results.jsonl"
    src.write_text("\n".join(lines[:4]) + "\n\n" + "\n".join(lines[4:]) + "\n")  # a blank line is dropped
    out = tmp_path / "rep"
    md = report_lib.report([src], out).read_text()
    assert (out / "results.jsonl").read_text().splitlines() == lines
    assert "(8 runs, sha256 `" in md
    assert report_lib.check(out) == ""
    # Regenerating in place from its own copy (the input is the output file) leaves it unchanged.
    report_lib.report([out / "results.jsonl"], out)
    assert (out / "report.md").read_text() == md and report_lib.check(out) == ""

    (out / "report.md").write_text(md.replace("| adamw/2bw | 2.1500", "| adamw/2bw | 2.1400"))
    assert "+| adamw/2bw | 2.1500" in report_lib.check(out)
    (out / "report.md").write_text(md)
    (out / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # a run lost
    diff = report_lib.check(out)
    assert "7 runs" in diff and "muon/2bw" in diff


def test_check_names_a_report_without_its_results(tmp_path):
    (tmp_path / "report.md").write_text("# Async PP study report\n")
    with pytest.raises(report_lib.ReportInputError, match="results.jsonl: no such file; a committed report"):
        report_lib.check(tmp_path)


@pytest.mark.parametrize(
    "content,message",
    [
        (None, r"missing\.jsonl: no such file\. Give the results\.jsonl"),
        ('{"step": 10, "loss": 2.5}\n', r"metrics\.jsonl:1: not a study result \(missing study, variant, seed, "
                                        r"final_val, val_curve\).*not a run's metrics\.jsonl"),
        ("\n{oops\n", r"metrics\.jsonl:2: not JSON"),
        ("\n", r"no study results in .*metrics\.jsonl"),
    ],
)
def test_bad_input_is_a_message_naming_the_file(tmp_path, capsys, content, message):
    path = tmp_path / ("missing.jsonl" if content is None else "metrics.jsonl")
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        report_lib.main([str(path)])
    assert str(e.value).startswith("error: ")
    assert re.search(message, str(e.value)), str(e.value)
