"""Metric loggers chosen in the config (W&B offline, resuming the same run) and the console's plain line."""

import io
import json
import pathlib
import struct
import time

import pytest

from asyncpp_jax import configs
from asyncpp_jax.train import metrics


def test_console_line_every_log_every_updates():
    clock = iter([100.0, 102.0, 104.0, 106.0, 108.0])  # update 1 ends at t=100 (its compile not counted)
    out = io.StringIO()
    line = metrics.ConsoleLine(total_steps=5, log_every=2, stream=out, enabled=True, clock=lambda: next(clock))
    for step in range(1, 6):
        m = {"loss": 3.0 / step, "lr": 1e-3 * step, "tokens_per_sec": 12345.6, "step_time": 2.0}
        if step == 4:
            m["val_loss"] = 0.8
        line.update(step, m)
    assert out.getvalue().splitlines() == [
        "step 2/5  loss 1.5000  lr 0.002  tokens/s 12,346  ETA 0m06s",  # 3 updates left at 2 s each
        "step 4/5  loss 0.7500  val_loss 0.8000  lr 0.004  tokens/s 12,346  ETA 0m02s",
        "step 5/5  loss 0.6000  lr 0.005  tokens/s 12,346  ETA 0m00s",  # the last update always has its line
    ]
    tty = io.StringIO()
    tty.isatty = lambda: True
    assert not metrics.ConsoleLine(5, 1, stream=tty).enabled and metrics.ConsoleLine(5, 1, stream=io.StringIO()).enabled


def test_loggers_are_validated_and_a_missing_package_named(monkeypatch):
    c = configs.load_file("tiny")
    assert configs.loggers(c) == ("jsonl", "tensorboard")
    c.train.loggers = "jsonl, wandb"
    assert configs.loggers(c) == ("jsonl", "wandb")
    configs.validate(c)
    c.train.loggers = "jsonl,mlflow"
    with pytest.raises(configs.ConfigError, match="config.train.loggers='jsonl,mlflow' must name each logger"):
        configs.validate(c)
    real = metrics.importlib.util.find_spec
    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(metrics.LoggerUnavailable, match=r"includes 'wandb', but wandb is not installed: pip install "
                                                        r"'\.\[wandb\]'"):
        metrics.check_available(("jsonl", "wandb"))
    metrics.check_available(("jsonl", "tensorboard"))


def _wandb_records(path: pathlib.Path) -> list:
    """The protobuf records of an offline W&B run file (LevelDB's log format: 32 KiB blocks of
    chunks, each with a 7-byte header of crc, length and kind), after the file's 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending, out = path.read_bytes(), 7, 32768, b"", []
    assert data.startswith(b":W&B")
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, or last of several
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def _wandb_run(run_dir: pathlib.Path) -> tuple[str, str, list]:
    """(run id, display name, [(step, loss)]) of one offline run directory."""
    run_id = name = ""
    history = []
    path = next(run_dir.glob("run-*.wandb"))
    for _ in range(300):  # W&B's service may still be writing the file when finish() returns
        records = _wandb_records(path)
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        time.sleep(0.1)
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id, name = record.run.run_id, record.run.display_name
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append((items["_step"], items["loss"]))
    return run_id, name, history


def test_wandb_offline_run_continues_after_a_restart(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install '.[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    c = configs.load_file("tiny")
    for steps in ((1, 2, 3), (3, 4)):  # the restart redoes step 3 (resumed from a checkpoint at 2)
        writer = metrics.MetricWriter(tmp_path, ("wandb",), resume_step=steps[0] - 1, config=c)
        for step in steps:
            writer.write(step, {"loss": 10.0 - step, "lr": 1e-3})
        writer.close()
    run_id = (tmp_path / metrics.WANDB_RUN_ID).read_text().strip()
    runs = sorted(_wandb_run(d) for d in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, [(d.name, [r.WhichOneof("record_type") for r in _wandb_records(next(d.glob("run-*.wandb")))])
                            for d in (tmp_path / "wandb").glob("offline-run-*")]
    assert [r[0] for r in runs] == [run_id, run_id] and runs[0][1] == "tiny"
    assert [r[2] for r in runs] == [[(1, 9.0), (2, 8.0), (3, 7.0)], [(3, 7.0), (4, 6.0)]]
    assert not (tmp_path / "metrics.jsonl").exists()  # jsonl was not chosen


def test_tensorboard_reads_the_event_files(tmp_path):
    """The viewer the tensorboard extra installs reads what the writer (tensorboardX) wrote."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed (pip install '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = metrics.MetricWriter(tmp_path, ("tensorboard",))
    for step in (1, 2):
        writer.write(step, {"loss": 5.0 - step})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 4.0), (2, 3.0)]
