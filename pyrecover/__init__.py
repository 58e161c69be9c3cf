"""pyrecover: training that survives time limits, preemption and crashes on SLURM clusters."""

__version__ = "0.1.0"
