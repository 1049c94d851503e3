"""Reading a draft head's checkpoint: its tensors as a directory of safetensors files for the
strict loader, whether they were saved as safetensors or as a PyTorch state dict (read with
`weights_only`: tensors, never code)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open


@contextlib.contextmanager
def safetensors_dir(path: Path, names: Sequence[str]) -> Iterator[Path]:
    """A directory holding the first of `names` found in `path` as `*.safetensors` (linked, or
    converted from a `.pt` / `.bin` state dict); `ValueError` when none is there."""
    for name in names:
        file = path / name
        if not file.is_file():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            if name.endswith(".safetensors"):
                (Path(tmp) / name).symlink_to(file.resolve())
            else:
                from safetensors.torch import save_file

                state = torch.load(file, map_location="cpu", weights_only=True)
                tensors = {k: v.contiguous() for k, v in state.items()}
                save_file(tensors, str(Path(tmp) / "weights.safetensors"))
            yield Path(tmp)
        return
    raise ValueError(f"{path} holds none of {list(names)}")


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name in `directory`'s safetensors files, with its shape."""
    shapes = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes
