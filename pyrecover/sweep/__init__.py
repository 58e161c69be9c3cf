"""Sweeps: a grid, random or bayes search over config keys, run as one SLURM job array.

    spec.py    the sweep file (wandb's sweep format) read and checked: `parse(raw) -> Sweep`
    trials.py  the trials: grid expansion or seeded random draws, each a validated Config
    record.py  the sweep directory: `sweep.yaml` (the trials as drawn) read and written
    render.py  the job array script, through pyrecover.slurm.render
    wandb_sweep.py  the sweep registered with wandb (online only), its id given to each trial
    bayes.py   a bayes trial's values: asked of wandb once, at its first start, and recorded
    agent.py   wandb's agent protocol (CreateAgent, Heartbeat) through wandb's own client
    status.py  the trials read back from their run directories, ranked by the metric

Nothing here imports torch.
"""

from __future__ import annotations


class SweepError(ValueError):
    """A user mistake in a sweep file or a sweep directory: one line naming what and where."""


class WandbUnavailable(RuntimeError):
    """wandb's server does not answer from here: a fault of the network, as a SLURM that does
    not answer is (exit 1: the same command again once it answers), not a mistake in the
    command (exit 2)."""
