"""``python -m experiments.device_check`` runs on CPU at toy size and writes its record.

The default suite runs the benchmark and lowering parts (a few compiles); ``-m slow`` runs every
part (the test-file subprocess, the engine against the simulate runner, the notebook's preset
through the trainer).  The record feeds docs/accelerators.md's table, which only shows runs on an
accelerator: a ``--tiny`` CPU record is left out of it.
"""

from __future__ import annotations

import json

import jax
import pytest

from experiments import device_check, render_docs


def _record(tmp_path, parts):
    out = tmp_path / "device_check.jsonl"
    record = device_check.check(True, out, parts=parts)
    assert json.loads(out.read_text().splitlines()[-1]) == record
    f = record["figures"]
    assert record["kind"] == "device_check" and f["tiny"] and f["platform"] == "cpu"
    failed = {k: v["error"] for k, v in f.items() if isinstance(v, dict) and "error" in v}
    assert not failed, failed
    return f


def test_device_check_tiny_writes_a_record(tmp_path):
    f = _record(tmp_path, ("bench_mfu", "lowering"))
    dense, moe = f["bench_mfu"]
    assert dense["config"] == "dense135m" and moe["config"] == "moe_tiny"
    for b in (dense, moe):
        assert b["tokens_per_s"] > 0 and 0 < b["mfu"] and b["peak_source"].startswith("measured")
        assert b["attention"]["kernel"] == "xla" and b["compute_dtype"] == "bfloat16"
    assert f["lowering"] == {"platform": "cpu", "auto_kernel": "xla", "looked_for": None, "found": None}


@pytest.mark.slow
@pytest.mark.needs_devices(2)
def test_device_check_tiny_runs_every_part(tmp_path):
    f = _record(tmp_path, ("tests", "bench_mfu", "engine", "notebook", "lowering"))
    assert f["tests"]["returncode"] == 0 and f["tests"]["counts"]["passed"] > 0
    assert [e["schedule"] for e in f["engine"]] == ["sync", "2bw"]
    assert all(e["max_abs_param_difference_vs_simulate"] < 1e-5 for e in f["engine"])
    assert f["notebook"]["status"] == "finished" and f["notebook"]["updates"] == 2
    assert len(jax.devices()) >= 2


def test_docs_show_only_accelerator_records(tmp_path, monkeypatch):
    from experiments import records

    monkeypatch.setattr(render_docs, "BENCH_LINK", tmp_path)
    monkeypatch.setattr(records, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(render_docs, "_provenance", lambda rows, files, doc: f"{len(rows)} record(s)")
    doc = render_docs.REPO_ROOT / "docs" / "accelerators.md"
    (tmp_path / "device_check.jsonl").write_text("")
    assert "No accelerator has run" in render_docs.accelerator_checks(doc)
    assert "no GPU or TPU has run it yet" in render_docs.accelerator_status(doc)
    figures = {"tiny": False, "platform": "cuda", "device_kind": "NVIDIA H100 80GB HBM3", "devices": 1,
               "tests": {"counts": {"passed": 40}}, "engine": {"skipped": "1 present"},
               "lowering": {"auto_kernel": "dot_product", "looked_for": "__cudnn$fmha", "found": True},
               "notebook": {"status": "finished", "updates": 50, "val_loss_per_byte": 1.5}, "total_s": 300.0}
    for rec in (records.make("device_check", dict(figures, tiny=True, platform="cpu", device_kind="cpu")),
                records.make("device_check", figures)):
        records.append(tmp_path / "device_check.jsonl", rec)
    table = render_docs.accelerator_checks(doc)
    assert table.count("NVIDIA H100") == 1 and "| 1 x cpu" not in table
    assert "40 passed" in table and "__cudnn$fmha found" in table and "skipped: 1 present" in table
    assert "has run on NVIDIA H100 80GB HBM3 (cuda)" in render_docs.accelerator_status(doc)
