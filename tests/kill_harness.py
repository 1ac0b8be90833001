"""A run that SIGKILLs itself at one phase of one checkpoint save (used by tests/test_faults.py).

``python tests/kill_harness.py WORKDIR CACHE_DIR STEP PHASE [KEEP]``: the fault battery's 4-step run
(checkpoints at 2 and 4, ``keep_checkpoints=KEEP``, default 5), with sealing slowed (as for a large checkpoint, so a seal handed to the
worker thread is still running when the next save begins), killed at ``PHASE`` of the save of ``STEP``:

* ``begin``: as orbax's save is called (its tmp directory about to appear);
* ``writing``: as orbax's save returns (the tmp directory there, the write in progress);
* ``commit``: after orbax's commit (the step directory renamed into place), before the seal;
* ``seal``: inside the seal, the manifest written to its tmp file but not yet renamed.
"""

import os
import signal
import sys
import time

import conftest  # noqa: F401 - the test platform and its fake devices, as in the parent test

from asyncpp_jax.train import checkpoint as ckpt_lib
from asyncpp_jax.train.trainer import Trainer
from test_faults import fault_config


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(workdir, cache_dir, step, phase, keep="5"):
    step = int(step)
    real_sha = ckpt_lib._sha256

    def slow_sha(path):
        time.sleep(0.3)
        return real_sha(path)

    ckpt_lib._sha256 = slow_sha
    real_write_manifest = ckpt_lib.write_manifest

    def write_manifest(step_dir, s, *rest):
        if s == step and phase == "commit":
            die()
        if s == step and phase == "seal":
            real_replace = os.replace

            class Os:  # the module's os, with replace() the kill
                def __getattr__(self, name):
                    return getattr(os, name)

                @staticmethod
                def replace(src, dst):
                    die()
                    real_replace(src, dst)

            ckpt_lib.os = Os()
        return real_write_manifest(step_dir, s, *rest)

    ckpt_lib.write_manifest = write_manifest
    t = Trainer(fault_config(cache_dir, keep_checkpoints=int(keep)), workdir)
    manager_save = t.checkpointer.manager.save

    def save(s, *args, **kwargs):
        if s == step and phase == "begin":
            die()
        out = manager_save(s, *args, **kwargs)
        if s == step and phase == "writing":
            die()
        return out

    t.checkpointer.manager.save = save
    t.run()
    t.close()
    print("not killed", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
