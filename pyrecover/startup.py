"""What shortens a trainer's start: torch._dynamo imported beside the start-up's waits, and
the garbage collector off until the first step (see pyrecover/__main__.py)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import threading

from pyrecover.phases import Phases


def import_in_background(name: str) -> threading.Thread:
    """import_in_background starts importing module `name` in a daemon thread.

    torch.optim's Optimizer imports torch._dynamo on first use (add_param_group and step are
    wrapped by torch._disable_dynamo, which imports it lazily), 1.7 s of every start on an
    idle 2-core VM and up to 4 s on a busy one. Started at the top of `train.main`, it runs
    while the main thread waits without the GIL: reading the corpus, the process group's
    rendezvous with the other ranks, CUDA's start, building the model. The optimizer's own
    import then waits on the module lock for what is left. A failure is left for that import
    to raise.
    """
    def load() -> None:
        with contextlib.suppress(Exception):
            importlib.import_module(name)

    thread = threading.Thread(target=load, name=f"pyrecover-import-{name}", daemon=True)
    thread.start()
    return thread


def end_startup(phases: Phases) -> None:
    """end_startup marks the first step and turns the garbage collector back on where
    `python -m pyrecover train` left it off for the start-up's imports; what start-up
    allocated is frozen out of later collections (they would walk it all again)."""
    phases.once("first_step")
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
