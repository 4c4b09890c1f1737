"""dpojax command line: `python -m dpojax.main --config configs/<recipe>.py --workdir DIR`.

Overrides: `--config.optim.learning_rate=1e-5`. `config.mode` picks the job: train, evaluate,
export, collect, loop or submit (`dpojax.jobs`). Errors print one line (`--verbose` for the
traceback) and exit with a code that says what went wrong (`EXIT_*` below; the Customizer's own
codes are in `dpojax.customizer.client.errors`).

The command applies its runtime settings explicitly: XLA's CPU flags and huge-page malloc
(`dpojax.xla_env`), then multi-host initialisation and the compilation cache
(`dpojax.runtime`), then validation, then the job.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Recipe file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", "runs/default", "Run directory: checkpoints, metrics, exports.")
flags.DEFINE_bool("verbose", False, "Print tracebacks and debug logs.")

EXIT_CONFIG, EXIT_DATA, EXIT_NONFINITE, EXIT_PUSH = 2, 3, 4, 5


def _one_line(e: BaseException) -> str:
    text = str(e).replace("\\n", " ").replace("\\'", "'")
    return " ".join(text.split()).strip("'\"")


def _fail(message: str, code: int) -> None:
    print(f"dpojax: error: {message}", file=sys.stderr)
    sys.exit(code)


class ConfigErrors(ValueError):
    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


def run(config, workdir: str) -> object:
    """Initialises JAX's runtime, validates `config` and runs its mode; the library entry point
    behind the CLI."""
    from dpojax import runtime
    from dpojax.config import check_keys, validate
    from dpojax.jobs import run_job

    errors = check_keys(config)
    if errors:
        raise ConfigErrors(errors)
    if config.mode == "plan" and config.plan.target.startswith("tpu:"):
        runtime.prepare_tpu_compile_host(config.plan.target.removeprefix("tpu:"))
    runtime.initialize_distributed(config)  # before any JAX computation

    import jax

    errors = validate(config, num_devices=jax.device_count())
    if errors:
        raise ConfigErrors(errors)
    runtime.enable_compilation_cache(
        config.compilation_cache_dir,
        workdir,
        min_compile_seconds=config.compilation_cache_min_seconds,
    )
    return run_job(config, workdir)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; options are --config, --workdir, --verbose", 2)
    logging.basicConfig(
        level=logging.DEBUG if FLAGS.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("absl", "jax._src", "orbax", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        config = FLAGS.config
        if config is not None:
            list(config.keys())  # recipes load lazily: surface a broken one here
    except Exception as e:  # noqa: BLE001 - whatever the recipe file raised
        if FLAGS.verbose:
            raise
        _fail(f"cannot load the config: {_one_line(e)}", EXIT_CONFIG)
    if config is None:
        _fail("--config is required, e.g. --config configs/tiny_test.py", EXIT_CONFIG)
    from dpojax.customizer.client.errors import CustomizerError
    from dpojax.data.problems import DataError
    from dpojax.jobs.hub_push import PushError
    from dpojax.jobs.plan import PlanError
    from dpojax.jobs.train import NonFiniteError
    from dpojax.models import CheckpointError
    from dpojax.train.tracking import TrackerError

    try:
        run(config, FLAGS.workdir)
    except PlanError as e:
        if FLAGS.verbose:
            raise
        _fail(str(e), EXIT_CONFIG)
    except CustomizerError as e:
        if FLAGS.verbose:
            raise
        _fail(str(e), e.exit_code)
    except ConfigErrors as e:
        for line in e.errors:
            print(f"dpojax: error: {line}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except TrackerError as e:
        if FLAGS.verbose:
            raise
        _fail(str(e), EXIT_CONFIG)
    except PushError as e:
        if FLAGS.verbose:
            raise
        _fail(str(e), EXIT_PUSH)
    except (DataError, CheckpointError, FileNotFoundError, ValueError) as e:
        if FLAGS.verbose:
            raise
        _fail(str(e), EXIT_DATA)
    except NonFiniteError as e:
        if FLAGS.verbose:
            raise
        _fail(str(e), EXIT_NONFINITE)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with a bad --config override or recipe reported on one line."""
    try:
        return FLAGS(argv)
    except Exception as e:  # noqa: BLE001 - absl/ml_collections raise many types here
        if "--verbose" in argv:
            raise
        print(f"dpojax: error: bad command line or config: {_one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def cli() -> None:
    from dpojax import xla_env

    xla_env.reexec_with_hugepage_malloc()  # once: the restarted process finds the tunable set
    xla_env.apply_cpu_flags()  # before JAX creates its backends
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
