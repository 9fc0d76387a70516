"""Reading a ``torch.distributed.checkpoint`` without pickle's code execution.

Its ``FileSystemReader`` unpickles the ``.metadata`` table of contents with plain
pickle, and its ``DefaultLoadPlanner`` loads the entries that are no tensors (the
optimizer's hyper-parameters) with ``torch.load(weights_only=False)``: a crafted
checkpoint would run code in every rank that restores it. ``SafeReader`` lets the
table of contents build the classes it is made of and nothing else; ``SafePlanner``
loads those entries with ``weights_only=True``, as torch already loads the tensors.
Imported only to load: ``torch.distributed.checkpoint`` takes a second to import.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from tmd.runtime.state import decode

_DCP = "torch.distributed.checkpoint"
_METADATA_GLOBALS = frozenset(
    {("torch", "Size"), ("torch.serialization", "_get_layout"),
     (f"{_DCP}.filesystem", "_StorageInfo")}
    | {(f"{_DCP}.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")}
    | {("pathlib", name) for name in (
        "Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}
)  # fmt: skip


class MetadataUnpickler(pickle.Unpickler):
    """Builds the checkpoint's table of contents and nothing else: the classes it is
    made of, torch dtypes, and plain values."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` whose ``.metadata`` goes through ``MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # torch falls back to a rank's own table of contents
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError) as exc:
            raise ValueError(f"{path}: refused to load ({exc})") from exc
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that loads entries that are no tensors like the small
    state (``tmd.runtime.state.decode``), where torch would unpickle them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = decode(value.getvalue(), source=f"checkpoint entry {fqn}")
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        *parents, last = self.mappings[fqn]
        node: Any = self.original_state_dict
        for key in parents:
            node = node[key]
        node[last] = loaded
