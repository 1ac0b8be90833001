"""Entry point: ``python -m asyncpp_jax.main [--config=configs/tiny.py] [--config.a.b=V] [--workdir=DIR]``.

Loads and validates the config before JAX starts, so that a bad setting costs no compile and so
that ``XLA_FLAGS`` can still ask for the fake CPU devices a mesh needs.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from asyncpp_jax import configs, host_setup

_CONFIG = config_flags.DEFINE_config_file(
    "config", str(configs.DEFAULT_CONFIG), "Config file (a get_config() module); fields can be overridden "
    "with --config.section.field=value.", lock_config=True,
)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Build the model abstractly, lower and compile the real train "
                              "step for the config's mesh (fake CPU devices here), report memory per device "
                              "and whether it fits; no data, no allocation, no training.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (checkpoints, metrics, config). "
                               "Default: runs/<config.name>. An existing run there is resumed.")

def _fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; settings go in --config.section.field=value")
    config = configs.resolve(_CONFIG.value)
    try:
        configs.validate(config)
    except configs.ConfigError as e:
        _fail(str(e))
    host_setup.prepare(configs.devices_needed(config))
    # Our own progress at INFO; the libraries' (orbax logs every checkpoint step) at WARNING.
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("asyncpp_jax").setLevel(logging.INFO)

    if _DRY_RUN.value:  # fake CPU devices on this host: never joins a cluster
        from asyncpp_jax.train.dry_run import dry_run, format_report

        try:
            print(format_report(dry_run(config)))
        except configs.ConfigError as e:
            _fail(str(e))
        return
    # Imported here, after XLA_FLAGS is final: this is where JAX starts.
    from asyncpp_jax import distributed
    from asyncpp_jax.data import CorpusError
    from asyncpp_jax.train.trainer import Trainer, TrainingDiverged

    distributed.maybe_initialize()  # SLURM / Open MPI / TPU pod: before anything touches devices
    workdir = _WORKDIR.value or os.path.join("runs", config.name)
    try:
        trainer = Trainer(config, workdir)
        try:
            result = trainer.run()
        finally:
            trainer.close()
    except (configs.ConfigError, CorpusError) as e:
        _fail(str(e))
    except TrainingDiverged as e:
        _fail(str(e), code=1)

    print(f"\n{result.status} at step {result.step}/{config.train.steps}; outputs in {workdir}")
    if result.status == "preempted":
        print("preempted: a checkpoint was saved; run the same command again to resume.")
        return
    if result.val_loss is not None:
        u = result.unigram
        print(f"validation loss:        {result.val_loss_per_byte:.4f} nats/byte ({result.val_loss:.4f} nats/token)")
        print(f"unigram entropy (train): {u['train_entropy']:.4f} nats/byte; "
              f"unigram cross-entropy on val: {u['val_cross_entropy']:.4f} nats/byte")


def run():
    app.run(main)


if __name__ == "__main__":
    run()
