"""What shortens a trainer's start: torch._dynamo imported beside the start-up's waits, and
the garbage collector off while torch is imported (see pyrecover/__main__.py)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import threading


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


def end_startup_imports() -> None:
    """end_startup_imports turns the garbage collector back on where `python -m pyrecover
    train` left it off for the start-up's imports (pyrecover/__main__.py), once the last of
    them (torch._dynamo, for the optimizer) is done and before anything that makes cyclic
    garbage in bulk (torch.compile at the first step). What the imports allocated is frozen
    out of later collections, which would walk it all again (the exit's gc.collect did, for
    0.15-0.44 s)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
