"""Bytes of distinct storages: views of one storage count once."""
from __future__ import annotations

from typing import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the storage behind ``tensor`` (valid only while the storage is alive)."""
    return StorageWeakRef(tensor.untyped_storage()).cdata


def storage_nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().nbytes())


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    return sum({storage_key(t): storage_nbytes(t) for t in tensors}.values())
