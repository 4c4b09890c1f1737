"""dpojax command line: `python -m dpojax.main --config configs/<recipe>.py --workdir DIR`.

Overrides: `--config.optim.learning_rate=1e-5`. `config.mode` picks the job (train, evaluate,
export). Errors print one line (`--verbose` for the traceback) and exit non-zero.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Recipe file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", "runs/default", "Run directory: checkpoints, metrics, exports.")
flags.DEFINE_bool("verbose", False, "Print tracebacks and debug logs.")

EXIT_CONFIG, EXIT_DATA, EXIT_NONFINITE, EXIT_ERROR = 2, 3, 4, 1


def _one_line(e: BaseException) -> str:
    text = str(e).replace("\\n", " ").replace("\\'", "'")
    return " ".join(text.split()).strip("'\"")


def _fail(message: str, code: int) -> None:
    print(f"dpojax: error: {message}", file=sys.stderr)
    sys.exit(code)


def run(config, workdir: str) -> object:
    """Validates `config` and runs its mode; the library entry point behind the CLI."""
    import jax

    from dpojax.config import validate

    errors = validate(config, num_devices=jax.device_count())
    if errors:
        raise ConfigErrors(errors)
    enable_compilation_cache(
        config.compilation_cache_dir,
        workdir,
        min_compile_seconds=config.compilation_cache_min_seconds,
    )
    from dpojax import orchestrate
    from dpojax.train import loop, setup

    setup.initialize_distributed(config)
    modes = {
        "train": loop.train,
        "evaluate": loop.evaluate,
        "export": loop.export,
        "submit": loop.submit,
        "collect": orchestrate.collect,
        "loop": orchestrate.loop,
    }
    return modes[config.mode](config, workdir)


def enable_compilation_cache(
    path: str, workdir: str, *, min_compile_seconds: float = 1.0
) -> Path | None:
    """Turns on JAX's persistent compilation cache in `path` (relative: under `workdir`), so a
    later run or loop round with the same shapes loads its steps instead of compiling them again.
    Only compilations of at least `min_compile_seconds` are cached: caching every small one too
    (0) made the tic-tac-toe recipe slower on a 2-core CPU, while caching the ~3 s train step
    saves ~2 s a round. Returns the directory, or None when `path` is ""."""
    if not path:
        return None
    import jax

    directory = Path(workdir) / path if not os.path.isabs(path) else Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


class ConfigErrors(ValueError):
    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


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
    from dpojax.customizer.errors import CustomizerError
    from dpojax.data.problems import DataError
    from dpojax.models import CheckpointError
    from dpojax.train.loop import NonFiniteError

    try:
        run(config, FLAGS.workdir)
    except CustomizerError as e:
        if FLAGS.verbose:
            raise
        _fail(str(e), e.exit_code)
    except ConfigErrors as e:
        for line in e.errors:
            print(f"dpojax: error: {line}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
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
    from dpojax.xla_env import reexec_with_hugepage_malloc

    reexec_with_hugepage_malloc()  # once: the restarted process finds the tunable set
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
