"""The command's help text: the modes from their records (`dpojax.config.modes`), how a run is
started, and the command's own options."""

from __future__ import annotations

import os

HELP_ARGS = ("--help", "-h", "-?", "--helpshort")


def usage() -> str:
    """The text of --help (absl prints it before the flags)."""
    from dpojax.config.modes import MODE_RECORDS

    width = max(map(len, MODE_RECORDS))
    modes = "\n".join(f"  {name:<{width}}  {m.summary}" for name, m in MODE_RECORDS.items())
    return f"""dpojax: DPO training in JAX for TPUs, GPUs and CPUs.

  python -m dpojax.main --config configs/<recipe>.py --workdir DIR [--config.<key>=<value> ...]
  python -m dpojax.main --workdir DIR --config.mode=evaluate   (or export: a run's workdir alone)

Modes (--config.mode=<mode>):
{modes}

Any mode run on a workdir that holds a run starts from that run's WORKDIR/config.json, with the
--config.<key>=<value> flags on top; --config also takes a saved config (config.json, .yaml).
Every key with its default and meaning: docs/config.md, or print them with
`python -m dpojax.config`. Exit codes: README.md#exit-codes. -v (--verbose) prints tracebacks
and debug logs.
"""


def program(argv0: str) -> str:
    return "dpojax" if os.path.basename(argv0) == "dpojax" else "python -m dpojax.main"


def help_text(program_name: str, flag_help: str) -> str:
    """`usage()` and the command's options (`flag_help`: absl's help of the command's module,
    which heads them with the module's file path)."""
    options = [line for line in flag_help.splitlines() if line.startswith(" ")]
    text = usage().replace("python -m dpojax.main", program_name)
    return f"{text}\noptions:\n" + "\n".join(options) + "\n  -v: the same as --verbose\n"
