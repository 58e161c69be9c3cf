"""The `pyrecover` command: the typer application and one module per command group.

Only this package imports typer or prints for a person; the modules it calls raise typed
errors and return data.
"""

from pyrecover.cli.app import app, main

__all__ = ["app", "main"]
