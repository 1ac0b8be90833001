"""Faults around the prepare step and the machine's limits: no orphaned workers after a kill, a
SIGTERM that says what it kept, a wait on another prepare's lock that names its holder, and one
line (exit 1) for a file-size or address-space limit, during a prepare and at a run's start."""

import fcntl
import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import threading
import time

import pytest

from asyncpp_jax import configs
from asyncpp_jax.data import prepare as prepare_lib
from asyncpp_jax.data.tokenizers import train_bpe
from helpers import STDLIB

PREPARE = [sys.executable, "-m", "asyncpp_jax.data.prepare", "--no_progress_bar"]


def _children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    out = set()
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


def _alive(pids) -> set[int]:
    out = set()
    for p in pids:
        try:
            state = pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(p)
    return out


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    texts = [p.read_text() for p in sorted(pathlib.Path(STDLIB, "json").glob("*.py"))]
    return train_bpe(texts, 300, str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="counts processes through /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT],
                         ids=lambda s: s.name)
def test_prepare_workers_die_with_their_parent(bpe, tmp_path, sig):
    """Before: SIGKILL or SIGTERM to a prepare with --workers left its workers and the resource
    tracker running under PID 1 for good, and SIGTERM printed nothing.  Now every child is gone
    within seconds, and SIGTERM says what was kept, as Ctrl-C does."""
    # Groups of 8 documents: the first progress record comes within seconds, the rest takes minutes.
    # SIGINT as a terminal's Ctrl-C delivers it: a test run started in the background (nohup, `&`)
    # passes SIGINT on ignored, and Python keeps an inherited SIG_IGN, so the build would run on.
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from asyncpp_jax.data import prepare; prepare._ENCODE_GROUP_DOCS = 8; "
            "sys.exit(prepare.main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "--no_progress_bar", "--source=stdlib", f"--tokenizer={bpe}", "--workers=2",
           f"--cache_dir={tmp_path}", "--checkpoint_seconds=0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, children = time.monotonic() + 60, set()
        while time.monotonic() < deadline and not list(tmp_path.glob("*.partial/progress.json")):
            children |= _children(proc.pid)
            time.sleep(0.05)
        children |= _children(proc.pid)
        assert proc.poll() is None and len(children) >= 3, "the workers (2) and the resource tracker never ran"
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 20
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(children), f"orphans after {sig.name}: {_alive(children)}"
    finally:
        for p in _alive(_children(proc.pid)) | {proc.pid}:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    err = proc.stderr.read()
    if sig != signal.SIGKILL:
        assert "corpus: interrupted;" in err and "keeps the progress" in err, err
        assert "Traceback" not in err and proc.returncode == 130, err


def test_a_prepare_waiting_on_another_says_so_naming_it(tmp_path):
    """Before: a second prepare into the same directory waited without a word (53 s in the report)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("some text to tokenize\n" * 50)
    (src / "b.txt").write_text("other text, also tokenized\n" * 50)
    logs: list[str] = []
    out = {}
    plan = prepare_lib._plan(str(src), prepare_lib.get_tokenizer("byte"), 0.5, 0, "train", "text", 0)
    partial = tmp_path / "cache" / f"{plan.slug}-{plan.key}.partial"
    partial.mkdir(parents=True)
    (partial / "holder.json").write_text(json.dumps({"pid": 4242, "host": "elsewhere", "since": time.time()}))
    fd = os.open(partial, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another prepare at work
    waiter = threading.Thread(target=lambda: out.setdefault("path", prepare_lib.prepare_corpus(
        str(src), cache_dir=str(tmp_path / "cache"), val_fraction=0.5, log=logs.append, progress_bar=False)))
    waiter.start()
    deadline = time.monotonic() + 30
    while not any("waiting" in m for m in logs) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.close(fd)  # the other one gave up: this one builds the corpus itself
    waiter.join(timeout=60)
    line = next(m for m in logs if "waiting" in m)
    assert "waiting for another prepare of the same corpus" in line and "pid 4242 on elsewhere" in line
    assert os.path.isfile(os.path.join(out["path"], "meta.json"))
    assert not os.path.exists(os.path.join(out["path"], "holder.json"))


# Sets one soft limit, then execs the command.  A wrapper process rather than subprocess's
# preexec_fn: the test process runs JAX's threads, and code between fork and exec in a threaded
# process can deadlock (Python warns of exactly that).
_SET_LIMIT_THEN_EXEC = ("import os, resource, sys; r, v = int(sys.argv[1]), int(sys.argv[2]); "
                        "resource.setrlimit(r, (v, resource.getrlimit(r)[1])); os.execv(sys.argv[3], sys.argv[3:])")


def _limited(cmd: list[str], resource_id: int, value: int) -> list[str]:
    """``cmd`` run under the soft limit ``value`` on ``resource_id`` (as ``ulimit`` would set it)."""
    return [sys.executable, "-c", _SET_LIMIT_THEN_EXEC, str(resource_id), str(value), *cmd]


def test_file_size_and_address_space_limits_are_one_line(tmp_path):
    """Before: ``OSError: File too large`` and ``MemoryError`` tracebacks from the prepare step, and a
    run under a small ``ulimit -v`` died in JAX's start ("Fatal Python error: Aborted") or with an
    allocation's traceback.  Now one line naming the limit, exit 1."""
    prepare = [*PREPARE, "--source=stdlib", f"--cache_dir={tmp_path}"]
    for limit, needle in (((resource.RLIMIT_FSIZE, 100_000), "at most 100,000 bytes in this shell (ulimit -f)"),
                          ((resource.RLIMIT_AS, 300 << 20), "out of memory (the address-space limit, ulimit -v")):
        out = subprocess.run(_limited(prepare, *limit), capture_output=True, text=True, timeout=300)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stderr.strip().splitlines()[-1].startswith("error: ") and needle in out.stderr, out.stderr[-3000:]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(_limited([sys.executable, "-m", "asyncpp_jax.main", f"--workdir={tmp_path / 'run'}"],
                                  resource.RLIMIT_AS, 2 << 30),
                         cwd=configs.REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert "the address-space limit of this shell (ulimit -v) is 2.00 GiB" in out.stderr


@pytest.mark.slow  # a run's start (JAX, the trainer) under ulimit -f: ~10 s
def test_a_file_size_limit_at_a_runs_start_is_one_line(tmp_path):
    """The run prepares its corpus under ``ulimit -f``: one line, exit 1 (the environment's doing)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(_limited([sys.executable, "-m", "asyncpp_jax.main", f"--workdir={tmp_path / 'run'}",
                                   f"--config.data.cache_dir={tmp_path / 'cache'}"], resource.RLIMIT_FSIZE, 100_000),
                         cwd=configs.REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith("error: preparing the corpus in ")
    assert "at most 100,000 bytes in this shell (ulimit -f)" in out.stderr
