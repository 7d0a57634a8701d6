"""The ``kiln`` command: a thin shell over the Python API. Compiler commands import the
compiler lazily, so ``kiln generate`` / ``kiln inspect`` never load torch or onnx."""

from __future__ import annotations

import functools
import sys

import click

from kiln.runtime.errors import KilnError
from kiln.runtime.version import __version__


def handle_errors(fn):
    """User errors become one line on stderr and exit status 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (KilnError, ValueError) as err:
            raise click.ClickException(str(err)) from None
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kiln")
def cli() -> None:
    """Kiln: compile a decoder-only LLM once per target, serve the artifact."""


def main() -> None:
    from . import bench_cmds, compile_cmds, runtime_cmds  # noqa: F401  (register the commands)

    cli(prog_name="kiln")


if __name__ == "__main__":  # python -m kiln.cli.main: register on the importable module
    from kiln.cli.main import main as _main

    _main()
