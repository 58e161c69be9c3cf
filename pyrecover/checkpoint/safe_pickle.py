"""Read DCP's `.metadata` pickle without letting it name anything but DCP's metadata classes.

`torch.distributed.checkpoint.FileSystemReader.read_metadata` unpickles `.metadata` with plain
`pickle.load`, so a `.metadata` whose `__reduce__` names `os.system` runs a command when the
checkpoint is loaded. Anyone who can write the checkpoint can also fix up its manifest, so the
checksum is no defence. Here the unpickler resolves only the globals a real DCP metadata
pickle holds (listed from torch 2.13's own pickles: the metadata dataclasses, `_StorageInfo`,
`torch.Size`, dtypes, the layout and memory-format encodings, the checkpoint id's path) and
refuses anything else as an invalid checkpoint. Plain containers, numbers and strings are
opcodes, not globals, and need no permission.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO

import torch

from pyrecover.checkpoint.store import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *((_DCP_METADATA, name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorProperties", "ChunkStorageMetadata",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # called with a layout's name: a table lookup
    ("collections", "OrderedDict"),
    *((module, cls) for module in ("pathlib", "pathlib._local")
      for cls in ("PosixPath", "PurePosixPath")),
})


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which DCP metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("holds a persistent reference, which DCP metadata never does")


def load_metadata(f: BinaryIO, where: object) -> Any:
    """load_metadata unpickles DCP metadata from `f`, resolving only DCP's own classes.

    Raises CheckpointError naming `where` for anything else, or for a pickle that is not
    a DCP `Metadata`.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _Restricted(io.BytesIO(f.read())).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError) as exc:
        raise CheckpointError(f"{where}: not DCP metadata ({exc}); refused: a checkpoint "
                              f"file is never allowed to run code") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata
