"""A checkpoint's weight files, read without running anything: ``model.safetensors`` or its shards
(``model.safetensors.index.json``) through safetensors, else ``pytorch_model.bin`` or its shards
through ``torch.load(weights_only=True, mmap=True)`` (tensors and plain containers only, no code).
``CheckpointReader`` lists every tensor's name, shape and dtype from the headers (a ``.bin`` is
mapped, not read), so a checkpoint is matched against the model before any weight is copied."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointMismatchError, ModelLoadError
from .files import checked_path, read_json_object

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
EXPECTED = (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX)
MAX_INDEX_BYTES = 64 << 20
MAX_SHARDS = 4096
# safetensors dtype names of the floating-point tensors a weight may come from
FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
SHOWN = 4  # names shown per kind of mismatch


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    """``torch.bfloat16``'s name ``bfloat16``, or the file's own name of a non-float type."""
    file: Path


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightFiles:
    format: str
    """``safetensors`` or ``bin``."""
    files: tuple[Path, ...]
    """Real paths, each a regular file inside the directory."""
    index: dict[str, str] | None
    """A sharded checkpoint's ``weight_map`` (tensor -> file name)."""
    where: Path
    """The file that named them (the weights file, or the index)."""


def find_weights(directory: Path) -> WeightFiles | None:
    """The directory's weights (safetensors first, as transformers does), or None."""
    for single, index, fmt in (
        (SAFETENSORS, SAFETENSORS_INDEX, "safetensors"),
        (BIN, BIN_INDEX, "bin"),
    ):
        real = checked_path(directory, single)
        if real is not None:
            return WeightFiles(format=fmt, files=(real,), index=None, where=directory / single)
        obj = read_json_object(directory, index, limit=MAX_INDEX_BYTES)
        if obj is not None:
            return _sharded(directory, index, obj, fmt)
    return None


def _sharded(directory: Path, index: str, obj: dict, fmt: str) -> WeightFiles:
    where = directory / index
    wmap = obj.get("weight_map")
    if not isinstance(wmap, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()
    ):
        raise ModelLoadError(f"{where}: weight_map must be an object of tensor name -> file name")
    names = sorted(set(wmap.values()))
    if len(names) > MAX_SHARDS:
        raise ModelLoadError(f"{where}: {len(names)} shard files; at most {MAX_SHARDS}")
    suffix = ".safetensors" if fmt == "safetensors" else ".bin"
    files = []
    for name in names:
        if "/" in name or "\\" in name or name.startswith(".") or not name.endswith(suffix):
            raise ModelLoadError(
                f"{where}: weight_map names {name!r}; shards are {suffix} files beside the index"
            )
        real = checked_path(directory, name)
        if real is None:
            raise ModelLoadError(f"{where}: names {name}, which is not in {directory}")
        files.append(real)
    return WeightFiles(format=fmt, files=tuple(files), index=dict(wmap), where=where)


def no_weights_message(directory: Path) -> str:
    others = sorted(
        p.name
        for p in directory.iterdir()
        if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
    )[:SHOWN]
    found = f"; found only {', '.join(others)}, which are not read" if others else ""
    return (
        f"{directory}: no weights: expected {', '.join(EXPECTED)}{found}. Save the model with "
        "save_pretrained, or (benchmarks, tests) ask for random weights explicitly "
        "(--random-weights, random_weights=True)"
    )


class CheckpointReader:
    """Every tensor of the weight files by name: ``infos`` from the headers, ``get`` reads one."""

    def __init__(self, weights: WeightFiles):
        self.weights = weights
        self.infos: dict[str, TensorInfo] = {}
        # a safetensors handle (get_tensor) or a mapped state dict (indexing), per file
        self._handles: dict[Path, Any] = {}
        for path in weights.files:
            handle = self._open(path)
            self._handles[path] = handle
            for name, shape, dtype in _listing(handle, weights.format, path):
                if name in self.infos:
                    raise ModelLoadError(
                        f"{weights.where}: tensor {name} is in both {self.infos[name].file.name} "
                        f"and {path.name}"
                    )
                self.infos[name] = TensorInfo(shape, dtype, path)
        if weights.index is not None:
            self._check_index(weights.where, weights.index)

    def _open(self, path: Path):
        try:
            if self.weights.format == "safetensors":
                from safetensors import safe_open

                return safe_open(str(path), framework="pt", device="cpu")
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # safetensors, pickle and zip errors have no common base
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ModelLoadError(f"{path}: cannot read the weights: {first}") from None
        if not isinstance(obj, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
        ):
            raise ModelLoadError(
                f"{path}: holds a {type(obj).__name__}, not a state dict of name -> tensor "
                "(save the model with save_pretrained)"
            )
        return obj

    def _check_index(self, where: Path, index: dict[str, str]) -> None:
        wrong = [
            f"{n} (in {self.infos[n].file.name if n in self.infos else 'no shard'}, index says {f})"
            for n, f in index.items()
            if n not in self.infos or self.infos[n].file.name != Path(f).name
        ]
        wrong += [
            f"{n} (in {i.file.name}, not in the index)"
            for n, i in self.infos.items()
            if n not in index
        ]
        if wrong:
            raise ModelLoadError(
                f"{where}: the index does not match its shards for {len(wrong)} "
                f"tensors: {', '.join(wrong[:SHOWN])}"
            )

    def get(self, name: str) -> torch.Tensor:
        handle = self._handles[self.infos[name].file]
        if self.weights.format == "safetensors":
            return handle.get_tensor(name)
        return handle[name]

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``get(name).narrow(dim, start, stop - start)`` reading only those elements from the
        file (safetensors ``get_slice``; a ``.bin`` is mapped, so only the part is paged in):
        a tensor-parallel rank's shard (models/hf/tp.py), ``dim`` 0 or 1."""
        handle = self._handles[self.infos[name].file]
        if self.weights.format == "safetensors":
            part = handle.get_slice(name)
            return part[start:stop] if dim == 0 else part[:, start:stop]
        return handle[name].narrow(dim, start, stop - start)


def _listing(handle, fmt: str, path: Path):
    if fmt == "bin":
        for name, t in handle.items():
            yield name, tuple(t.shape), str(t.dtype).removeprefix("torch.")
        return
    try:
        for name in handle.keys():
            s = handle.get_slice(name)
            dtype = s.get_dtype()
            yield (
                name,
                tuple(s.get_shape()),
                (str(FLOATS[dtype]).removeprefix("torch.") if dtype in FLOATS else dtype),
            )
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot read the weights: {e}") from None


def match(
    expected: dict[str, tuple[int, ...]],
    aliases: dict[str, str],
    infos: dict[str, TensorInfo],
    *,
    where: Path,
    ignored=lambda name: False,
    against: str = "config.json",
) -> None:
    """CheckpointMismatchError unless the checkpoint holds exactly ``expected`` (name -> shape),
    each a float tensor of that shape. ``aliases`` (tied weights, alias -> source) may be absent
    or present; ``ignored`` names are tolerated (buffers the model recomputes); ``against``: the
    file the expectation comes from, for the message."""
    missing = [n for n in expected if n not in infos]
    unexpected = [n for n in infos if n not in expected and n not in aliases and not ignored(n)]
    shapes = [
        f"{n}: {list(infos[n].shape)} in {infos[n].file.name}, the config needs {list(s)}"
        for n, s in {**expected, **{a: expected[s] for a, s in aliases.items()}}.items()
        if n in infos and infos[n].shape != tuple(s)
    ]
    floats = {str(t).removeprefix("torch.") for t in FLOATS.values()}
    dtypes = [
        f"{n}: {i.dtype} in {i.file.name}"
        for n, i in infos.items()
        if (n in expected or n in aliases) and i.dtype not in floats
    ]
    problems = []
    for what, names in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("with the wrong shape", shapes),
        ("not float16/bfloat16/float32 (quantized checkpoints are not supported)", dtypes),
    ):
        if names:
            more = f", and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            problems.append(f"{len(names)} tensors {what}: {'; '.join(names[:SHOWN])}{more}")
    if problems:
        tied = (
            " (config.json's tie_word_embeddings is false)" if "lm_head.weight" in missing else ""
        )
        raise CheckpointMismatchError(
            f"{where}: the weights do not match {against}{tied}: " + ". ".join(problems)
        )
