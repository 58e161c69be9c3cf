"""SLURM: cluster profiles, pure sbatch rendering, and the only calls to `sbatch`.

    profile.py  the cluster profile (YAML + command-line overrides), validated
    render.py   `render(spec) -> str`: the job script, pure and deterministic
    submit.py   `sbatch_argv(path)` and `submit(argv) -> job id`: the one subprocess call

Nothing here imports torch: rendering a job script must stay light.
"""

from __future__ import annotations


class LaunchError(ValueError):
    """A user mistake in launching a job: one line naming the key or value and what to do."""


class SlurmUnavailable(RuntimeError):
    """SLURM did not answer (its controller down or unreachable, its configuration unreadable):
    a fault of the cluster, not the user's mistake, so one line and exit code 1 (2 says that
    the command line or the config must change)."""
