"""Entry point: ``python -m asyncpp_jax.main [--config=configs/tiny.py] [--config.a.b=V] [--workdir=DIR]``.

Loads and validates the config before JAX starts, so that a bad setting costs no compile and so
that ``XLA_FLAGS`` can still ask for the fake CPU devices a mesh needs.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging
import ml_collections
from ml_collections import config_flags

from asyncpp_jax import configs, host_setup

# Defining the config flag already applies the --config.* overrides, and ml_collections fails on a
# renamed field with a bare AttributeError: name the new field first.
if configs.renamed_flag_errors(sys.argv[1:]):
    print("error: " + " ".join(configs.renamed_flag_errors(sys.argv[1:])), file=sys.stderr)
    sys.exit(2)

def _fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def _config_arg(argv) -> str:
    """The value of --config (the last one given), or the default config file."""
    value = str(configs.DEFAULT_CONFIG)
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            value = a[len("--config="):]
        elif a == "--config" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def preflight(argv) -> None:
    """Load the --config file and check every --config.x.y override names a field, before absl
    parses the flags: its own errors for these are tracebacks.  Exits 2 with one line on a mistake."""
    value = _config_arg(argv)
    path, *args = value.split(":")
    if not os.path.isfile(path):
        _fail(f"--config={value} could not be loaded (no such file); pass a config file such as "
              f"{os.path.relpath(configs.DEFAULT_CONFIG)} (the presets are in configs/).")
    where = f"--config={value}"
    try:
        spec = importlib.util.spec_from_file_location("_asyncpp_preflight_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except SyntaxError as e:
        _fail(f"{where} has a syntax error at line {e.lineno}: {e.msg}; fix the file, or start from "
              f"{os.path.relpath(configs.DEFAULT_CONFIG)}.")
    except Exception as e:  # noqa: BLE001 - whatever the file's top level raised
        _fail(f"{where} failed while loading ({type(e).__name__}: {e}); fix the file.")
    if not callable(getattr(module, "get_config", None)):
        _fail(f"{where} defines no get_config() function; a config file returns its settings from "
              f"get_config() (see {os.path.relpath(configs.DEFAULT_CONFIG)}).")
    try:
        config = module.get_config(*args)
    except Exception as e:  # noqa: BLE001
        _fail(f"{where}: its get_config() raised {type(e).__name__}: {e}; fix the file.")
    if not isinstance(config, ml_collections.ConfigDict):
        _fail(f"{where}: get_config() returned a {type(config).__name__}, not an ml_collections.ConfigDict; "
              "return configs.base_config() with your changes (see configs/tiny.py).")
    for a in argv:
        if not a.startswith("--config."):
            continue
        name = a[len("--config."):].split("=", 1)[0]
        node, walked = config, []
        for part in name.split("."):
            if not (isinstance(node, (ml_collections.ConfigDict, dict)) and part in node):
                keys = list(node.keys()) if isinstance(node, (ml_collections.ConfigDict, dict)) else []
                close = difflib.get_close_matches(part, keys, n=1)
                hint = (f"did you mean config.{'.'.join([*walked, close[0]])}?" if close else
                        f"the fields of config{'.' if walked else ''}{'.'.join(walked)} are: {', '.join(sorted(keys))}"
                        if keys else f"config.{'.'.join(walked)} is not a section")
                _fail(f"--config.{name}: no such setting; {hint}")
            node, walked = node[part], [*walked, part]


# Likewise a config file that does not load or an override naming no field: checked here, since
# defining the flag loads the file and applies the overrides (both as tracebacks).
if any(a.startswith("--config") for a in sys.argv[1:]):
    preflight(sys.argv[1:])

_CONFIG = config_flags.DEFINE_config_file(
    "config", str(configs.DEFAULT_CONFIG), "Config file (a get_config() module); fields can be overridden "
    "with --config.section.field=value.", lock_config=True,
)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Build the model abstractly, lower and compile the real train "
                              "step for the config's mesh (fake CPU devices here), report memory per device "
                              "and whether it fits; no data, no allocation, no training.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (checkpoints, metrics, config). "
                               "Default: runs/<config.name>. An existing run there is resumed.")

class _OneLineLibraryErrors(logging.Filter):
    """orbax logs each failed background write with its traceback (five for one full disk); the
    trainer reports the cause in one message, so the library's records keep their first line only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" in (record.pathname or ""):
            record.exc_info, record.exc_text = None, None
        return True


def _load_config():
    """The --config file with its overrides (its automatic fields unresolved: the trainer and the dry
    run decide them against a memory budget), or a one-line error (ml_collections raises an OSError
    wrapping the import failure when the file is missing or broken)."""
    try:
        # An unlocked copy; the flag's value is lazy: the failure shows on first use.
        return ml_collections.ConfigDict(_CONFIG.value.to_dict())
    except OSError as e:
        path = flags.FLAGS["config"].config_filename
        reason = "no such file" if not os.path.isfile(path) else str(e.__cause__ or e).strip().splitlines()[-1]
        _fail(f"--config={path} could not be loaded ({reason}); pass a config file such as "
              f"{os.path.relpath(configs.DEFAULT_CONFIG)} (the presets are in configs/).")


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; settings go in --config.section.field=value")
    config = _load_config()
    workdir = _WORKDIR.value or os.path.join("runs", config.name)
    try:
        configs.validate(config)
        if host_setup.cpu_only_host():
            configs.check_cpu_host(config)
        configs.check_workdir(workdir)
    except configs.ConfigError as e:
        _fail(str(e))
    from asyncpp_jax.train.workdir_lock import WorkdirLock  # no JAX import

    busy = WorkdirLock(workdir).probe()  # the Trainer takes the lock; this only answers a second run at once
    if busy:
        _fail(busy, code=1)
    needed = configs.devices_needed(config)
    # The dry run may compile its suggestions (2x/4x data or stages) on more fake devices.
    chosen_count = host_setup.FORCE_DEVICES in os.environ.get("XLA_FLAGS", "")
    try:
        host_setup.prepare(min(4 * needed, configs.MAX_CPU_DEVICES) if _DRY_RUN.value else needed)
    except ValueError as e:  # a malformed ASYNCPP_CPUS
        _fail(str(e))
    # Our own progress at INFO; the libraries' (orbax logs every checkpoint step) at WARNING.
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("absl").addFilter(_OneLineLibraryErrors())
    logging.getLogger("asyncpp_jax").setLevel(logging.INFO)

    if _DRY_RUN.value:  # fake CPU devices on this host: never joins a cluster
        import jax

        from asyncpp_jax.train.dry_run import dry_run, format_report

        devices = jax.devices() if chosen_count else jax.devices()[:needed]
        try:
            report = dry_run(config, devices, spare_devices=jax.devices())
        except configs.ConfigError as e:
            _fail(str(e))
        print(format_report(report))
        if not report["fits_budget"]:
            sys.exit(1)
        return
    # Imported here, after XLA_FLAGS is final: this is where JAX starts.
    from asyncpp_jax import distributed
    from asyncpp_jax.data import CorpusError
    from asyncpp_jax.train.checkpoint import CheckpointError
    from asyncpp_jax.train.trainer import DeadStart, Trainer, TrainingDiverged, WorkdirBusy, WorkdirError

    distributed.maybe_initialize()  # SLURM / Open MPI / TPU pod: before anything touches devices
    trainer = None
    try:
        trainer = Trainer(config, workdir)
        try:
            result = trainer.run()
        except KeyboardInterrupt:
            raise  # not close(): it would wait for the in-flight saves
        except BaseException:
            trainer.close()
            raise
        if not trainer.compile_abandoned:
            trainer.close()
    except KeyboardInterrupt:  # a second Ctrl-C: at once, and never a checkpoint that was not sealed
        if trainer is None:
            saved = "interrupted before training started"
        else:
            last = trainer.last_sealed()
            saved = (f"the last sealed checkpoint is step {last}" if last is not None else "no checkpoint was sealed")
        print(f"\ninterrupted: stopped at once; {saved} (anything newer is unsealed and will be set aside on "
              "resume); run the same command again to resume.", file=sys.stderr, flush=True)
        os._exit(130)  # not a clean exit: in-flight writes are abandoned, as asked
    except (configs.ConfigError, CorpusError, DeadStart) as e:
        _fail(str(e))
    except (TrainingDiverged, CheckpointError, WorkdirBusy, WorkdirError) as e:
        _fail(str(e), code=1)

    print(f"\n{result.status} at step {result.step}/{config.train.steps}; outputs in {workdir}")
    if result.status == "preempted":
        if trainer.compile_abandoned:
            print("preempted during the first step's compilation: nothing new to save; run the same command "
                  "again to resume.", flush=True)
            trainer.release_workdir()
            os._exit(0)  # the abandoned compile runs on a worker thread: do not wait for it
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
