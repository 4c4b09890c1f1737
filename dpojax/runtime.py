"""JAX process setup that the command line applies explicitly, after flags are parsed and before
the config is validated: multi-host initialisation and the persistent compilation cache.

(Environment variables that must be set before JAX starts its backends are in
`dpojax.xla_env`.) Library code never calls these on import.

Multi-process runs (docs/multihost.md): `initialize_distributed` starts JAX's distributed runtime
with the configured timeouts (a process that cannot reach the coordinator fails after
`distributed.initialization_timeout` seconds with a message; a process that dies is noticed by
the others within `distributed.heartbeat_timeout_seconds`), turns on CPU collectives (gloo) so
that CPU devices of several processes form one mesh, and from then on labels every log line
with the process index (`label_log_lines`).
"""

from __future__ import annotations

import glob
import logging
import os
import sys
from pathlib import Path

import ml_collections

from dpojax.errors import EXIT_DISTRIBUTED, ConfigProblem, DpojaxError
from dpojax.interrupts import Watchdog

DISTRIBUTED_INIT = ("auto", "always", "never")
# Environment variables that show a multi-process launch (TPU pods, SLURM, MPI, JAX's own).
MULTI_PROCESS_ENV = (
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "JAX_COORDINATOR_ADDRESS",
)


class DistributedError(DpojaxError, RuntimeError):
    """The processes of a multi-process run could not start together or lost each other."""

    exit_code = EXIT_DISTRIBUTED


_label = ""  # "[process i/n]" once a multi-process run has started (`process_label`)


def process_label() -> str:
    """ "[process i/n]" in a multi-process run after `initialize_distributed`, else ""."""
    return _label


def initialize_distributed(config: ml_collections.ConfigDict) -> bool:
    """`jax.distributed.initialize()` when configured (`distributed.*`) or detected from the
    environment; `distributed.initialize=never` turns it off. Returns whether it ran. Raises
    DistributedError, naming the coordinator and the timeout, when the processes cannot meet."""
    import jax

    d = config.distributed
    if d.initialize == "never":
        return False
    kwargs = {}
    if d.coordinator_address:
        kwargs = dict(
            coordinator_address=d.coordinator_address,
            num_processes=d.num_processes or None,
            process_id=None if d.process_id < 0 else d.process_id,
        )
    multi_process_env = any(
        k in os.environ for k in MULTI_PROCESS_ENV if k != "TPU_WORKER_HOSTNAMES"
    )
    # One TPU worker (a single-host VM, or this host compiling for a topology) is one process.
    multi_process_env |= "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if not (d.initialize == "always" or kwargs or multi_process_env):
        return False
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        # Collectives between the CPU devices of several processes (JAX's default since 0.4.3x;
        # set here so that it does not depend on the version). TPUs and GPUs ignore it.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    who = f"[process {d.process_id}/{d.num_processes or '?'}]" if d.process_id >= 0 else ""
    where = d.coordinator_address or "the coordinator found in the environment"
    advice = (
        f"not all processes joined the run at {where} within "
        f"distributed.initialization_timeout={d.initialization_timeout} s: start every process "
        "with the same coordinator_address (process 0's host:port, reachable from every host) "
        "and num_processes, and process ids 0..num_processes-1"
    )
    # JAX's own timeout aborts the process with a message about a task that died; ours comes
    # first and says what to check.
    watchdog = Watchdog(
        d.initialization_timeout, advice, label=who, doing=f"joining at {where}", stacks=False
    )
    if who and d.num_processes:
        # Known from the config: JAX's own lines while joining (its plugins' start-up) carry it.
        label_log_lines(who)
    try:
        with watchdog:
            jax.distributed.initialize(
                **kwargs,
                initialization_timeout=int(d.initialization_timeout) + 60,
                heartbeat_timeout_seconds=int(d.heartbeat_timeout_seconds),
            )
    except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime errors here
        raise DistributedError(f"{advice} ({' '.join(str(e).split())[:300]})") from e
    if jax.process_count() > 1:
        label_log_lines(f"[process {jax.process_index()}/{jax.process_count()}]")
    return True


class _Label(logging.Filter):
    def __init__(self, label: str):
        super().__init__()
        self.label = label

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "dpojax_label", False):
            record.msg, record.args = f"{self.label} {record.getMessage()}", None
            record.dpojax_label = True
        return True


def label_log_lines(label: str) -> None:
    """Starts every log line of the root logger's handlers (and the command line's error lines,
    `process_label()`) with `label`."""
    global _label
    _label = label
    for handler in logging.getLogger().handlers:
        labels = [f for f in handler.filters if isinstance(f, _Label)]
        for existing in labels:
            existing.label = label
        if not labels:
            handler.addFilter(_Label(label))


# The command line's log lines: time, level, message (with --verbose also the logger's name).
LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"
VERBOSE_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
# Libraries whose INFO records are their internals, not the run's progress (WARNING and up show).
NOISY_LOGGERS = ("absl", "jax._src", "orbax", "httpx")
# Library records that mislead in a dpojax run, dropped by `quiet_library_notices`: (logger,
# start of the message). transformers' advice at import where torch is not installed (dpojax
# needs torch for none of its models); orbax's warning at every save without the tracked metric
# (between two evaluations there is none, and such a checkpoint is by design never the best).
MISLEADING_RECORDS = (
    ("transformers", "PyTorch was not found"),
    ("absl", "Requested `tracked_metric`; did not provide metrics"),
)


class _DropMisleading(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_library_notices() -> None:
    """Drops the library records of `MISLEADING_RECORDS` (only those) at their loggers; call it
    before the library is imported (transformers logs its advice on import). Idempotent."""
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, start in MISLEADING_RECORDS:
        by_logger[name] = (*by_logger.get(name, ()), start)
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMisleading) for f in logger.filters):
            logger.addFilter(_DropMisleading(starts))


def configure_cli_logging(verbose: bool, stream=None) -> logging.Handler:
    """The command line's log: one handler on the root logger (replacing absl's, whose lines
    carry thread ids and source files) writing `time level message` lines to `stream` (stderr),
    INFO and up, or with `verbose` DEBUG and up with each record's logger name (the command
    line passes `--verbose`, or absl's own `--verbosity=1` and up, as `verbose`). Returns the
    handler."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        logging.Formatter(VERBOSE_LOG_FORMAT if verbose else LOG_FORMAT, LOG_DATE_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_library_notices()
    return handler


# `compilation_cache_dir`'s default: a folder of this user's cache (`cache_directory`).
USER_CACHE = "user"


def user_cache_directory(environ: dict | None = None) -> Path:
    """Where `compilation_cache_dir=user` keeps the cache: JAX's own JAX_COMPILATION_CACHE_DIR
    where it is set, else $XDG_CACHE_HOME/dpojax/jax_compilation (~/.cache/... where
    XDG_CACHE_HOME is unset). Local to the host: each process of a multi-host run has its own,
    and a gs:// workdir's bucket never holds it."""
    environ = os.environ if environ is None else environ
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(environ["JAX_COMPILATION_CACHE_DIR"])
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dpojax" / "jax_compilation"


def cache_directory(path: str, workdir: str | os.PathLike) -> Path | None:
    """The folder `compilation_cache_dir=path` names: None for '' (off), the user's cache folder
    for "user", `path` under `workdir` when relative, `path` (with ~ expanded) when absolute. A
    remote URL is refused: JAX's cache is read and written as local files."""
    if not path:
        return None
    if "://" in path:
        raise ConfigProblem(
            f"compilation_cache_dir={path!r}: the compilation cache must be a local folder; set "
            f"a local path, 'user' ({user_cache_directory()}) or '' to turn it off"
        )
    if path == USER_CACHE:
        return user_cache_directory()
    expanded = os.path.expanduser(path)
    return Path(expanded) if os.path.isabs(expanded) else Path(workdir) / expanded


def enable_compilation_cache(
    path: str, workdir: str | os.PathLike, *, min_compile_seconds: float = 1.0
) -> Path | None:
    """Turns on JAX's persistent compilation cache in the folder `path` names (`cache_directory`),
    so a rerun, a resumed run or a loop round with the same shapes loads its steps instead of
    compiling them again. Only compilations of at least `min_compile_seconds` are cached
    (docs/benchmarks.md has what each threshold measured on the tic-tac-toe recipe). Returns the
    directory, or None when `path` is "" (the cache stays as JAX's own settings have it)."""
    directory = cache_directory(path, workdir)
    if directory is None:
        return None
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


# The name TPU VMs give a slice (TPU_ACCELERATOR_TYPE) per generation, from its chip count: v4 and
# v5p count TensorCores (two per chip), v5e and v6e chips.
_ACCELERATOR_TYPES = {
    "v4": ("v4-{}", 2),
    "v5p": ("v5p-{}", 2),
    "v5e": ("v5litepod-{}", 1),
    "v6e": ("v6e-{}", 1),
}


def tpu_host_env(topology: str) -> dict[str, str]:
    """Environment that lets libtpu's compiler run on a host that is not a TPU VM of
    `topology` (e.g. "v5e:2x2") without looking for one: this host as the only worker, no
    metadata-server query, the slice's accelerator type, and no lock on libtpu (several plans,
    or a plan and the tests, may compile at once)."""
    env = {
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_SKIP_MDS_QUERY": "1",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    generation, _, dims = topology.partition(":")
    chips = 1
    for d in dims.split("x") if dims else ():
        chips *= int(d) if d.isdigit() else 1
    if generation in _ACCELERATOR_TYPES:
        name, per_chip = _ACCELERATOR_TYPES[generation]
        env["TPU_ACCELERATOR_TYPE"] = name.format(chips * per_chip)
    return env


def prepare_tpu_compile_host(topology: str, environ: dict | None = None) -> None:
    """Sets `tpu_host_env(topology)` where the environment does not set those variables already.
    Call it before JAX first initialises its backends (the CLI does, for `plan.target=tpu:...`)."""
    environ = os.environ if environ is None else environ
    for key, value in tpu_host_env(topology).items():
        environ.setdefault(key, value)


def prepare_gpu_compile_host() -> None:
    """Restricts JAX to the CPU backend (unless JAX_PLATFORMS says otherwise) before it first
    initialises its backends, for `plan.target=gpu:...`: the CUDA plugin then registers its
    compile-only GPU topologies without looking for a GPU or for cuDNN (on a host without them it
    would refuse to load and print its failed version check)."""
    import jax

    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


# Device files that show an accelerator to this host (the same files JAX checks before it starts
# its CUDA backend, and the TPU VMs' chip devices); TPU chips also show as PCI devices of
# Google's vendor id.
_GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
_TPU_DEVICE_GLOBS = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
_GOOGLE_PCI_VENDOR = "0x1ae0"


def _google_pci_devices(root: str) -> int:
    count = 0
    for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
        try:
            count += Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR
        except OSError:
            continue
    return count


def host_accelerators(root: str = "/") -> list[str]:
    """The kinds of accelerator this host shows ("gpu", "tpu"), from its device files and PCI
    devices under `root`, without loading any JAX plugin; [] on a CPU-only host."""
    found = []
    if any(os.path.exists(os.path.join(root, f.lstrip("/"))) for f in _GPU_DEVICE_FILES):
        found.append("gpu")
    tpu_files = any(glob.glob(os.path.join(root, g.lstrip("/"))) for g in _TPU_DEVICE_GLOBS)
    if tpu_files or _google_pci_devices(root):
        found.append("tpu")
    return found


def skip_accelerator_plugins(accelerators: list[str] | None = None) -> bool:
    """Keeps JAX from loading the accelerator plugins it would discover (jax[cuda]'s CUDA plugin,
    libtpu through its TPU backend) in a process that will only use the CPU, before JAX starts
    its backends: one restricted to the CPU (`JAX_PLATFORMS=cpu` or the `jax_platforms` option),
    or, on Linux, one whose platforms are not set on a host that shows no accelerator
    (`host_accelerators`; `accelerators` overrides what it finds), which is then restricted to
    the CPU. JAX imports every installed plugin even under JAX_PLATFORMS=cpu: the CUDA plugin
    maps ~0.27 GB of CUDA libraries into a process that never uses them (docs/benchmarks.md)
    and, on a host without CUDA's libraries, prints a failed version check; unrestricted, JAX
    also starts libtpu, which on a host that is not a TPU VM prints errors about its workers.
    Returns whether it skipped them; False where the platforms allow another backend, the host
    shows an accelerator, the backends are started, or this JAX version keeps its plugin
    registry elsewhere."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    platforms = (jax.config.jax_platforms or "").strip().lower()
    if not platforms:
        if accelerators is None and not sys.platform.startswith("linux"):
            return False  # (device files say nothing there: jax-metal's GPU on a Mac)
        if host_accelerators() if accelerators is None else accelerators:
            return False
        jax.config.update("jax_platforms", "cpu")
        platforms = "cpu"
    if platforms != "cpu":
        return False
    registered = getattr(xla_bridge, "_plugins_registered", None)
    lock = getattr(xla_bridge, "_plugin_lock", None)
    if registered is not False or lock is None:
        return False
    with lock:
        xla_bridge._plugins_registered = True
    return True


def peak_memory() -> dict[str, int]:
    """This process's peak resident memory and, where the devices report it (GPU, TPU), the
    largest peak of device memory in use, in bytes."""
    import resource

    import jax

    out = {"peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    peaks = [
        (d.memory_stats() or {}).get("peak_bytes_in_use")
        for d in jax.local_devices()
        if hasattr(d, "memory_stats")
    ]
    peaks = [p for p in peaks if p]
    if peaks:
        out["peak_device_bytes"] = int(max(peaks))
    return out
