"""Reading a model directory without trusting it: only regular files inside it are opened (a FIFO,
a device, a socket, a directory in a file's place or a symlink leading out of the directory is
refused before anything opens it), JSON files are size-bounded and must hold an object, and a
file that asks to run the repository's own code (``auto_map``, ``trust_remote_code``) is refused.

A symlink may point inside the directory, or, in a Hugging Face cache
(``models--org--name/snapshots/REV/``), into that repository's ``blobs/``, where the cache keeps
the files its snapshots link to."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from graphplan.compiler.limits import read_regular_file

from .errors import ModelLoadError, RemoteCodeError

MAX_CONFIG_BYTES = 4 << 20
"""config.json, generation_config.json (real ones are a few KiB)."""
MAX_ENTRIES = 10_000
"""Files in a model directory (a 1T-parameter checkpoint has a few hundred shards)."""
TEXT_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
"""Files a tokenizer reads whole."""
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code", "custom_pipelines")

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach for the Hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def model_dir(source) -> Path:
    """The directory of ``source``: a directory, or the ``config.json`` inside one."""
    path = Path(source)
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        return path
    if path.name == "config.json" and path.parent.is_dir():
        return path.parent
    if st is None:
        try:
            os.lstat(path)
        except FileNotFoundError:
            raise ModelLoadError(
                f"{source}: no such directory; give a local model directory (config.json, "
                "model.safetensors or its shards, tokenizer files)"
            ) from None
        except OSError as e:
            raise ModelLoadError(f"{source}: cannot read it ({e.strerror or e})") from None
        raise ModelLoadError(
            f"{source}: is a symlink that leads nowhere (dangling, or a loop); give the model's "
            "directory itself"
        )
    raise ModelLoadError(f"{source}: is not a directory; give the model's directory")


def _real(path: Path) -> Path:
    """``path`` with every symlink followed; a loop of symlinks is a ModelLoadError (Python
    raises RuntimeError or OSError for one, depending on its version)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        raise ModelLoadError(
            f"{path}: is a symlink loop (its links lead back to themselves); put the file itself "
            "there, or remove it"
        ) from None


def _roots(directory: Path) -> tuple[Path, ...]:
    real = _real(directory)
    if real.parent.name == "snapshots":  # snapshots/REV/name -> ../../blobs/HASH
        return real, real.parent.parent / "blobs"
    return (real,)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def checked_path(
    directory: Path, name: str, *, limit: int | None = None, allow_dir: bool = False
) -> Path | None:
    """The real path of ``directory/name`` when it is a regular file inside the directory (None
    when absent); stat only, nothing is opened."""
    path = directory / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read it ({e.strerror or e})") from None
    real = _real(path)
    if stat.S_ISLNK(st.st_mode):
        if not any(real.is_relative_to(root) for root in _roots(directory)):
            raise ModelLoadError(
                f"{path}: is a symlink to {real}, outside the model directory; "
                "copy the file into the directory"
            )
        try:
            st = os.stat(real)
        except OSError:
            raise ModelLoadError(f"{path}: is a dangling symlink (to {real})") from None
    if stat.S_ISDIR(st.st_mode):
        if allow_dir:
            return real
        raise ModelLoadError(f"{path}: is a directory, where a file belongs")
    if not stat.S_ISREG(st.st_mode):
        raise ModelLoadError(
            f"{path}: is {_kind(st.st_mode)}; a model directory is read only from regular files"
        )
    if limit is not None and st.st_size > limit:
        raise ModelLoadError(f"{path}: {st.st_size} bytes; at most {limit} are read for this file")
    return real


def check_entries(
    directory: Path, subdirs: tuple[str, ...] = (), *, text_limit: int | None = None
) -> None:
    """Every entry of the directory (and of its ``subdirs``) is a regular file or a directory inside
    it, and its text files (.json, .txt, .model, .jinja, .tiktoken) hold at most ``text_limit``
    bytes: run before a library that opens files of its own choosing reads the directory."""
    for where in (directory, *(directory / s for s in subdirs)):
        if where is not directory:
            real = checked_path(directory, where.name, allow_dir=True)
            if real is None or not real.is_dir():
                continue
            where = real
        for name in _names(where):
            limit = text_limit if Path(name).suffix in TEXT_SUFFIXES else None
            checked_path(where, name, limit=limit, allow_dir=True)


def _names(directory: Path) -> list[str]:
    names = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                names.append(entry.name)
                if len(names) > MAX_ENTRIES:
                    raise ModelLoadError(
                        f"{directory}: more than {MAX_ENTRIES} entries; not a model directory"
                    )
    except OSError as e:
        raise ModelLoadError(f"{directory}: cannot list it ({e.strerror or e})") from None
    return names


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def read_json_object(directory: Path, name: str, *, limit: int = MAX_CONFIG_BYTES) -> dict | None:
    """``directory/name`` parsed as a JSON object, or None when absent."""
    real = checked_path(directory, name, limit=limit)
    if real is None:
        return None
    path = directory / name
    raw = read_regular_file(real, limit, name, "", error=ModelLoadError)  # O_NONBLOCK, fstat
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(
            f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except (ValueError, RecursionError) as e:
        raise ModelLoadError(
            f"{path}: not valid JSON: {str(e).splitlines()[0] if str(e) else 'nested too deeply'}"
        ) from None
    if not isinstance(obj, dict):
        raise ModelLoadError(f"{path}: holds a JSON {type(obj).__name__}, not an object")
    return obj


def refuse_remote_code(where, obj: dict) -> None:
    """RemoteCodeError when ``obj`` (a config or tokenizer config) asks to run the repository's
    own code; names the key and the Python files it points to."""
    for key in REMOTE_CODE_KEYS:
        value = obj.get(key)
        if value in (None, False, {}, []):
            continue
        modules = sorted(_modules(value)) if key == "auto_map" else []
        files = f" (it points to {', '.join(modules)})" if modules else ""
        raise RemoteCodeError(
            f"{where}: {key} asks to run the repository's own Python code{files}; graphplan "
            "never runs code from a model directory: serve a checkpoint of a supported "
            f"architecture whose {Path(str(where)).name} has no {key}"
        )


def _modules(value) -> set[str]:
    """``"modeling_x.XForCausalLM"`` or ``"org/repo--modeling_x.X"`` -> ``modeling_x.py``."""
    refs = value.values() if isinstance(value, dict) else [value]
    out = set()
    for ref in refs:
        for r in ref if isinstance(ref, list) else [ref]:
            if isinstance(r, str) and "." in r:
                out.add(r.split("--")[-1].rsplit(".", 1)[0] + ".py")
    return out
