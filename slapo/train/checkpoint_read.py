"""Reading a run checkpoint's DCP files back without running code.

Safety against attacks is the loaders': nothing read back can run code.
- JSON files (`trainer.json`, `rng_rank{r}.json`, `COMPLETE.json`) hold only data.
- DCP's `FileSystemReader` unpickles `.metadata` with plain `pickle` and loads non-tensor items
  (optimizer hyper-parameters) with `torch.load(weights_only=False)`. `SafeReader` replaces the
  first with an unpickler that resolves only DCP's own metadata classes, `torch.Size`,
  dtypes/layouts and paths (any other global is refused before anything is called), and
  `SafeLoadPlanner` loads the second with `weights_only=True`. Tensors are loaded by DCP with
  `weights_only=True` already. torch 2.13 offers no pickle-free format for this state (its
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from .checkpoints import DCP_METADATA, CheckpointError, plain_name

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                "PureWindowsPath"},
    "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                       "PureWindowsPath"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP's metadata is made of (data holders with no side effects),
    plus torch dtype/layout/memory-format constants; refuses every other global, so a crafted
    `.metadata` cannot reach `os.system`, `eval`, `builtins.getattr` or any importer."""

    def __init__(self, fh, path: Path):
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and not name.startswith("_"):
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise CheckpointError(self.path, f"refusing to unpickle {module}.{name}: not part of "
                              "DCP checkpoint metadata (a crafted or foreign file?)")


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` unpickled by `_MetadataUnpickler`, and every storage
    entry checked to name a file inside the checkpoint directory."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        path = Path(str(self.path)) / name
        try:
            with open(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh, path).load()
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise CheckpointError(path, "missing") from None
        except Exception as e:  # noqa: BLE001 - any unpickling failure: a damaged file
            raise CheckpointError(path, f"not readable DCP metadata ({type(e).__name__}: "
                                  f"{e})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(path, f"holds a {type(metadata).__name__}, not DCP Metadata")
        for info in (metadata.storage_data or {}).values():
            if not plain_name(str(getattr(info, "relative_path", ""))):
                raise CheckpointError(path, f"names a file outside the checkpoint: {info!r}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


    def read_data(self, plan, planner):
        """DCP's reader (tensors with `weights_only=True`), with a failure naming the file(s)
        this rank was reading instead of torch's bare unpickling message."""
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a refused or damaged tensor record
            files = sorted({self.storage_data[item.storage_index].relative_path
                            for item in plan.items if item.storage_index in self.storage_data})
            where = Path(str(self.path)) / (files[0] if len(files) == 1 else
                                            "{" + ",".join(files) + "}")
            raise CheckpointError(where, f"refusing to load a tensor record: {error_reason(e)}"
                                  ) from None


def error_reason(e: BaseException) -> str:
    """The informative line of a loader error (torch's weights-only refusal names the global
    it refused several lines down)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    named = [x for x in lines if "GLOBAL" in x or "Unsupported" in x]
    return f"{type(e).__name__}: {(named or lines or [''])[0][:300]}"


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor items (optimizer hyper-parameters: floats,
    tuples, strings, None) with `torch.load(weights_only=True)` instead of a full unpickle."""

    def __init__(self, checkpoint_dir: Path | str = "") -> None:
        super().__init__()
        self.checkpoint_dir = checkpoint_dir  # for error messages

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - the weights-only unpickler refused it
            info = (getattr(self, "metadata", None) and
                    self.metadata.storage_data.get(read_item.storage_index))
            where = getattr(info, "relative_path", "a .distcp file")
            where = Path(str(getattr(self, "checkpoint_dir", ""))) / where
            raise CheckpointError(where, f"refusing to load {fqn!r}: not plain data "
                                  f"({error_reason(e)})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def first_checkpoint_error(e: BaseException) -> BaseException:
    """DCP wraps per-rank failures in a CheckpointException: dig out ours, if any."""
    failures = getattr(e, "failures", None) or {}
    inner = [pair[0] if isinstance(pair, tuple) else pair for _, pair in sorted(failures.items())]
    return next((x for x in inner if isinstance(x, CheckpointError)), inner[0] if inner else e)
