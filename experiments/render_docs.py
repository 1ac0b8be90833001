"""Render the measured tables of README.md and docs/*.md from the records in the repository.

    python -m experiments.render_docs            # rewrite every table between markers
    python -m experiments.render_docs --check    # print what differs from the records; exit 1 if anything does

A rendered table sits between ``<!-- render:NAME -->`` and ``<!-- end:NAME -->`` on lines of their
own; NAME is a key of ``RENDERERS``. The records are ``experiments/results/bench/*.jsonl`` (see
``experiments/records.py``: command, commit, date, hardware, source, figures) and the studies'
``experiments/results/cpu/results.jsonl``. Each table ends with a line naming its records and, for
figures transcribed from an older text, that they were typed by hand; such a table also says so in its
header, and a row of its own record in that row. The tests run ``--check``
(tests/test_docs.py), as tests/test_report_regenerates.py does for the study report.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import json
import math
import os
import pathlib
import re
import statistics
import sys

from experiments import records, stats
from experiments.report_format import OPT_NAMES

REPO_ROOT = records.REPO_ROOT
STUDY_RESULTS = REPO_ROOT / "experiments" / "results" / "cpu" / "results.jsonl"
BENCH_LINK = REPO_ROOT / "experiments" / "results" / "bench"  # where the docs link to the records
BLOCK = re.compile(r"^<!-- render:(?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- end:(?P=name) -->$", re.M | re.S)


def documents() -> list[pathlib.Path]:
    """The files whose tables are rendered: README.md, every page of docs/ and experiments/README.md."""
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "experiments" / "README.md"]


def _link(target: pathlib.Path, doc: pathlib.Path) -> str:
    rel = os.path.relpath(target, doc.parent).replace(os.sep, "/")
    return f"[`{target.relative_to(REPO_ROOT).as_posix()}`]({rel})"


def _short_source(source: str) -> str:
    """``typed by hand from README.md (the figures entered it in commit 267642a; ...)`` -> ``README.md at 267642a``."""
    text = source.removeprefix("typed by hand from ").split(" (")[0]
    commits = re.findall(r"\b[0-9a-f]{7,40}\b", source)
    text = re.sub(r" at commit [0-9a-f]+", "", text)
    return text + (f" at {', '.join(commits)}" if commits else "")


TYPED_MARK = "(typed by hand)"
_typed_in_render: list[int] = []  # typed records the renderer running now rests on (see render())


def _typed(record: dict) -> str:
    """A row's mark when its figures were typed by hand rather than written by the script that measured them."""
    return f" {TYPED_MARK}" if record["source"] != "measured" else ""


def _mark_typed_header(body: str) -> str:
    """The first table's first header cell marked, when the table rests on records typed by hand."""
    lines = body.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("| ") and TYPED_MARK not in line:
            first, sep, rest = line[2:].partition(" |")
            lines[i] = f"| {first} {TYPED_MARK}{sep}{rest}"
            break
    return "\n".join(lines)


def _provenance(rows: list[dict], files: list[pathlib.Path], doc: pathlib.Path) -> str:
    """The line under a table: its records, how many were measured by a script as it ran, and how many
    were typed by hand from an older text (and from where; each record says more).  A table resting
    on typed records also says so in its header (``render``), so --check passing is no claim of a
    re-measurement."""
    typed = [r for r in rows if r["source"] != "measured"]
    _typed_in_render.append(len(typed))
    text = "Records: " + ", ".join(_link(f, doc) for f in files)
    if len(rows) > len(typed):
        text += f"; {len(rows) - len(typed)} measured and written by the script as it ran"
    if typed:
        sources = sorted({_short_source(r["source"]) for r in typed})
        text += f"; {len(typed)} typed by hand from {'; '.join(sources)} (each record says more)"
    return f"_{text}._"


def _hw(rows: list[dict]) -> str:
    return "; ".join(sorted({r["hardware"] for r in rows}))


def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def _minsec(seconds: float) -> str:
    return f"{int(seconds) // 60} min {int(seconds) % 60:02d} s"


# ---- the studies' results (experiments/results/cpu/results.jsonl) ----------------------------------


def _study(name: str) -> dict[str, dict[int, dict]]:
    rows = collections.defaultdict(dict)
    for line in STUDY_RESULTS.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row["study"] == name:
                rows[row["variant"]][row["seed"]] = row
    return rows


def _gap(study: dict, opt: str) -> tuple[float, float, int]:
    """Mean over seeds of 2bw - sync and its paired standard error."""
    return _gap_of(study, f"{opt}/2bw", f"{opt}/sync")


def _gap_of(study: dict, delayed_variant: str, sync_variant: str) -> tuple[float, float, int]:
    """Mean over seeds of ``delayed - sync`` and its paired standard error."""
    sync, delayed = study[sync_variant], study[delayed_variant]
    diffs = [delayed[s]["final_val"] - sync[s]["final_val"] for s in sorted(set(sync) & set(delayed))]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return statistics.mean(diffs), se, len(diffs)


def _mean_std(runs: dict[int, dict]) -> str:
    vals = [r["final_val"] for r in runs.values()]
    return f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else f"{vals[0]:.3f}"


OPT_ORDER = ["muon", "soap", "mars", "adamw", "adan", "lion"]


def optimizers_study(doc: pathlib.Path) -> str:
    study = _study("optimizers")
    lines = ["| optimizer | tuned lr | sync | 2bw | delay gap (paired SE) | seeds |", "|---|---|---|---|---|---|"]
    for opt in OPT_ORDER:
        if f"{opt}/sync" not in study:
            continue
        gap, se, n = _gap(study, opt)
        lr = next(iter(study[f"{opt}/sync"].values()))["overrides"].get("optimizer.lr")
        lines.append(f"| {OPT_NAMES[opt]} | {lr:g} | {_mean_std(study[f'{opt}/sync'])} | "
                     f"{_mean_std(study[f'{opt}/2bw'])} | {gap:+.3f} ± {se:.3f} | {n} |")
    lines += ["", f"_Final validation loss in nats/byte, mean ± std over seeds, from {_link(STUDY_RESULTS, doc)} "
                  "(the `optimizers` study at the `cpu` preset), the rows the study report regenerates from._"]
    return "\n".join(lines)


def _mean(runs: dict[int, dict]) -> str:
    return f"{statistics.mean(r['final_val'] for r in runs.values()):.3f}"


def _gap_text(study: dict, delayed: str, sync: str) -> str:
    gap, se, _ = _gap_of(study, delayed, sync)
    return f"{gap:+.3f} ± {se:.3f}"


def _cpu_note(name: str, doc: pathlib.Path, gaps: bool = True) -> str:
    seeds = sorted({s for runs in _study(name).values() for s in runs})
    return (f"_Final validation loss in nats/byte, the mean over seeds {seeds}; "
            + ("delay gap = delayed - sync, ± its paired standard error; " if gaps else "")
            + f"from {_link(STUDY_RESULTS, doc)} (the `{name}` study at the `cpu` preset)._")


def cpu_momentum(doc: pathlib.Path) -> str:
    """The ``momentum`` study at the cpu preset: each optimizer's arms per momentum."""
    study = _study("momentum")
    lines = ["| optimizer | momentum | sync | 2bw | delay gap (paired SE) |", "|---|---|---|---|---|"]
    betas = sorted({float(v.split("/")[1][len("beta="):]) for v in study})
    for opt in ("adamw", "muon"):
        for b in betas:
            key = f"{opt}/beta={b:g}"
            if f"{key}/sync" in study and f"{key}/2bw" in study:
                lines.append(f"| {OPT_NAMES[opt]} | {b:g} | {_mean(study[f'{key}/sync'])} | {_mean(study[f'{key}/2bw'])} | "
                             f"{_gap_text(study, f'{key}/2bw', f'{key}/sync')} |")
    return "\n".join(lines + ["", _cpu_note("momentum", doc)])


def cpu_schemes(doc: pathlib.Path) -> str:
    """The ``schemes`` study at the cpu preset: PipeDream's per-stage delay per depth against 2BW."""
    study = _study("schemes")
    lines = ["| scheme | P | sync | async | delay gap (paired SE) |", "|---|---|---|---|---|"]
    sync = "adamw/sync"
    pipedream = sorted((int(v.rsplit("=", 1)[1]), v) for v in study if v.startswith("adamw/pipedream/"))
    for p, v in pipedream:
        lines.append(f"| PipeDream | {p} | {_mean(study[sync])} | {_mean(study[v])} | {_gap_text(study, v, sync)} |")
    lines.append(f"| 2BW | any | {_mean(study[sync])} | {_mean(study['adamw/2bw'])} | {_gap_text(study, 'adamw/2bw', sync)} |")
    return "\n".join(lines + ["", _cpu_note("schemes", doc)])


def cpu_lr_picks(doc: pathlib.Path) -> str:
    """Each optimizer's synchronous loss at its ``cpu`` pick (``common.TUNED_LR["cpu"]``, which
    tests/test_tuning.py holds to the ``lr`` study's rows), and how far below the corpus's unigram
    entropy (from the latest ``main_job`` record: the same offline corpus) it ends."""
    from experiments.studies import common

    study = _study("lr")
    entropy = records.load("main_job")[-1]["figures"]["unigram_entropy_train_nats_per_byte"]
    picks = sorted(((opt, lr, statistics.mean(r["final_val"] for r in study[f"{opt}/lr={lr:g}/sync"].values()))
                    for opt, lr in common.TUNED_LR["cpu"].items()), key=lambda t: t[2])
    lines = ["| optimizer | tuned lr | sync val loss | below the unigram entropy |", "|---|---|---|---|"]
    for opt, lr, loss in picks:
        tuned = common.TUNED_SETTINGS.get("cpu", {}).get(opt)
        label = OPT_NAMES[opt] + (" (" + ", ".join(f"{k.rsplit('.', 1)[-1]} {v}" for k, v in tuned.items())
                                  + "; the `lion` study)" if tuned else "")
        lines.append(f"| {label} | {lr:g} | {loss:.3f} | {entropy - loss:.2f} |")
    return "\n".join(lines + ["", _cpu_note("lr", doc, gaps=False)[:-2] + f"; the unigram entropy of the "
                               f"train split, {entropy:.2f} nats/byte, from the latest `main_job` record._"])


def cpu_lion(doc: pathlib.Path) -> str:
    """The ``lion`` study at the cpu preset: Lion's synchronous loss per b1 and schedule, its pick in bold."""
    study = _study("lion")
    names = {"cosine": "cosine to 10%", "wsd": "warmup-stable-decay", "constant": "constant"}
    b1s = sorted({v.split("/")[0] for v in study}, key=lambda b: -float(b[len("b1="):]))
    best = min(study, key=lambda v: statistics.mean(r["final_val"] for r in study[v].values()))
    lines = ["| b1 | " + " | ".join(names.values()) + " |", "|---|" + "---|" * len(names)]
    for b1 in b1s:
        cells = [f"**{_mean(study[v])}**" if v == best else _mean(study[v])
                 for v in (f"{b1}/{k}" for k in names) if v in study]
        lines.append(f"| {b1[len('b1='):]}{' (paper)' if b1 == 'b1=0.9' else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", _cpu_note("lion", doc, gaps=False)])


SENSITIVITY_SETTINGS = {"default": "default (16 sequences, tuned lr, wd 0.1)", "batch/2": "batch / 2", "batch*2": "batch x 2",
                        "lr/3": "lr / 3", "lr*3": "lr x 3", "wd=0": "wd 0", "wd=0.3": "wd 0.3"}


def cpu_sensitivity(doc: pathlib.Path) -> str:
    """The ``sensitivity`` study at the cpu preset: AdamW's and Muon's gap with one setting changed."""
    study = _study("sensitivity")
    lines = ["| setting | AdamW sync | AdamW gap | Muon sync | Muon gap |", "|---|---|---|---|---|"]
    for setting, label in SENSITIVITY_SETTINGS.items():
        cells = []
        for opt in ("adamw", "muon"):
            key = f"{opt}/{setting}"
            cells += ([_mean(study[f"{key}/sync"]), _gap_text(study, f"{key}/2bw", f"{key}/sync")]
                      if f"{key}/sync" in study and f"{key}/2bw" in study else ["-", "-"])
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", _cpu_note("sensitivity", doc)])


# ---- bench records ----------------------------------------------------------------------------


def glance(doc: pathlib.Path) -> str:
    study = _study("optimizers")
    adamw, muon = _gap(study, "adamw"), _gap(study, "muon")
    proc = [r for r in records.load("bench_pipeline", "bench_pipeline_processes")
            if any(x["rows_per_microbatch"] >= 8 for x in r["figures"]["rows"])][-1]
    best = max(proc["figures"]["rows"], key=lambda r: (r["rows_per_microbatch"], r["microbatches"]))
    # Small microbatches, where the fixed per-tick costs outweigh the bubble: every measured ratio.
    small = [x for r in records.load("bench_pipeline", "bench_pipeline_processes") if r["source"] == "measured"
             for x in r["figures"]["rows"] if x["rows_per_microbatch"] < best["rows_per_microbatch"]]
    small_text = (f"; at {small[0]['rows_per_microbatch']} × {small[0]['seq']}-token microbatches "
                  f"{min(x['sync_over_2bw'] for x in small):.2f} to {max(x['sync_over_2bw'] for x in small):.2f} "
                  f"(M = {', '.join(str(m) for m in sorted({x['microbatches'] for x in small}))}): no gain"
                  if small and len({x["rows_per_microbatch"] for x in small}) == 1 else "")
    bench_rec = _optimizer_benches()[0]
    bench = bench_rec["figures"]["rows"]
    parity = ", ".join(f"{k} {v['time_vs_optax']:.2f}" for k, v in bench.items() if v["time_vs_optax"] is not None)
    docs = REPO_ROOT / "docs"
    lines = [
        "| question | answer at this scale | page |", "|---|---|---|",
        _glance_delay(adamw, muon, doc),
        f"| Does `2bw` remove the bubble? (2 processes, one core per stage, P = 2, "
        f"M = {best['microbatches']}, {best['rows_per_microbatch']} × {best['seq']}-token microbatches) | "
        f"sync / 2bw = {best['sync_over_2bw']:.3f} against the textbook {best['textbook']:.3f}{small_text} | "
        f"{_link(docs / 'pipeline.md', doc)} |",
        "| Does the engine compute what the simulation does? | yes: equal parameters (fp32 allclose, rtol 2e-5) "
        "for every schedule (`sync`, `1f1b`, `interleaved`, `zb-h1`; `2bw` against `delay(1)`, `pipedream` against "
        "PipeDream's per-leaf delays), across a synchronous start and cooldown, with MoE and data parallel, and on a "
        "mid-run resume, under both placements (`mpmd`: `sync`, `1f1b`, `2bw`, `pipedream`) (tests) | "
        f"{_link(docs / 'pipeline.md', doc)} |",
        _glance_2bw_pays(doc),
        f"| Do the optimizers cost what optax's own do? (time per update, ours / optax's) | {parity} | "
        f"{_link(docs / 'optimizers.md', doc)} |",
    ]
    rows = [proc, bench_rec]
    return "\n".join(lines + ["", _provenance(rows, [REGIME_RESULTS, STUDY_RESULTS, BENCH_LINK / "bench_pipeline.jsonl",
                                                      BENCH_LINK / "bench_optimizers.jsonl"], doc)])


def main_job(doc: pathlib.Path) -> str:
    rows = records.load("main_job")
    lines = ["| commit | hardware | wall time, end to end | s/update | final validation loss (nats/byte) |",
             "|---|---|---|---|---|"]
    for r in rows:
        f = r["figures"]
        lines.append(f"| {r['commit'] or 'not recorded'}{_typed(r)} | {r['hardware']} | {_minsec(f['wall_s'])} | "
                     f"{_f(f.get('s_per_update'), '{:.1f}')} | {_f(f.get('final_val_nats_per_byte'), '{:.3f}')} |")
    first = rows[0]["figures"]
    lines += ["", f"The corpus: {first['train_files']:,} train / {first['val_files']:,} validation files, "
                  f"{first['train_tokens'] / 1e6:.1f}M / {first['val_tokens'] / 1e6:.2f}M tokens; unigram entropy of the "
                  f"train split {first['unigram_entropy_train_nats_per_byte']:.3f} nats/byte, unigram cross-entropy on "
                  f"the validation split {first['unigram_xent_val_nats_per_byte']:.3f}.",
              "", _provenance(rows, [BENCH_LINK / "main_job.jsonl"], doc)]
    return "\n".join(lines)


NOTEBOOK_WHAT = {
    "notebooks/quickstart.ipynb": "sync vs 2bw vs 2bw + EF through the trainer, with their curves",
    "notebooks/optax_delay.ipynb": "`optim.delay` and `optim.error_feedback` around `optax.adamw` and `optim.muon` in a "
                                   "plain JAX loop",
}


def notebooks(doc: pathlib.Path) -> str:
    rows = records.load("notebooks")
    lines = ["| notebook | what it shows | size | runtime |", "|---|---|---|---|"]
    for name, what in NOTEBOOK_WHAT.items():
        path = REPO_ROOT / name
        rec = [r for r in rows if r["notebook"] == name][-1]
        runtime = rec["figures"]["runtime"]
        if "wall_s" in rec["figures"]:
            # the kind of host only; the conditions of the run stay in its record
            runtime += f" ({rec['figures']['wall_s']:.0f} s on a {rec['hardware'].split(' (')[0].split(',')[0]})"
        lines.append(f"| [`{name}`]({os.path.relpath(path, doc.parent)}) | {what} | "
                     f"{path.stat().st_size / 1000:.0f} kB | {runtime} |")
    return "\n".join(lines + ["", _provenance(rows, [BENCH_LINK / "notebooks.jsonl"], doc)])


def main_job_summary(doc: pathlib.Path) -> str:
    rows = records.load("main_job")
    walls = [r["figures"]["wall_s"] for r in rows]
    vals = [r["figures"]["final_val_nats_per_byte"] for r in rows if "final_val_nats_per_byte" in r["figures"]]
    entropy = next(r["figures"]["unigram_entropy_train_nats_per_byte"] for r in rows
                   if "unigram_entropy_train_nats_per_byte" in r["figures"])
    return (f"The main job's {len(rows)} recorded runs ({_link(REPO_ROOT / 'docs' / 'training.md', doc)}) took "
            f"{_minsec(min(walls))} to {_minsec(max(walls))} end to end on a 2-core CPU and ended at a validation loss "
            f"of {min(vals):.3f} to {max(vals):.3f} nats/byte, against a unigram entropy of {entropy:.3f} nats/byte "
            f"for the train split. {_provenance(rows, [BENCH_LINK / 'main_job.jsonl'], doc)}")


def tiny_optimizers(doc: pathlib.Path) -> str:
    latest = {}  # per optimizer its newest record: a re-measured run replaces the hand-typed one
    for r in records.load("tiny_optimizers"):
        latest[r.get("optimizer", r["figures"].get("optimizer"))] = r
    rows = list(latest.values())
    lines = ["| optimizer | lr | weight decay | hardware | final validation loss (nats/byte) |", "|---|---|---|---|---|"]
    for name, r in latest.items():
        f = r["figures"]
        lines.append(f"| {name}{_typed(r)} | {f['lr']:g} | {f['weight_decay']:g} | {r['hardware']} | "
                     f"{f['final_val_nats_per_byte']:.3f} |")
    return "\n".join(lines + ["", _provenance(rows, [BENCH_LINK / "tiny_optimizers.jsonl"], doc)])


def _optimizer_benches() -> tuple[dict, list[dict]]:
    """The latest whole-model run of bench_optimizers, and the latest SOAP run at fewer layers
    (``--layers``); earlier runs stay in the file."""
    rows = records.load("bench_optimizers")
    full = [r for r in rows if "--layers" not in r["command"]][-1]
    soap = [r for r in rows if "--layers" in r["command"] and "soap" in r["figures"]["rows"]]
    return full, soap[-1:]


def bench_optimizers(doc: pathlib.Path) -> str:
    full_rec, soap_recs = _optimizer_benches()
    rows = [full_rec, *soap_recs]
    full = full_rec["figures"]["rows"]
    soap = [r["figures"]["rows"]["soap"] for r in soap_recs]
    lines = ["| optimizer | time vs AdamW | time vs optax's own | state bytes / param |", "|---|---|---|---|"]
    for name, f in full.items():
        t = _f(f["time_vs_adamw"])
        if name == "adamw":
            t += " (AdamW against itself: the noise level)"
        if name == "soap" and soap:
            t += f" ({soap[0]['time_vs_adamw']:.1f} at 10 layers, below)"
        vs = "-" if f["time_vs_optax"] is None else f"{f['time_vs_optax']:.2f} (`{f['optax_reference']}`)"
        lines.append(f"| {name} | {t} | {vs} | {f['state_bytes_per_param']:.2f} |")
    lines += ["", f"The whole model: median of {full_rec['figures']['rounds']} rounds × "
              f"{full_rec['figures']['updates_per_round']} updates. Commands: " + "; ".join(sorted({f'`{r["command"]}`' for r in rows})) + f". Hardware: {_hw(rows)}.",
              "", _provenance(rows, [BENCH_LINK / "bench_optimizers.jsonl"], doc)]
    return "\n".join(lines)


def bench_pipeline_work(doc: pathlib.Path) -> str:
    """One row per (microbatch size, recompute, freed memory, schedule): the latest record that timed
    it.  Records from before the benchmark kept freed memory for reuse say nothing: glibc's default,
    freed memory returned to the kernel."""
    latest = {}
    for r in records.load("bench_pipeline", "bench_pipeline_work"):
        freed = r["figures"].get("freed_memory", "returned")
        for x in r["figures"]["rows"]:
            latest[(r["figures"]["rows_per_microbatch"], x["recompute"], freed, x["schedule"])] = (x, r)
    rows = list({id(r): r for _, r in latest.values()}.values())
    order = ("sync", "2bw", "1f1b", "interleaved", "zb-h1")

    def key(k):  # kept first; whole tables, then split ones, each in the schedules' order
        base, _, split = k[3].partition(" ")
        return k[0], k[1], k[2] != "kept", bool(split), order.index(base) if base in order else len(order), k[3]

    lines = ["| microbatch | schedule | recompute | freed memory | engine / simulate step | spread over rounds "
             "| slot work / simulate | engine / slot work | target |", "|---|---|---|---|---|---|---|---|---|"]
    for k in sorted(latest, key=key):
        x, f = latest[k][0], latest[k][1]["figures"]
        target = x["target"] + (f" (F/(F+B) = {f['f_over_f_plus_b']:.2f})" if x["recompute"] else "")
        slots = (f"{x['slot_work_over_simulate']:.2f} | {x['engine_over_slot_work']:.2f}"
                 if x["slot_work_over_simulate"] else "– | –")  # a program's slots are not timed alone
        lines.append(f"| {f['rows_per_microbatch']} × {f['seq']} | {x['schedule']} | {x['recompute']} | {k[2]} | "
                     f"**{x['engine_over_simulate']:.2f}** | {x['spread'][0]:.2f}–{x['spread'][1]:.2f} | "
                     f"{slots} | {target} |")
    lines += ["", "Commands: " + "; ".join(f'`{r["command"]}`' for r in rows) + f". Hardware: {_hw(rows)}.",
              "", _provenance(rows, [BENCH_LINK / "bench_pipeline.jsonl"], doc)]
    return "\n".join(lines)


def bench_pipeline_processes(doc: pathlib.Path) -> str:
    """One row per (stage split, microbatch size, M): the latest record that measured it."""
    latest = {}
    for r in records.load("bench_pipeline", "bench_pipeline_processes"):
        split = ",".join(map(str, r["figures"]["stage_layers"]))
        for x in r["figures"]["rows"]:
            latest[(split, x["rows_per_microbatch"], x["microbatches"])] = (x, r)
    lines = ["| split | microbatch | M | sync s/update | 2bw s/update | measured sync / 2bw | spread over rounds | "
             "tick-table critical path | textbook (M+P-1)/M | measured / textbook | measured 1f1b / 2bw "
             "| 1f1b plan's path | measured interleaved / 2bw | interleaved plan's path | measured zb-h1 / 2bw |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(latest, key=lambda k: (len(set(k[0].split(","))) == 1, -k[1], k[2])):  # uneven splits first
        x, _ = latest[key]
        f1b = " | ".join(
            (f"**{x[f'{k}_over_2bw']:.3f}** ({x[f'{k}_spread'][0]:.2f}–{x[f'{k}_spread'][1]:.2f}) | "
             f"{x[f'{k}_plan_over_2bw']:.3f}") if f"{k}_over_2bw" in x else "not timed | –"
            for k in ("f1b", "interleaved"))
        zb = (f"**{x['zb_h1_over_2bw']:.3f}** ({x['zb_h1_spread'][0]:.2f}–{x['zb_h1_spread'][1]:.2f})"
              if "zb_h1_over_2bw" in x else "not timed")
        lines.append(f"| {key[0]} | {x['rows_per_microbatch']} × {x['seq']} | {x['microbatches']} | {x['sync_s_per_update']:.2f} | "
                     f"{x['twobw_s_per_update']:.2f} | **{x['sync_over_2bw']:.3f}** | {x['spread'][0]:.2f}–"
                     f"{x['spread'][1]:.2f} | {x['tick_table_critical_path']:.3f} | {x['textbook']:.3f} | "
                     f"{x['measured_over_textbook']:.3f} | {f1b} | {zb} |")
    rows = list({id(r): r for _, r in latest.values()}.values())
    setups = sorted({f"{r['figures']['layers']} layers split {','.join(map(str, r['figures']['stage_layers']))}, "
                     f"recompute {r['figures']['recompute']}" for r in rows})
    lines += ["", f"{'; '.join(setups)}. Command: " + "; ".join(f"`{r['command']}`" for r in rows)
              + f". Hardware: {_hw(rows)}.", "", _provenance(rows, [BENCH_LINK / "bench_pipeline.jsonl"], doc)]
    return "\n".join(lines)


def bench_pipeline_work_against(doc: pathlib.Path) -> str:
    """The newest ``work --against`` record per earlier commit, oldest comparison first: each
    schedule's engine step here and there, each over its own tree's simulate step, and the engine's
    time here over there, under the record's note (what the other checkout lacks)."""
    newest = {r["figures"]["commit_against"]: r for r in records.load("bench_pipeline", "bench_pipeline_work_against")}
    if not newest:
        return "No `bench_pipeline work --against` record yet."
    out = []
    for rec in newest.values():
        f = rec["figures"]
        lines = ([f"**{rec['note']}**", ""] if rec.get("note") else []) + [
            f"| schedule (P = {f['stages']}, M = {f['microbatches']}, no recompute) | engine / simulate here "
            f"| engine / simulate at {f['commit_against']} | engine here / engine at {f['commit_against']} "
            f"| simulate here / simulate at {f['commit_against']} |", "|---|---|---|---|---|"]
        for r in f["rows"]:
            there = r["there"]
            lines.append(f"| {r['schedule']} | {r['here']['engine_over_simulate']:.3f} | "
                         + (f"{there['engine_over_simulate']:.3f} | **{r['engine_here_over_there']:.3f}** | "
                            f"{r['simulate_here_over_there']:.3f} |" if there else "– (not at that commit) | – | – |"))
        out.append("\n".join(lines + ["", f"{f['rounds']} paired rounds in each of "
                                          f"{f['processes_per_tree']} fresh processes per tree. Command: "
                                          f"`{rec['command']}`. Hardware: {_hw([rec])}."]))
    rows = list(newest.values())
    return "\n\n".join(out + [_provenance(rows, [BENCH_LINK / "bench_pipeline.jsonl"], doc)])


def bench_pipeline_compile(doc: pathlib.Path) -> str:
    rows = records.load("bench_pipeline", "bench_pipeline_compile")[-1:]
    f = rows[0]["figures"]
    lines = [f"| program ({f['schedule']}, P = {f['stages']}) | compile time vs {f['baseline']} |", "|---|---|",
             f"| twice the depth | {f['twice_depth']:.2f}× |",
             f"| twice the microbatches | {f['twice_microbatches']:.2f}× |"]
    if "against" in f:  # each schedule's compile time here over the same at an earlier commit
        a = f["against"]
        lines += ["", f"| schedule (P = 4, M = 8, no recompute) | compile time | at {a['commit']} | ratio |",
                  "|---|---|---|---|"]
        for r in a["rows"]:
            there = r["against_seconds"]
            lines.append(f"| {r['schedule']} | {r['seconds']:.1f} s | "
                         + ("– | – |" if there is None else f"{there:.1f} s | **{r['seconds'] / there:.2f}** |"))
    return "\n".join(lines + ["", f"Command: `{rows[0]['command']}`. Hardware: {_hw(rows)}. "
                               + _provenance(rows, [BENCH_LINK / "bench_pipeline.jsonl"], doc)])


def bench_pipeline_conditionals(doc: pathlib.Path) -> str:
    rows = records.load("bench_pipeline", "bench_pipeline_conditionals")[-1:]
    lines = ["| runner | P | M | ticks (a program: slots) | conditionals per update |", "|---|---|---|---|---|"]
    for r in rows[0]["figures"]["rows"]:
        lines.append(f"| {r['runner']} | {r['P']} | {r['M'] if 'ticks' in r else ''} | {r.get('ticks', '')} "
                     f"| {r['conditionals']} |")
    return "\n".join(lines + ["", f"Command: `{rows[0]['command']}`. "
                               + _provenance(rows, [BENCH_LINK / "bench_pipeline.jsonl"], doc)])


def _glance_delay(adamw: tuple, muon: tuple, doc: pathlib.Path) -> str:
    """The glance row on the delay: the paper's regime (``cpu_regime``, best arm against best arm;
    the factor screen's width=128 cell where the protocol has measured AdamW and Muon, else the
    ``optimizers`` study), with the few-update ``cpu`` preset's gaps (``adamw``, ``muon``) beside."""
    proto, _, early = _headline_arms()
    arms = proto if "adamw/sync" in proto and "muon/sync" in proto else early
    few = (f"AdamW {adamw[0]:+.3f} ± {adamw[1]:.3f}, Muon {muon[0]:+.3f} ± {muon[1]:.3f} at 200 large updates "
           f"(`cpu`, {adamw[2]} seeds)")
    gaps = {o: stats.gap(arms, f"{o}/2bw", f"{o}/sync") for o in ("adamw", "muon")} if arms else {}
    if not all(gaps.values()):
        return (f"| Does the one-step delay hurt AdamW more than Muon? (`optimizers` study) | yes: delay gap {few} | "
                f"{_link(REPO_ROOT / 'docs' / 'studies.md', doc)} |")
    a, m = gaps["adamw"], gaps["muon"]
    diff = stats.contrast(arms, {"adamw/2bw": 1.0, "adamw/sync": -1.0, "muon/2bw": -1.0, "muon/sync": 1.0})
    answer = stats.direction(diff, "yes", "no", "not resolved (one-sided t test)")
    source = "the factor screen's `width=128` cell" if arms is proto else "`optimizers` study"
    return (f"| Does the one-step delay hurt AdamW more than Muon? ({source}, each arm at its tuned "
            f"learning rate) | {answer}: delay gap AdamW {a.value:+.3f} ± {a.se:.3f}, Muon {m.value:+.3f} ± {m.se:.3f} "
            f"nats/byte at 3,200 small updates (`cpu_regime`, {min(a.n, m.n)} seeds"
            f"{', each arm tuned on other seeds' if arms is proto else ''}); {few} | "
            f"{_link(REPO_ROOT / 'docs' / 'studies.md', doc)} |")


def _glance_2bw_pays(doc: pathlib.Path) -> str:
    """The glance row: 2BW against the best synchronous schedule, from the latest schedules record
    measured on this CPU (or the latest one, at given costs)."""
    recs = records.load("bench_pipeline", "bench_pipeline_schedules")
    rec = ([r for r in recs if "--measure" in r["command"]] or recs)[-1]
    found = _gains(_schedule_groups(rec))
    gains = sorted(g for _, g in found.values())
    names = " / ".join(sorted({b for b, _ in found.values()}))
    costs = "per-action costs measured on this CPU" if "--measure" in rec["command"] else "given per-action costs"
    return (f"| When does 2BW beat the best synchronous schedule? (each schedule's program simulated from {costs}, "
            f"P = 4 and 8, M = P to 4P) | by {gains[0]:.2f}x to {gains[-1]:.2f}x a step (the best synchronous: "
            f"{names}), shrinking as 1/M; every schedule is a program the one executor runs (add yours: a "
            "generator) | "
            f"{_link(REPO_ROOT / 'docs' / 'pipeline.md', doc)} |")


def _schedule_groups(rec: dict) -> dict:
    """``(P, M) -> {schedule: row}`` of a ``bench_pipeline_schedules`` record."""
    groups = collections.defaultdict(dict)
    for x in rec["figures"]["rows"]:
        groups[(x["P"], x["M"])][x["schedule"]] = x
    return groups


def _two_bw_pays(groups: dict) -> str:
    """The paragraph: when 2BW beats the best synchronous schedule, and by how much (from the rows)."""
    found = _gains(groups)
    gains, best_names = {k: g for k, (_, g) in found.items()}, {b for b, _ in found.values()}
    textbook = {k: rows["1f1b"]["critical_path"] / rows["2bw"]["critical_path"] for k, rows in groups.items()}
    hi, lo = max(gains, key=gains.get), min(gains, key=gains.get)
    ten = [f"P = {P}, M = {M}" for (P, M), g in sorted(gains.items()) if g >= 1.10]
    return (f"**When does 2BW pay?** Against the best synchronous schedule ({' and '.join(sorted(best_names))} in "
            f"every cell here), 2BW's step is {gains[hi]:.3f}x shorter at P = {hi[0]}, M = {hi[1]} and "
            f"{gains[lo]:.3f}x at P = {lo[0]}, M = {lo[1]}: the gain is the bubble that schedule still has, which "
            f"grows with P and shrinks as 1/M. It is 10% or more only at {'; '.join(ten) or 'none of these'} (few "
            f"microbatches per stage); at M = 4P it is {', '.join(f'{gains[(P, 4 * P)]:.3f}x at P = {P}' for P in sorted({P for P, _ in gains}))}. "
            f"Against the textbook 1F1B the same cells read {textbook[hi]:.3f}x and {textbook[lo]:.3f}x, which is "
            "what quoting `(M + P - 1)/M` claims. What 2BW pays for it: a one-step-stale gradient (the optimizer "
            "study's gap) and a second weight version per stage; its stash is 1F1B's (`P - s`).")


def _gains(groups: dict) -> dict:
    """``(P, M) -> (best synchronous schedule, its critical path / 2bw's)``."""
    out = {}
    for key, rows in groups.items():
        best = min((n for n in rows if n != "2bw"), key=lambda n: rows[n]["critical_path"])
        out[key] = best, rows[best]["critical_path"] / rows["2bw"]["critical_path"]
    return out


def _measured_schedules(recs: list) -> str:
    """A sentence on the latest ``--measure`` record: the same gains from costs measured on this CPU."""
    measured = [r for r in recs if "--measure" in r["command"]]
    if not measured:
        return ""
    rec = measured[-1]
    c = rec["figures"]["costs"]["4"]
    gains = _gains(_schedule_groups(rec))
    cells = ", ".join(f"{g:.3f}x at P = {P}, M = {M} ({best})" for (P, M), (best, g) in sorted(gains.items()))
    return (f" With per-action costs measured on this CPU instead (`{rec['command']}`: a stage of "
            f"{rec['figures']['layers'] // 4} layers at d_model {rec['figures']['d_model']}, {rec['figures']['rows_per_microbatch']} "
            f"x {rec['figures']['seq']} tokens, F {c['F']:.1f}, B {c['B']:.1f}, I {c['I']:.1f}, W {c['W']:.1f} ms at P = 4; "
            f"noisy on a shared machine), best synchronous / 2bw reads {cells}.")


def bench_pipeline_schedules(doc: pathlib.Path) -> str:
    """Every schedule's program simulated from per-action costs (the latest record at the default costs),
    and the same gains from the latest record with measured costs."""
    recs = records.load("bench_pipeline", "bench_pipeline_schedules")
    rec = [r for r in recs if "--costs" not in r["command"] and "--measure" not in r["command"]][-1]
    f, groups = rec["figures"], _schedule_groups(rec)
    lock = "lockstep" in next(iter(next(iter(groups.values())).values()))
    slots = any("slots_paired" in x for rows in groups.values() for x in rows.values())
    lines = ["| P | M | schedule | critical path | / 2bw | bubble fraction | peak stash per device |"
             + (" lock-step path |" if lock else "") + (" engine slots, paired / unpaired |" if slots else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if lock else "") + ("---|" if slots else "")]
    for (P, M), rows in sorted(groups.items()):
        for name, x in rows.items():
            placed = (f" {x['slots_paired']:.1f} / {x['slots_unpaired']:.1f} |" if "slots_paired" in x else " – |")
            lines.append(f"| {P} | {M} | {name} | {x['critical_path']:.1f} | {x['critical_path'] / rows['2bw']['critical_path']:.3f} "
                         f"| {x['bubble_fraction']:.3f} | {' '.join(f'{s:g}' for s in x['stash'])} |"
                         + (f" {x['lockstep']:.1f} |" if lock else "") + (placed if slots else ""))
    mins = "; ".join(f"P = {m['P']}: " + ", ".join(f"{k.removeprefix('min_M ')} {v}" for k, v in m.items() if k.startswith("min_M"))
                     for m in f["formulas"])
    costs = ", ".join(f"{k} = {v:g}" for k, v in f["costs"].items())
    lines += ["", f"Simulated from given per-action costs {costs} (an interleaved chunk's action costs 1/v of it), point-to-point latency "
                  f"{f['p2p']:g}, the update a collective over the stages at each step's end"
                  + (". Lock-step path: the same program run by an SPMD executor, one action per device per slot and one "
                     "exchange per slot, each slot as long as its costliest action (`programs.lockstep`)" if lock else "")
                  + (". Engine slots: the path of a flushed program placed as the engine's program executor places "
                     "it (`slot_plan.path`: the last stage's F fused into its B, so its B costs F + B; paired, a "
                     "slot may hold a backward and a forward per device; the tick tables' sync step takes "
                     "3(M + 2P - 2) at these costs)" if slots else "")
                  + ". Smallest M whose program "
                  f"validates: {mins}. Command: `{rec['command']}`.", "", _two_bw_pays(groups) + _measured_schedules(recs),
              *(["", _lockstep_note(groups)] if lock else []),
              "", _provenance([rec, *[r for r in recs if "--measure" in r["command"]][-1:]],
                              [BENCH_LINK / "bench_pipeline.jsonl"], doc)]
    return "\n".join(lines)


def _lockstep_note(groups: dict) -> str:
    """What lock-step execution costs each schedule: its lock-step path over its event-driven one."""
    ratio = {name: [x["lockstep"] / x["critical_path"] for x in (rows[name] for rows in groups.values())]
             for name in next(iter(groups.values()))}
    spread = "; ".join(f"{name} {min(r):.2f}-{max(r):.2f}x" for name, r in ratio.items())
    return ("**Lock-step execution.** An SPMD executor that runs one action per device per slot, with one exchange "
            "per slot, waits in each slot for its costliest action. Lock-step path over event-driven path, over the "
            f"cells above: {spread}. Schedules whose actions cost about the same (zb-h1's F, I and W) lose nothing; "
            "1F1B-shaped ones, where one device's B (2F) shares a slot with another's F, lose the most, 2bw above all "
            "(its steady state mixes them in every slot), so an executor of the textbook 2bw program would give back "
            "much of its gain over zb-h1. The engine's 2bw tick table puts every device's F in one slot and its B in "
            "the next, so its steady state never mixes them (its lock-step path is the ideal, M (F + B); "
            "tests/test_programs.py), at the price of a stash of 2P - 1 microbatches on stage 0.")


def _dry_runs(doc: pathlib.Path, config: str, variants=("",)) -> str:
    """The latest dry-run record of ``configs/{config}.py`` for each command suffix in ``variants``."""
    recs = records.load("dry_run", "dry_run")
    rows = []
    for suffix in variants:
        rows += [r for r in recs if r["command"].split("--dry_run")[0].rstrip().endswith(f"configs/{config}.py")
                 and r["command"].split("--dry_run", 1)[1].strip() == suffix][-1:]
    out = []
    for r in rows:
        f = r["figures"]
        out += [f"```\n$ {r['command']}", *f["stdout"], "```", "",
                f"{f['wall_s']} s end to end, {f['compile_s']} s of it compiling, on {r['hardware']}.", ""]
    return "\n".join(out + [_provenance(rows, [BENCH_LINK / "dry_run.jsonl"], doc)])


def moe10b_dry_run(doc: pathlib.Path) -> str:
    return _dry_runs(doc, "moe10b")


def llama3_8b_dry_run(doc: pathlib.Path) -> str:
    return _dry_runs(doc, "llama3_8b", ("--config.pipeline.stages=4 --config.hardware=h200-141gb", ""))


def mpmd_dry_run(doc: pathlib.Path) -> str:
    return _dry_runs(doc, "llama3_8b", (MPMD_FLAGS,))


VOCAB_PARALLEL_CASES = (  # (config, the dry run's flags; each config splits its tables unless told not to)
    ("llama3_8b", "--config.pipeline.stages=4 --config.hardware=h200-141gb"),
    ("llama3_8b", ""),
    ("moe10b", ""),
)
WHOLE_FLAG = "--config.pipeline.vocab_parallel=False"
MPMD_FLAGS = "--config.pipeline.placement=mpmd --config.pipeline.vocab_parallel=False"


def _dry_run_figures(rec: dict) -> dict:
    """The figures the vocabulary table reads off a dry run's printed report."""
    out = "\n".join(rec["figures"]["stdout"])
    mesh = re.search(r"'stage': (\d+)", out)
    peak = re.search(r"peak estimate per device: ([\d.]+) GB", out)
    held = re.search(r"holds? (?:1/\d+ of each table, )?([\d.]+) GB", out)  # the report's own total
    return {"stages": int(mesh.group(1)), "peak": float(peak.group(1)), "vocab": float(held.group(1))}


def _mpmd_figures(rec: dict) -> dict:
    """What an mpmd dry run's report says the end stages and a middle stage hold of the tables."""
    out = "\n".join(rec["figures"]["stdout"])
    held = re.search(r"stage 0 holds ([\d.]+) GB \(the embedding\), stage \d+ ([\d.]+) GB \(the head\)"
                     r"(?:; stages [\d-]+ hold ([\d.]+) GB)?", out)
    if held is None:
        raise ValueError(f"the dry-run record of {rec['command']!r} at {rec['commit']} is not of the mpmd placement: "
                         "record that command again")
    return {"end": max(float(held.group(1)), float(held.group(2))), "middle": float(held.group(3) or 0.0),
            "peak": float(re.search(r"peak estimate per device: ([\d.]+) GB", out).group(1))}


def vocab_parallel_table(doc: pathlib.Path) -> str:
    """Per device, the vocabulary-sized tensors and the peak with the tables whole on every stage,
    split over the vocabulary, and under the mpmd placement (on the end stages only), from the
    dry-run records of each case in ``VOCAB_PARALLEL_CASES``."""
    recs = records.load("dry_run", "dry_run")

    def latest(config, suffix):
        got = [r for r in recs if r["command"].split("--dry_run")[0].rstrip().endswith(f"configs/{config}.py")
               and r["command"].split("--dry_run", 1)[1].strip() == suffix]
        if not got:
            raise KeyError(f"no dry-run record of configs/{config}.py with {suffix!r}: run python -m "
                           f"experiments.record_run --kind dry_run ... (docs/pipeline.md)")
        return got[-1]

    lines = ["| config | stages | vocabulary-sized tensors per device: whole tables | split (`vocab_parallel`) | "
             "`mpmd`: end stage, middle stage | peak per device: whole | split | `mpmd` (fullest stage) |",
             "|---|---|---|---|---|---|---|---|"]
    rows = []
    for config, flags in VOCAB_PARALLEL_CASES:
        whole, split = latest(config, f"{flags} {WHOLE_FLAG}".strip()), latest(config, flags)
        placed = latest(config, f"{flags} {MPMD_FLAGS}".strip())
        rows += [whole, split, placed]
        for rec, is_split in ((whole, False), (split, True)):
            if ("split over the vocabulary" in "\n".join(rec["figures"]["stdout"])) != is_split:
                raise ValueError(f"the dry-run record of {rec['command']!r} at {rec['commit']} does not hold the tables "
                                 f"{'split' if is_split else 'whole'}: record that command again")
        w, s, m = _dry_run_figures(whole), _dry_run_figures(split), _mpmd_figures(placed)
        lines.append(f"| `configs/{config}.py`{f' `{flags}`' if flags else ''} | {w['stages']} | {w['vocab']:.2f} GB | "
                     f"{s['vocab']:.2f} GB | {m['end']:.2f} GB, {m['middle']:.2f} GB | {w['peak']:.2f} GB | "
                     f"{s['peak']:.2f} GB | {m['peak']:.2f} GB |")
    return "\n".join(lines + ["", _provenance(rows, [BENCH_LINK / "dry_run.jsonl"], doc)])


def fit_table(doc: pathlib.Path) -> str:
    latest = {r["config"]: r for r in records.load("dry_run", "fit")}  # a config's newer record replaces its older
    rows = list(latest.values())
    lines = ["| config / preset | target (`config.hardware`) | microbatches | remat | dry-run peak per device | "
             "before remat and microbatches were set |", "|---|---|---|---|---|---|"]
    for r in rows:
        f = r["figures"]
        name = f"`{r['config']}`" if r["config"].startswith("configs/") else r["config"]
        name += (f" ({r['note']})" if r["note"] else "") + _typed(r)
        lines.append(f"| {name} | `{f['target']}` | {f['microbatches']} | {f['remat']} | {f['peak_gb']:.2f} GB | "
                     f"{f['before'] or 'same'} |")
    return "\n".join(lines + ["", _provenance(rows, [BENCH_LINK / "dry_run.jsonl"], doc)])


def ci(doc: pathlib.Path) -> str:
    rows = records.load("ci")[-1:]
    f = rows[0]["figures"]
    # pytest-xdist's summary line leaves out the deselected (slow) tests, so the record cannot count them
    return "\n".join([
        "| command | default run | passed | skipped | pytest's time | wall time, clean clone (install included) |",
        "|---|---|---|---|---|---|",
        f"| `{rows[0]['command']}` | {f['tests_default']} | {f['passed']} | {f['skipped']} | "
        f"{_minsec(f['pytest_s']) if f.get('pytest_s') else '-'} | {_minsec(f['wall_s'])} |",
        "", f"Hardware: {rows[0]['hardware']}. " + _provenance(rows, [BENCH_LINK / "ci.jsonl"], doc)])


# ---- the paper's regime (experiments/results/cpu_regime/results.jsonl) ----------------------------

REGIME_RESULTS = REPO_ROOT / "experiments" / "results" / "cpu_regime" / "results.jsonl"


def paper_regime(doc: pathlib.Path) -> str:
    """Does it reproduce the paper: the updates ladder's gaps and EF shares beside the paper's Table 1
    and 2, from the cpu_regime rows (the ladder's three seeds where measured, else the tuning seed)."""
    from experiments import paper, report_ladder, tuning
    from experiments.studies import ladder_tune

    if not REGIME_RESULTS.is_file():
        return "_No `cpu_regime` results are committed yet._"
    rows = _regime_rows()
    picks = tuning.pick_arm_lrs(rows, "ladder_tune")
    measured = [r for r in rows if r["study"] == "ladder"]
    found = report_ladder.gaps(measured or [r for r in rows if r["study"] == "ladder_tune"], picks)
    opts = ladder_tune.OPTIMIZERS
    rungs = {**ladder_tune.RUNGS, **ladder_tune.EXTRA_RUNGS}

    def cell(updates, opt, key, pct=False):
        e = found.get((updates, opt), {}).get(key)
        if e is None:
            return "-"
        if pct:
            return report_ladder.share_text(e)
        return f"{e.value:+.3f}" + (f" ± {e.se:.3f}" if e.n > 1 else "")

    head = ["updates x batch"] + [f"{paper_name} gap" for paper_name in ("AdamW", "Muon", "SOAP")] + \
        ["EF share AdamW", "EF share Muon", "EF share SOAP"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for updates, batch in rungs.items():
        lines.append(f"| {updates:,} x {batch}" + (" (2x tokens)" if updates in ladder_tune.EXTRA_RUNGS else "") + " | "
                     + " | ".join(cell(updates, o, "gap_best") for o in opts) + " | "
                     + " | ".join(cell(updates, o, "ef_share_best", pct=True) for o in opts) + " |")
    lines.append("| the paper, 360M, ~10^4 updates | " + " | ".join(paper.gap(o) for o in opts) + " | "
                 + " | ".join(paper.ef_share(o) for o in opts) + " |")
    seeds = sorted({r["seed"] for r in (measured or [r for r in rows if r["study"] == "ladder_tune"])})
    estimates = [e for per in found.values() for e in per.values() if hasattr(e, "n")]
    if not measured:
        spread = "One seed (the tuning runs), no standard errors yet"
    elif all(e.n > 1 for e in estimates):
        spread = "Three seeds, paired standard errors"
    else:  # the ladder part-way: its seed 0 is the tuning run, the other seeds come rung by rung
        spread = "Three seeds where a cell shows ± (paired standard error), the tuning run's one seed where not"
    done = {study: sum(1 for r in rows if r["study"] == study) for study in ("lr", "ladder_tune", "ladder")}
    note = (f"Gap = 2bw minus sync in nats/byte (the paper's in nats/token), best arm against best arm, each arm at "
            f"its own learning rate from one grid; EF share = the fraction s of the gap 2bw + EF recovers, the point "
            f"and its 90% interval from the linear test of G_EF - (1 - s) G, none where the gap is unresolved. "
            f"{spread}; "
            f"seeds {seeds}. Runs committed: {done['lr']} of the `lr` study, {done['ladder_tune']} of "
            f"`ladder_tune`'s {len(ladder_tune.variants())}, {done['ladder']} of `ladder`'s; a `-` is a rung not yet run.")
    return "\n".join(lines + ["", f"_{note} Rows: {_link(REGIME_RESULTS, doc)}._"])


def _headline_arms() -> tuple[dict, dict, dict]:
    """The README's headline rows as ``OPTIMIZER/ARM`` arms: the protocol's (the factor screen's
    optimizers cell, each arm at its pick from tuning seeds it is never measured on) on the
    validation windows and on the test split, and the earlier ``optimizers`` study's (each arm tuned
    on seed 0, one of its measured seeds) for the optimizers the protocol has not measured yet."""
    from experiments import report_factors

    rows = _regime_rows()
    proto = report_factors.protocol_rows([r for r in rows if r["study"] == report_factors.MEASURE])
    return (stats.arms_of(proto), stats.arms_of(proto, lambda r: r.get("test_val")),
            stats.arms_of([r for r in rows if r["study"] == "optimizers"]))


EARLIER = "†"  # marks a row or a figure from the earlier protocol's rows


def _measured_seeds(seeds_by_opt: dict) -> str:
    """"seeds [0, 1, 2]", naming each optimizer measured at other seeds: more where its gap was under 3
    standard errors (the protocol's rule), fewer while it is being measured."""
    from experiments import protocol

    base = sorted(protocol.MEASURE_SEEDS)
    other: dict[tuple, list[str]] = {}
    for opt in (o for o in OPT_NAMES if o in seeds_by_opt):
        seeds = seeds_by_opt[opt]
        if sorted(seeds) != base:
            other.setdefault(tuple(sorted(seeds)), []).append(OPT_NAMES[opt])
    said = [f"{', '.join(names)} at {list(seeds)}" + (", where a gap was under 3 standard errors"
                                                      if set(seeds) > set(base) else ", so far")
            for seeds, names in other.items()]
    return f"seeds {base}" + (f" ({'; '.join(said)})" if said else "")


def _runs_committed(n: int, expected: int) -> str:
    if n > expected:
        return f"{n} of the cell's measured runs committed ({expected} at three seeds, the rest at the extra seeds)."
    return f"{n} of the cell's {expected} measured runs committed."


def paper_optimizers(doc: pathlib.Path) -> str:
    """Table 1 and 2 beside the ``optimizers`` study at ``cpu_regime`` (3,200 updates, three seeds):
    each optimizer's gap on the validation windows and the test split and EF's share, from the
    protocol's rows where it has measured the optimizer, else from the earlier protocol's (marked)."""
    from experiments import paper, protocol
    from experiments.report_format import share_text
    from experiments.studies import factors

    proto, test, early = _headline_arms()
    if not proto and not early:
        return "_The `optimizers` study at `cpu_regime` has no committed rows yet._"

    def est(e):
        return "-" if e is None else f"{e.value:+.3f}" + ("" if e.n < 2 else f" ± {e.se:.3f}")

    lines = ["| optimizer | sync (nats/byte) | gap (val) | gap (test split) | the paper's gap | EF share (val) | "
             "the paper's EF share |", "|---|---|---|---|---|---|---|"]
    marked = False
    for opt, name in OPT_NAMES.items():
        arms = proto if f"{opt}/sync" in proto else early if f"{opt}/sync" in early else None
        if arms is None:
            continue
        marked |= arms is early
        sync = [v for _, v in arms[f"{opt}/sync"]]
        share = stats.share(arms, f"{opt}/ef", f"{opt}/2bw", f"{opt}/sync")
        lines.append(f"| {name}{' ' + EARLIER if arms is early else ''} | {sum(sync) / len(sync):.3f} | "
                     f"{est(stats.gap(arms, f'{opt}/2bw', f'{opt}/sync'))} | "
                     f"{est(stats.gap(test, f'{opt}/2bw', f'{opt}/sync')) if arms is proto else '-'} | "
                     f"{paper.gap(opt)} | {share_text(share)} | "
                     f"{paper.ef_share(opt)} |")
    cell = factors.OPTIMIZERS_CELL
    ratios = [f"{q.text()} ({where})" for arms, where in ((proto, "val"), (test, "test split")) if
              (q := stats.fieller(arms, {"adamw/2bw": 1.0, "adamw/sync": -1.0}, {"muon/2bw": 1.0, "muon/sync": -1.0}))]
    seeds = _measured_seeds({opt: {s for key, runs in proto.items() if key.split("/")[0] == opt for s, _ in runs}
                             for opt in OPT_NAMES if f"{opt}/sync" in proto})
    expected = len(factors.arms(cell)) * len(protocol.MEASURE_SEEDS)
    note = (f"3,200 updates of 2 x 128 bytes (the factor screen's `{cell}` cell); each arm at its own pick from a "
            f"learning-rate grid run on tuning seeds {list(factors.CELLS[cell][1])}, measured on {seeds} ± "
            f"paired standard error; test split: 512 windows no pick saw. EF share: the point and its 90% interval "
            f"from the linear test of G_EF - (1 - s) G, none where G is unresolved. AdamW's gap over Muon's: "
            f"{', '.join(ratios) or '-'} (90% Fieller intervals; the paper: {paper.gap_ratio():.0f}). Gaps in "
            f"nats/byte (the paper's in nats/token of its tokenizer: compare ratios and shares, not sizes). "
            f"{_runs_committed(sum(len(v) for v in proto.values()), expected)}")
    if marked:
        note += (f" {EARLIER} Not yet measured under the protocol: the earlier `optimizers` study's rows, each arm "
                 "tuned on seed 0, one of its three measured seeds, and no test split.")
    return "\n".join(lines + ["", f"_{note} Rows: {_link(REGIME_RESULTS, doc)}._"])


def _regime_rows() -> list[dict]:
    return [json.loads(line) for line in REGIME_RESULTS.read_text().splitlines() if line.strip()] \
        if REGIME_RESULTS.is_file() else []


def paper_summary(doc: pathlib.Path) -> str:
    """The sentences under the two tables above, each from the cpu_regime rows: the AdamW/Muon ratio
    and a ratio of 10 tested, EF's shares against the paper's, the ladder per interval and doubling
    the tokens, each judged by the one-sided t test at n - 1 degrees of freedom."""
    from experiments import paper, report_ladder, tuning

    rows = _regime_rows()
    proto, test, early = _headline_arms()
    if not proto and not early:
        return "_No `cpu_regime` rows are committed yet._"
    ga, gm = ({"adamw/2bw": 1.0, "adamw/sync": -1.0}, {"muon/2bw": 1.0, "muon/sync": -1.0})

    def against(arms) -> tuple:
        q, ten = stats.fieller(arms, ga, gm), stats.contrast(arms, {**ga, "muon/2bw": -10.0, "muon/sync": 10.0})
        said = stats.direction(ten, "not rejected (it is exceeded)", "rejected", "not rejected")
        return q, ten, f"a ratio of 10 is {said} (G_AdamW - 10 G_Muon = {ten.value:+.3f} ± {ten.se:.3f}, one-sided t " \
                       f"test at {ten.n - 1} degrees of freedom)"

    out = []
    if "adamw/sync" in proto and "muon/sync" in proto:
        q, ten, said = against(proto)
        qt = stats.fieller(test, ga, gm)
        text = (f"Under the protocol, AdamW's gap is {q.text()} times Muon's on the validation windows and "
                f"{qt.text() if qt else '-'} on the test split (90% Fieller intervals, {ten.n} seeds), against the "
                f"paper's ~{paper.gap_ratio():.0f}; {said}.")
        if "adamw/sync" in early and "muon/sync" in early:
            qe, _, said_e = against(early)
            text += (f" The earlier protocol's rows, each arm tuned on one of its measured seeds, gave {qe.text()}, "
                     f"where {said_e}.")
    else:
        q, ten, said = against(early)
        text = (f"AdamW's gap is {q.text()} times Muon's (90% Fieller interval, {ten.n} seeds), against the paper's "
                f"~{paper.gap_ratio():.0f}; {said}.")
    out.append(text + " Gaps here are in nats/byte and the paper's in nats/token of its tokenizer, so only ratios "
               "and shares compare across the two, not sizes.")
    shares = []
    for opt, name in (("adamw", "AdamW"), ("muon", "Muon"), ("soap", "SOAP")):
        arms = proto if f"{opt}/sync" in proto else early
        f = stats.share(arms, f"{opt}/ef", f"{opt}/2bw", f"{opt}/sync")
        if f is None:
            continue
        tag = f"; {EARLIER} the earlier protocol's rows" if arms is early else ""
        if not f.resolved:
            shares.append(f"{name}'s gap is not resolved from 0, so EF's share of it is not given"
                          + (f" ({tag[2:]})" if tag else ""))
            continue
        lo, hi = (float(x.strip("%")) / 100 for x in paper.ef_share(opt).split("-")) if "-" in paper.ef_share(opt) \
            else (float(paper.ef_share(opt).strip("%")) / 100,) * 2
        where = "inside" if f.lo <= lo and hi <= f.hi else "outside" if hi < f.lo or lo > f.hi else "partly inside"
        text = (f"EF recovers {f.text(pct=True)} of {name}'s gap (the paper's {paper.ef_share(opt)} is {where} "
                f"that interval{tag})")
        if f.value > 1:  # a share above 100%: the EF arm ended at or below sync
            g_ef = stats.gap(arms, f"{opt}/ef", f"{opt}/sync")
            level = stats.direction(g_ef, "above it", "below it", "level with it within t standard errors")
            text += (f"; above 100% because {name}'s EF arm ends {g_ef.value:+.4f} ± {g_ef.se:.4f} from its sync arm, "
                     f"{level}")
        shares.append(text)
    out.append("; ".join(shares) + ".")
    picks = tuning.pick_arm_lrs(rows, "ladder_tune")
    measured = [r for r in rows if r["study"] == "ladder"]
    found = report_ladder.gaps(measured, picks)
    steps = []
    for opt, name in (("adamw", "AdamW"), ("muon", "Muon"), ("soap", "SOAP")):
        iv = report_ladder.intervals(measured, found, opt)
        bend = report_ladder.lack_of_fit(measured, found, opt)
        if iv:
            steps.append(f"{name}'s gap changes by " + " then ".join(f"{e.value:+.3f} ± {e.se:.3f} ({lo:,} -> {hi:,})" for lo, hi, e in iv)
                         + ("" if bend is None else ", so its line " + stats.direction(bend, "bends (lack of fit", "bends (lack of fit",
                                                                               "fits (lack of fit") + f" {bend.value:+.3f} ± {bend.se:.3f})"))
    if steps:
        out.append("Per doubling of the updates on the same tokens, " + "; ".join(steps) + ".")
    more = []
    for opt, name in (("adamw", "AdamW"), ("muon", "Muon"), ("soap", "SOAP")):
        a, b = found.get((6400, opt)), found.get((3200, opt))
        if a and b and a["gap_best"] and b["gap_best"]:
            (s1, d1, _), (s0, d0, _) = a["terms"]["best"], b["terms"]["best"]
            c = stats.contrast(stats.arms_of(measured), {d1: 1.0, s1: -1.0, d0: -1.0, s0: 1.0})
            more.append(f"{name}'s by {c.value:+.3f} ± {c.se:.3f} (" + stats.direction(c, "grows", "shrinks", "no change beyond t SE") + ")")
    if more:
        out.append("Doubling the tokens at the same batch (3,200 -> 6,400 updates) changes " + ", ".join(more) + ".")
    marked = {v.split("/")[0] for v in early} - {v.split("/")[0] for v in proto}
    out.append(f"The ladder's rows{' and the rows marked ' + EARLIER if marked else ''} "
               "follow the earlier protocol: each arm was tuned on seed 0, which is also one of the three measured "
               "seeds, and on the same validation windows it is reported on. The factor screen below repeats the "
               "ladder's rungs under the protocol (tuning seeds never measured, a test split) for AdamW and Muon "
               f"({_link(REPO_ROOT / 'docs' / 'studies.md', doc)}, \"Every optimizer under the protocol\").")
    return "\n\n".join(out) + f"\n\n_Generated from {_link(REGIME_RESULTS, doc)}._"


def factors_answer(doc: pathlib.Path) -> str:
    """"What makes the gap large?": the factor screen's cells and the conclusion, from its rows."""
    from experiments import report_factors

    rows = _regime_rows()
    tune = [r for r in rows if r["study"] == report_factors.TUNE]
    measured = [r for r in rows if r["study"] == report_factors.MEASURE]
    from experiments.studies import factors

    lines = [report_factors.progress(tune, measured), ""]
    lines += report_factors.answer_table(measured, factors.ORDER)
    table, _ = report_factors.axis_table(measured)
    lines += table + [report_factors.headline(measured)]
    return "\n".join(lines) + (f"\n\n_Gaps (2bw - sync) and shares on the validation windows, ratios with their 90% "
                                f"Fieller intervals; each cell's sync loss, test-split gaps and EF gaps are in "
                                f"[docs/studies.md](docs/studies.md). Generated from {_link(REGIME_RESULTS, doc)}._")


def factors_cells(doc: pathlib.Path) -> str:
    """The factor screen per cell and optimizer (sync loss, gaps on validation and the test split, EF's
    gap and shares), and what each axis says, from its rows."""
    from experiments import report_factors
    from experiments.studies import factors

    measured = [r for r in _regime_rows() if r["study"] == report_factors.MEASURE]
    lines = report_factors.cell_table(measured, factors.ORDER) + report_factors.conclusion(measured)
    return "\n".join(lines) + f"\n\n_Generated from {_link(REGIME_RESULTS, doc)}._"


def protocol_optimizers(doc: pathlib.Path) -> str:
    """The ``optimizers`` study under the referee protocol: every optimizer of the factor screen's
    width=128 cell beside the paper's Tables 1 and 2, from its rows."""
    from experiments import paper, report_factors
    from experiments.studies import factors

    cell = factors.OPTIMIZERS_CELL
    measured = [r for r in _regime_rows() if r["study"] == report_factors.MEASURE]
    table = report_factors.optimizers_table(measured)
    if not table:
        return "_The factor screen has no measured rows yet._"
    val = report_factors.cell_estimates(measured, cell)
    by_opt: dict[str, set] = {}
    for r in measured:
        if r["variant"].split("/")[0] == cell:
            by_opt.setdefault(r["variant"].split("/")[1], set()).add(r["seed"])
    seeds = _measured_seeds(by_opt)
    return "\n".join(table) + (
        f"\n_3,200 updates of 2 x 128 bytes (the `{cell}` cell of the factor screen); every arm at its own pick "
        f"from tuning seeds {list(factors.CELLS[cell][1])}, measured on {seeds} ± paired standard "
        f"error; test split: 512 windows no pick saw. AdamW's gap over Muon's: {report_factors.ratio_text(val)} "
        f"(90% Fieller interval; the paper: {paper.gap_ratio():.0f}). Gaps in nats/byte, the paper's in nats/token "
        f"of its tokenizer: compare signs, ratios and shares, not sizes. Generated from {_link(REGIME_RESULTS, doc)}._")


# The GPU cells that would settle the size axis: the dense135m and dense360m bodies at the gpu
# preset's byte vocabulary and tokens, AdamW and Muon, sync / 2bw / 2bw + EF.
GPU_TUNE_POINTS, GPU_TUNE_SEEDS, GPU_MEASURE_SEEDS, GPU_MFU = 3, 1, 3, 0.4


def gpu_plan(doc: pathlib.Path) -> str:
    """The GPU runs that would settle the size axis and their cost from the FLOP counter."""
    from asyncpp_jax import configs
    from asyncpp_jax.models import dense
    from asyncpp_jax.models.flops import flops_per_token
    from experiments.studies import common, factors

    g = common.GPU
    widths = [c for c in factors.ORDER if c.startswith("width=")]
    cut = [c for c in widths if c in factors.CUT]
    low, high = (f(factors.parameters(c) for c in widths if c not in cut) for f in (min, max))
    tokens = g["train.steps"] * g["train.global_batch_size"] * g["data.seq_len"]
    runs_per_cell = 2 * 3 * (GPU_TUNE_POINTS * GPU_TUNE_SEEDS + GPU_MEASURE_SEEDS)
    lines = ["| body | parameters | model FLOPs per run | H100-hours per run | runs | H100-hours |", "|---|---|---|---|---|---|"]
    total, largest = 0.0, 0
    for config in ("configs/dense135m.py", "configs/dense360m.py"):
        c = configs.load_file(config)
        c.model.vocab_size = g["model.vocab_size"]
        n = dense.count_params(dense.abstract_params(c.model))
        flops = flops_per_token(c.model, g["data.seq_len"]) * tokens
        hours = flops / (GPU_MFU * g["train.peak_tflops_per_device"] * 1e12) / 3600
        total, largest = total + hours * runs_per_cell, max(largest, n)
        lines.append(f"| `{config}` (byte vocabulary) | {n / 1e6:.1f}M | {flops:.2e} | {hours:.1f} | {runs_per_cell} | "
                     f"{hours * runs_per_cell:.0f} |")
    note = (f"Each cell: AdamW and Muon x sync, 2bw, 2bw + EF; each arm tuned on {GPU_TUNE_POINTS} learning rates at "
            f"{GPU_TUNE_SEEDS} tuning seed, measured at {GPU_MEASURE_SEEDS} other seeds; the `gpu` preset's "
            f"{tokens / 1e9:.2f}B byte tokens per run ({g['train.steps']:,} updates of "
            f"{g['train.global_batch_size']} x {g['data.seq_len']:,}); FLOPs from "
            f"`asyncpp_jax.models.flops` (6N + attention), hours at {GPU_MFU:.0%} MFU of "
            f"{g['train.peak_tflops_per_device']:g} bf16 TFLOP/s. Both bodies: {total:.0f} H100-hours. With the "
            f"CPU screen's width cells ({low / 1e6:.2f}M-{high / 1e6:.1f}M parameters"
            + (f"; cut: {', '.join(f'{c} at {factors.parameters(c) / 1e6:.1f}M' for c in cut)}" if cut else "")
            + f") they give the AdamW/Muon ratio from {low / 1e6:.2f}M to {largest / 1e6:.0f}M parameters.")
    return "\n".join(lines + ["", f"_{note}_"])


# Estimated CPU-hours per cpu_regime study (from its runs' times on 2 cores; the restored rows carry none).
REGIME_HOURS = {"lr": 1.3, "ladder_tune": 10, "ladder": 5.4, "optimizers_tune": 0.6, "optimizers": 1.3,
                "momentum_tune": 1.9, "momentum": 1.3, "mitigations_tune": 2.0, "mitigations": 1.8,
                "schemes_tune": 1.7, "schemes": 1.0}


def regime_run_counts(doc: pathlib.Path) -> str:
    """Runs per cpu_regime study in the committed rows: all, copied from another study, run for it."""
    rows = _regime_rows()
    count, copied = collections.Counter(), collections.Counter()
    for r in rows:
        count[r["study"]] += 1
        copied[r["study"]] += bool(r.get("reused_from"))
    lines = ["| study at `cpu_regime` | runs committed | copied from another study | run for it | CPU-hours (estimated) |",
             "|---|---|---|---|---|"]
    for study in sorted(count, key=lambda k: (list(REGIME_HOURS).index(k) if k in REGIME_HOURS else 99, k)):
        hours = REGIME_HOURS.get(study)
        lines.append(f"| `{study}` | {count[study]} | {copied[study]} | {count[study] - copied[study]} | "
                     f"{'-' if hours is None else hours} |")
    return "\n".join(lines + ["", f"_Counted from {_link(REGIME_RESULTS, doc)}._"])


CPU_REPORT = REPO_ROOT / "experiments" / "results" / "cpu" / "report.md"


def _report_table(report: pathlib.Path, heading: str, doc: pathlib.Path) -> str:
    """The first table after the line ``heading`` (a line starting with it) of a committed report,
    as the report prints it: one rounding, the report's, which its ``--check`` holds to its rows."""
    lines = report.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[first:end] + ["", f"_Copied from {_link(report, doc)} (regenerated from its rows by "
                                          f"`python -m experiments.report --check {report.parent.relative_to(REPO_ROOT).as_posix()}`)._"])


def cpu_lr_gap(doc: pathlib.Path) -> str:
    """The cpu report's delay gap and EF recovery per learning rate."""
    return _report_table(CPU_REPORT, "### Delay gap and EF recovery per learning rate", doc)


def cpu_mitigations(doc: pathlib.Path) -> str:
    """The cpu report's mitigations ranked by the fraction of the gap they recover."""
    return _report_table(CPU_REPORT, "| optimizer | rank | mitigation |", doc)


def cpu_ef_causes(doc: pathlib.Path) -> str:
    """The cpu report's ef_causes table: EF's share of AdamW's gap with one setting of the preset changed."""
    return _report_table(CPU_REPORT, "### What error feedback's share of AdamW's gap depends on", doc)


# The screen's plan per optimizer and cell, for the cost estimate: each arm's grid grows by about
# one point, and half the cells' gaps need the two extra seeds.
PLAN_GROWTH, PLAN_MORE_SEED_SHARE = 1, 0.5


def factors_pilot(doc: pathlib.Path) -> str:
    """The factor screen's pilots (each cell's sync run of each optimizer cut to a few hundred
    updates, ``--jobs 2``), the cost per cell they imply, and which cells the budget keeps."""
    from experiments import protocol, report_factors
    from experiments.studies import factors

    path = BENCH_LINK / "factors_pilot.jsonl"
    if not path.is_file():
        return "_No pilot recorded yet (`experiments/results/bench/factors_pilot.jsonl`)._"
    latest: dict = {}  # (cell, optimizer) -> newest record (the first two records, which name no cell, are superseded)
    for rec in records.load("factors_pilot"):
        if rec.get("cell") in factors.CELLS:
            latest[(rec["cell"], rec["figures"]["optimizer"])] = rec
    committed: dict = {}
    rows = [r for r in _regime_rows() if r["study"] in (report_factors.TUNE, report_factors.MEASURE)]
    for r in rows:
        cell = r["variant"].split("/")[0]
        committed[cell] = committed.get(cell, 0) + 1
    states = report_factors.cell_states([r for r in rows if r["study"] == report_factors.TUNE],
                                        [r for r in rows if r["study"] == report_factors.MEASURE])
    def planned(cell: str, opt: str) -> float:
        arms, seeds = sum(o == opt for o, _ in factors.arms(cell)), len(factors.CELLS[cell][1])
        return arms * ((3 + PLAN_GROWTH) * seeds + len(protocol.MEASURE_SEEDS)
                       + PLAN_MORE_SEED_SHARE * len(protocol.MORE_SEEDS))

    def run_minutes(cell: str, rec: dict) -> float:
        # a whole run: the pilot's wall time (startup, 10 validations, the test split and its
        # updates) plus the updates the pilot did not do
        f = rec["figures"]
        return (f["wall_s"] + (factors.CELLS[cell][0]["train.steps"] - f["updates"]) * f["s_per_update"]) / 60

    names = OPT_NAMES
    lines = ["| cell | " + " | ".join(f"{names.get(o, o)}: s per update, minutes per run" for o in factors.OPTIMIZERS)
             + " | tuning seeds | planned runs | job-hours | runs committed | screen |",
             "|---|" + "---|" * (len(factors.OPTIMIZERS) + 5)]
    queued = cut = 0.0
    used, partial = [], []
    for cell in factors.ORDER:
        seeds = len(factors.CELLS[cell][1])
        minutes, shown = {}, []
        for opt in factors.OPTIMIZERS:
            rec = latest.get((cell, opt))
            if rec is None:
                shown.append("not piloted")
                continue
            used.append(rec)
            minutes[opt] = run_minutes(cell, rec)
            shown.append(f"{rec['figures']['s_per_update']:.3f} s, {minutes[opt]:.1f}")
        status = "**cut**" if states[cell] == "cut" else states[cell]
        if not minutes:
            lines.append(f"| `{cell}` | " + " | ".join(shown) + f" | {seeds} | - | - | {committed.get(cell, 0)} | {status} |")
            continue
        if len(minutes) < len(factors.OPTIMIZERS):
            partial.append(cell)
        # an optimizer not piloted is priced as the mean of those that were
        mean = sum(minutes.values()) / len(minutes)
        hours = sum(planned(cell, o) * minutes.get(o, mean) for o in factors.OPTIMIZERS) / 60
        if cell in factors.CUT:
            cut += hours
        else:
            queued += hours
        lines.append(f"| `{cell}` | " + " | ".join(shown) + f" | {seeds} | "
                     f"{sum(planned(cell, o) for o in factors.OPTIMIZERS):.0f} | "
                     f"{hours:.1f} | {committed.get(cell, 0)} | {status} |")
    more = []  # the optimizers beyond the contrast, in the cells that hold them
    for cell in factors.QUEUE:
        for opt in factors.optimizers_of(cell):
            rec = latest.get((cell, opt))
            if opt in factors.OPTIMIZERS:
                continue
            if rec is None:
                more.append(f"| `{cell}` {names[opt]} | not piloted | {planned(cell, opt):.0f} | - |")
                continue
            used.append(rec)
            hours = planned(cell, opt) * run_minutes(cell, rec) / 60
            queued += hours
            more.append(f"| `{cell}` {names[opt]} | {rec['figures']['s_per_update']:.3f} s, "
                        f"{run_minutes(cell, rec):.1f} | {planned(cell, opt):.0f} | {hours:.1f} |")
    if more:
        lines += ["", "| the other optimizers | s per update, minutes per run | planned runs | job-hours |",
                  "|---|---|---|---|"] + more
    reasons = "; ".join(f"`{c}`: {why}" for c, why in factors.CUT.items())
    note = (f"A pilot is the cell's sync run of one optimizer (seed 0, at the centre of its grid) cut to its first "
            f"{max(r['figures']['updates'] for r in used)} updates or fewer, with its 10 validations and its test split, "
            f"run two at a time on their own cores as the screen runs them; a run's minutes are the pilot's wall time "
            f"plus the updates it did not do. Planned runs: each arm (AdamW and Muon: {len(factors.ARMS)} per cell; "
            + ", ".join(f"{names[o]} {sum(oo == o for oo, _ in factors.arms(c))} in `{c}`" for c in factors.QUEUE
                        for o in factors.optimizers_of(c) if o not in factors.OPTIMIZERS)
            + f") tuned on 3 + {PLAN_GROWTH} learning rates at the "
            f"cell's tuning seeds, measured at "
            f"{len(protocol.MEASURE_SEEDS)} seeds, and at {len(protocol.MORE_SEEDS)} more for "
            f"{PLAN_MORE_SEED_SHARE:.0%} of them; runs committed: the cell's rows in the cpu_regime results; screen: the cell's state "
            f"from those rows (measured: every AdamW and Muon arm at {len(protocol.MEASURE_SEEDS)} seeds or more). "
            f"The cells the budget keeps and the other optimizers: {queued:.0f} job-hours, {queued / 2:.0f} hours of wall time with "
            f"`--jobs 2`, against a budget of about {factors.SCREEN_HOURS} hours for the contrast (the cut cells would add "
            f"{cut / 2:.0f} hours more). Cut: {reasons}."
            + (f" Priced from one optimizer's pilot only: {', '.join(partial)}." if partial else "")
            + _bytes_per_token(latest)
            + f" Hardware: {_hw(used)}.")
    return "\n".join(lines + ["", f"_{note}_", "", _provenance(used, [path], doc)])


def _bytes_per_token(latest: dict) -> str:
    """A sentence per cell on another tokenizer than the default's bytes: how many bytes its tokens
    hold (its pilots' final validation loss per token over per byte), so how many more bytes its
    windows and updates hold than the byte cells' at the same shape."""
    from asyncpp_jax import configs
    from experiments.studies import factors

    byte = configs.base_config().data.tokenizer
    out = []
    for cell, (overrides, *_) in factors.CELLS.items():
        recs = [r for (c, _), r in latest.items() if c == cell]
        if overrides.get("data.tokenizer", byte) == byte or not recs:
            continue
        per = [r["figures"]["final_val_nats_per_token"] / r["figures"]["final_val_nats_per_byte"] for r in recs]
        b = sum(per) / len(per)
        out.append(f" `{cell}`'s tokens hold {b:.2f} bytes each on the validation split (its pilots' loss per token "
                   f"over loss per byte), so at the same {overrides['data.seq_len']}-token window its contexts "
                   f"and its updates hold {b:.1f} times the bytes of the byte cells'.")
    return "".join(out)


def bench_small_updates(doc: pathlib.Path) -> str:
    """Where a cpu_regime update's time goes: per call vs K updates in one call, and the model's FLOP
    rate against the core's matmul rate (the latest record)."""
    rec = records.load("bench_small_updates")[-1]
    lines = ["| optimizer | ms per update, one per call | ms per update, " + f"{rec['scan']} per call"
             + " | ratio | tokens/s | model GFLOP/s | of the core's matmul rate |", "|---|---|---|---|---|---|---|"]
    for opt, f in rec["figures"].items():
        lines.append(f"| {opt} | {f['ms_per_update']:.1f} | {f['ms_per_update_scan']:.1f} | {f['per_call_over_scan']:.2f} | "
                     f"{f['tokens_per_sec']:,} | {f['model_gflops_per_sec']:.1f} | "
                     f"{f['fraction_of_matmul_rate']:.0%} of {f['matmul_gflops_per_sec']:.0f} GFLOP/s |")
    return "\n".join(lines + ["", f"Hardware: {rec['hardware']}. "
                              + _provenance([rec], [BENCH_LINK / "bench_small_updates.jsonl"], doc)])


def update_size(doc: pathlib.Path) -> str:
    """How far one update moves the hidden matrices at the factor screen's 2bw picks (the latest
    record), beside the delay gaps the screen measured in the same cells (the cpu_regime rows)."""
    from experiments import report_factors

    rec = records.load("update_size")[-1]
    f = rec["figures"]
    kernels = list(next(iter(f.values()))["per_kernel"])
    lines = ["| cell | optimizer | 2bw lr | median ‖ΔW‖₂ / ‖W‖₂ | stable rank of ΔW | " + " | ".join(kernels) + " |",
             "|---|---|---|---|---|" + "---|" * len(kernels)]
    for key, v in f.items():
        cell, opt = key.split("/")[:2]
        rank = f"{v['median_stable_rank']:.1f}" if "median_stable_rank" in v else "-"
        lines.append(f"| {cell} | {opt} | {v['lr']:g} | {v['median_relative_step']:.2e} | {rank} | "
                     + " | ".join(f"{v['per_kernel'][k]:.2e}" for k in kernels) + " |")
    measured = [r for r in _regime_rows() if r["study"] == report_factors.MEASURE]
    cells = list(dict.fromkeys(k.split("/")[0] for k in f))
    step = {k: v["median_relative_step"] for k, v in f.items()}
    est = {c: report_factors.cell_estimates(measured, c) for c in cells}

    def gap(c, opt):
        e = (est[c] or {}).get("opts", {}).get(opt)
        return e["gap"].value if e else None

    lines += ["", "| cell | AdamW's step / Muon's | G_AdamW / G_Muon (val, 90% Fieller) |", "|---|---|---|"]
    for c in cells:
        r = (est[c] or {}).get("ratio")
        ratio_text = "-" if r is None or not r.resolved else f"{r.value:.2f} [{_f(r.lo)}, {_f(r.hi)}]"
        both = f"{c}/adamw" in step and f"{c}/muon" in step
        lines.append(f"| {c} | {step[f'{c}/adamw'] / step[f'{c}/muon']:.2f} | {ratio_text} |" if both else
                     f"| {c} | - | {ratio_text} |")
    changes = []
    for opt, name in (("adamw", "AdamW"), ("muon", "Muon")):
        for c in cells[1:]:
            first, this = f"{cells[0]}/{opt}", f"{c}/{opt}"
            if first in step and this in step and gap(c, opt) is not None and gap(cells[0], opt) is not None:
                changes.append(f"{name}'s step changes by x{step[this] / step[first]:.2f} and its gap by "
                               f"x{gap(c, opt) / gap(cells[0], opt):.2f} (learning rate {f[first]['lr']:g} -> "
                               f"{f[this]['lr']:g})")
            fixed = f"{c}/{opt}/lr={f[first]['lr']:g}" if first in f else None
            if fixed in step:
                changes.append(f"at {cells[0]}'s learning rate {f[first]['lr']:g}, {name}'s step changes by "
                               f"x{step[fixed] / step[first]:.2f}")
    if changes:
        lines += ["", f"From {cells[0]} to {', '.join(cells[1:])}, at each arm's tuned learning rate unless named: "
                  + "; ".join(changes) + "."]
    spans = {(v.get("steps", rec.get("steps")), v.get("of")) for v in f.values()}
    span = "; ".join(f"all {n:,} updates" if n == of else f"the first {n:,} updates" + (f" of {of:,}" if of else "")
                     for n, of in sorted(spans, key=str))
    lines += ["", f"_Each run: {span} of seed {rec['seed']} (the warmup is 320), the step sampled every "
              f"{rec['every']} updates and averaged over the 4 layers and the kernels; its median over the "
              f"sampled updates. Stable rank: ‖ΔW‖_F² / ‖ΔW‖₂², 1 for a rank-one update. The gaps are the "
              f"screen's, at seeds 0-2. Hardware: {rec['hardware']}._", "",
              _provenance([rec], [BENCH_LINK / "update_size.jsonl"], doc)]
    return "\n".join(lines)


def bench_prepare(doc: pathlib.Path) -> str:
    """The prepare step's throughput with a 49,152-token BPE and the paper preset's extrapolated time
    (the latest record)."""
    rec = records.load("bench_prepare")[-1]
    f = rec["figures"]
    lines = ["| workers | wall | CPU (parent + workers) | tokens/s (wall) | tokens per CPU-second |", "|---|---|---|---|---|"]
    for r in f["rows"]:
        who = "1 (the tokenizer's own threads)" if r["workers"] == 1 else f"{r['workers']} processes"
        parent = f" ({r['parent_cpu_s']} + {r['cpu_s'] - r['parent_cpu_s']:.1f})" if r.get("parent_cpu_s") is not None and r["workers"] > 1 else ""
        lines.append(f"| {who} | {r['wall_s']} s | {r['cpu_s']} s{parent} | {r['tokens_per_s']:,} | {r['tokens_per_cpu_s']:,} |")
    x = f["extrapolated"]
    best = f["rows"][-1]
    lines += ["", f"**EXTRAPOLATED, not measured:** {best['tokens_per_cpu_s']:,} tokens per CPU-second per process x "
              f"{x['cores']} dedicated cores = {x['tokens_per_s'] / 1e6:.1f}M tokens/s, so the `paper` preset's "
              f"{x['paper_tokens'] / 1e9:.1f}B tokens take about {x['hours']:.1f} h on a {x['cores']}-core host.",
              "", f"Hardware: {rec['hardware']}. " + _provenance([rec], [BENCH_LINK / "bench_prepare.jsonl"], doc)]
    return "\n".join(lines)


def _accelerator_checks() -> list[dict]:
    """The device_check records of a real accelerator run (not ``--tiny``, not a CPU)."""
    path = BENCH_LINK / "device_check.jsonl"
    recs = records.load("device_check", "device_check") if path.exists() else []
    return [r for r in recs if not r["figures"].get("tiny") and r["figures"].get("platform") != "cpu"]


def _fmt_part(part, fmt) -> str:
    if not isinstance(part, (dict, list)):
        return "not run"
    if isinstance(part, dict) and "error" in part:
        return f"FAILED ({part['error'][:80]})"
    if isinstance(part, dict) and "skipped" in part:
        return f"skipped: {part['skipped']}"
    return fmt(part)


def accelerator_checks(doc: pathlib.Path) -> str:
    """One row per accelerator run of ``python -m experiments.device_check``."""
    rows = _accelerator_checks()
    if not rows:
        return ("No accelerator has run `python -m experiments.device_check` yet: every figure of this project "
                "is from CPU. The section above says what the command will measure; its record goes to "
                "`experiments/results/bench/device_check.jsonl`.")

    def tests(t):
        c = t["counts"]
        return f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped"

    def bench(b):
        return "; ".join(f"{x['config']}: {x['tokens_per_s']:,.0f} tok/s, MFU {x['mfu']:.1%}, "
                         f"attention {x['attention']['kernel']} {x['attention']['xla_over_kernel']:.2f}x xla" for x in b)

    def engine(e):
        return "; ".join(f"{x['schedule']} on {x['stages']}: max param diff {x['max_abs_param_difference_vs_simulate']:.1e}"
                         for x in e)

    def notebook(n):
        loss = n.get("val_loss_per_byte")
        return f"{n['status']} after {n['updates']} updates, val {loss:.4f} nats/byte" if loss else n["status"]

    def lowering(x):
        return f"{x['auto_kernel']}: {x['looked_for']} {'found' if x['found'] else 'NOT found'}"

    lines = ["| date, commit | device | tests | bench_mfu | engine vs simulate | notebook preset | fused kernel | total |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["figures"]
        lines.append(f"| {r['date']}, {r['commit']} | {f['devices']} x {f['device_kind']} | "
                     + " | ".join(_fmt_part(f.get(k), fn) for k, fn in (("tests", tests), ("bench_mfu", bench),
                                                                        ("engine", engine), ("notebook", notebook),
                                                                        ("lowering", lowering)))
                     + f" | {f['total_s']:.0f} s |")
    return "\n".join(lines + ["", _provenance(rows, [BENCH_LINK / "device_check.jsonl"], doc)])


def accelerator_status(doc: pathlib.Path) -> str:
    """The README's Status line: what has run on an accelerator, from the device_check records."""
    rows = _accelerator_checks()
    tail = ("Not yet run on real hardware: any cluster, the `gpu` and `paper` study presets, and the 10B MoE "
            "beyond its dry run.")
    if not rows:
        return ("**Status**: everything here has run on CPU only (fake CPU devices for meshes, several local "
                "processes for multi-host); no GPU or TPU has run it yet (no accelerator record of "
                "`python -m experiments.device_check`, [docs/accelerators.md](docs/accelerators.md)). " + tail)
    seen = sorted({f"{r['figures']['device_kind']} ({r['figures']['platform']})" for r in rows})
    return (f"**Status**: `python -m experiments.device_check` has run on {', '.join(seen)} (the tests, "
            f"bench_mfu, the engine and the notebook's preset for {rows[-1]['figures'].get('notebook', {}).get('updates', '?')} "
            f"updates; [docs/accelerators.md](docs/accelerators.md)); everything else on CPU only. " + tail)


RENDERERS = {f.__name__: f for f in (factors_pilot, cpu_lion, cpu_lr_picks, cpu_lr_gap, cpu_mitigations, cpu_ef_causes, cpu_momentum, cpu_schemes, cpu_sensitivity, regime_run_counts, paper_regime, paper_optimizers, paper_summary, factors_answer, factors_cells, protocol_optimizers, gpu_plan, update_size, bench_small_updates, bench_prepare, notebooks, glance, main_job, main_job_summary, tiny_optimizers, bench_optimizers, optimizers_study,
                                      bench_pipeline_work, bench_pipeline_work_against, bench_pipeline_processes, bench_pipeline_compile, bench_pipeline_conditionals, bench_pipeline_schedules,
                                      moe10b_dry_run, llama3_8b_dry_run, mpmd_dry_run, vocab_parallel_table, fit_table,
                                      ci, accelerator_checks, accelerator_status)}


def render(text: str, doc: pathlib.Path) -> str:
    """``text`` with every block between markers replaced by its renderer's output."""
    def one(m: re.Match) -> str:
        name = m.group("name")
        if name not in RENDERERS:
            raise KeyError(f"{doc}: no renderer named {name!r} (known: {', '.join(RENDERERS)})")
        _typed_in_render.clear()
        body = RENDERERS[name](doc)
        if sum(_typed_in_render):
            body = _mark_typed_header(body)
        return f"<!-- render:{name} -->\n{body}\n<!-- end:{name} -->"
    return BLOCK.sub(one, text)


def check(paths: list[pathlib.Path] | None = None) -> str:
    """A unified diff of every document against its rendering; empty when all are up to date."""
    out = []
    for doc in paths or documents():
        text = doc.read_text()
        new = render(text, doc)
        if new != text:
            rel = doc.relative_to(REPO_ROOT).as_posix()
            out += difflib.unified_diff(text.splitlines(True), new.splitlines(True), rel, f"{rel} (rendered)")
    return "".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="print what differs from the records and exit 1 if any")
    args = ap.parse_args(argv)
    if args.check:
        diff = check()
        if diff:
            print(diff, end="")
            print("\nrendered tables differ from the records: run python -m experiments.render_docs", file=sys.stderr)
            return 1
        print("every rendered table matches its records")
        return 0
    for doc in documents():
        text = doc.read_text()
        new = render(text, doc)
        if new != text:
            doc.write_text(new)
            print(f"rendered {doc.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
