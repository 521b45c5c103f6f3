"""What the three engine adapters share: located input errors, version checks, a flag reader,
config files keyed by flag names, the lost-feature diagnostics of ``plan export``, and the split of
one size list into decode batch sizes and piecewise token counts. (The plan that ``plan import``
fills is ``draft.Draft``.)
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from ..errors import Diagnostic, PlanError, did_you_mean
from ..records import decode_token_range

ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}
LOST = "engine-lost-feature"
"""A plan feature the engine cannot express: the engine would run a different table."""
NOTE = "engine-note"
"""Something the reader should know that does not change the table (never an error)."""
VERSION_NOTE = "engine-version"
"""Which engine release ``plan import`` assumed when ``--engine-version`` was not given."""


def input_error(
    file: str, code: str, message: str, hint: str = "", line: int = 0, col: int = 0, path: str = ""
) -> PlanError:
    """A bad engine input (flag, config, log): exit code 2, located, nothing written."""
    return PlanError(
        [
            Diagnostic(
                code=code,
                message=message,
                hint=hint,
                severity="error",
                file=file,
                line=line,
                col=col,
                path=path,
            )
        ]
    )


def check_version(engine: str, version: str | None, known: dict, default: str) -> str:
    v = version or default
    if v not in known:
        hint = did_you_mean(v, known) or f"known: {', '.join(known)}"
        raise input_error(
            f"<{engine}>",
            "unknown-engine-version",
            f"{ENGINE_NAMES[engine]} version {v!r} is not one graphplan targets",
            hint,
        )
    return v


# -- reading flags ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Flag:
    """One engine flag graphplan reads: ``key`` is the setting it fills."""

    key: str
    kind: str
    """``int`` | ``bool`` (store_true) | ``negbool`` (store_true that turns the key off) |
    ``json`` | ``ints`` (one or more ints, or a comma list) | ``str``."""
    lo: int = 1
    hi: int = 1 << 20


@dataclass(frozen=True, slots=True)
class Setting:
    value: object
    source: str
    """Where it came from, e.g. ``--max-num-seqs 128`` or ``config.yaml:3``."""


def tokens_of(argv) -> list[str]:
    """Shell words of a command line (a list is taken as already split); leading words that are
    not flags (``vllm serve MODEL``, ``python -m ...``, ``VAR=value``) are skipped."""
    if isinstance(argv, str):  # a pasted command: join shell line continuations first
        argv = shlex.split(argv.replace("\\\n", " "), comments=True)
    words = [w for w in argv if w.strip() and w != "\\"]
    i = 0
    while i < len(words) and not words[i].startswith("-"):
        i += 1
    if i + 1 < len(words) and words[i] in ("-m", "-u"):  # python -m module / python -u -m module
        i = next((j for j in range(i, len(words)) if words[j].startswith("--")), len(words))
    return words[i:]


def read_flags(
    words: list[str],
    flags: dict,
    ignored: set,
    removed: dict,
    engine: str,
    file: str = "<args>",
    allow_unknown: bool = False,
    normalise=lambda name: name,
) -> tuple[dict, list[Diagnostic]]:
    """Flags -> {key: Setting}. ``ignored``: flags the engine has that do not shape graphs (their
    values are skipped); ``removed``: flag -> why this version lacks it (an error)."""
    out, notes, i = {}, [], 0
    while i < len(words):
        word, col = words[i], i + 1
        where = f"argument {col} ({word})"
        if not word.startswith("-"):
            raise input_error(
                file,
                "stray-value",
                f"{where}: a value with no flag before it",
                "every value follows its flag, e.g. --max-num-seqs 128",
                1,
                col,
            )
        name, eq, inline = word.partition("=")
        name = normalise(name)
        if name in removed:
            raise input_error(file, "flag-not-in-version", f"{where}: {removed[name]}", "", 1, col)
        values = [inline] if eq else []
        j = i + 1
        while not eq and j < len(words) and not _is_flag(words[j]):
            values.append(words[j])
            j += 1
        spec = flags.get(name)
        if spec is None:
            if name in ignored:
                i = j
                continue
            hint = did_you_mean(name, list(flags) + sorted(ignored))
            if allow_unknown:
                notes.append(
                    Diagnostic(
                        code=NOTE,
                        message=f"{where}: unknown {engine} flag ignored",
                        hint=hint,
                        file=file,
                        line=1,
                        col=col,
                    )
                )
                i = j
                continue
            raise input_error(
                file,
                "unknown-flag",
                f"{where}: not a {ENGINE_NAMES[engine]} flag graphplan knows",
                (hint + " Or " if hint else "")
                + "pass --ignore-unknown to skip flags that do not shape CUDA graphs",
                1,
                col,
            )
        value, used = flag_value(spec, values, where, file, col)
        shown = [] if spec.kind == "json" or eq else values[:used]
        out[spec.key] = Setting(value, " ".join([name if spec.kind == "json" else word] + shown))
        i = i + 1 + (used if not eq else 0)
    return out, notes


def _is_flag(word: str) -> bool:
    return word.startswith("-") and not word.lstrip("-").replace(".", "").isdigit()


def flag_value(spec: Flag, values: list[str], where: str, file: str, col: int):
    if spec.kind in ("bool", "negbool"):
        if values and values[0].lower() in ("true", "false", "1", "0"):
            on = values[0].lower() in ("true", "1")
            return (on if spec.kind == "bool" else not on), 1
        return spec.kind == "bool", 0
    if not values:
        raise input_error(file, "missing-value", f"{where}: needs a value", "", 1, col)
    if spec.kind == "int":
        return to_int(values[0], where, spec.lo, spec.hi, file, col), 1
    if spec.kind == "ints":
        parts = [p for v in values for p in v.replace(",", " ").split()]
        return [to_int(p, where, spec.lo, spec.hi, file, col) for p in parts], len(values)
    if spec.kind == "json":
        return json_value(values[0], where, file, 1, col), 1
    return values[0], 1


def json_value(text: str, where: str, file: str, line: int = 1, col: int = 0):
    """A flag's JSON argument under the plan's bounds (depth, size, finite numbers: a 100k-deep
    ``[[[...`` is a located error, never a RecursionError)."""
    from ..limits import check_value

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise input_error(
            file,
            "bad-json",
            f"{where}: not JSON ({e.msg} at character {e.pos + 1})",
            "quote it: --flag '{\"key\": 1}'",
            line,
            col,
        ) from None
    except (RecursionError, ValueError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise input_error(
            file, "bad-json", f"{where}: not JSON a plan can use ({why})", "", line, col
        ) from None
    try:
        check_value(value, file, where)
    except PlanError as e:
        d = e.diagnostics[0]
        raise input_error(file, d.code, f"{where}: {d.message}", d.hint, line, col) from None
    return value


def to_int(text, where: str, lo: int, hi: int, file: str, col: int = 0, line: int = 1) -> int:
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise input_error(
            file, "bad-value", f"{where}: expected an integer, got {text!r}", "", line, col
        )
    try:
        n = int(text)
    except ValueError:
        raise input_error(
            file, "bad-value", f"{where}: {text!r} is not an integer", "", line, col
        ) from None
    if not lo <= n <= hi:
        raise input_error(
            file,
            "out-of-range",
            f"{where}: {n} is out of range; graphplan accepts {lo}..{hi}",
            "",
            line,
            col,
        )
    return n


# -- export ----------------------------------------------------------------------------------


def lost(engine: str, version: str, path: str, what: str, hint: str = "") -> Diagnostic:
    return Diagnostic(
        code=LOST,
        path=path,
        message=f"{ENGINE_NAMES[engine]} {version} cannot express {what}",
        hint=hint,
    )


def note(path: str, message: str, hint: str = "") -> Diagnostic:
    return Diagnostic(code=NOTE, path=path, message=message, hint=hint)


def shell_lines(pairs: list[tuple[str, object]]) -> list[str]:
    """(flag, value) -> one shell-quoted flag per line; value True = a bare switch."""
    out = []
    for flag, value in pairs:
        if value is True:
            out.append(flag)
        else:
            text = (
                json.dumps(value, separators=(", ", ": "))
                if isinstance(value, (dict, list))
                else str(value)
            )
            out.append(f"{flag} {shlex.quote(text)}")
    return out


# -- config files whose keys are flag names (vLLM and SGLang ``--config`` YAML; flag_reader) ------


def read_yaml_file(path: str) -> tuple[object, dict]:
    """(data, positions) of a YAML (or JSON) file, with graphplan's located loader errors."""
    from pathlib import Path

    from ..load import parse_yaml, read_text

    text = read_text(Path(path))
    if not text.strip():
        raise input_error(path, "empty", "the config file is empty", "", 1, 1)
    return parse_yaml(text, path)


def config_value(spec: Flag, value, where: str, path: str, line: int, col: int):
    if spec.kind in ("bool", "negbool"):
        if not isinstance(value, bool):
            raise input_error(
                path, "bad-value", f"{where}: expected true or false, got {value!r}", "", line, col
            )
        return value if spec.kind == "bool" else not value
    if spec.kind == "int":
        return to_int(value, where, spec.lo, spec.hi, path, col, line)
    if spec.kind == "ints":
        items = value if isinstance(value, list) else str(value).replace(",", " ").split()
        return [to_int(v, where, spec.lo, spec.hi, path, col, line) for v in items]
    if spec.kind == "json" and isinstance(value, str):
        return json_value(value, where, path, line, col)
    return value


def split_routines(sizes, q: int, seqs: int, mode: str) -> tuple[list[int], list[int], str]:
    """A plan's one size list -> (decode batch sizes in requests, piecewise token counts, a
    problem) for engines that keep separate decode (requests) and prefill (tokens) lists."""
    decode_range = decode_token_range(q, seqs)
    first, last = decode_range[0], decode_range[-1]  # bounds: sizes off the range are reported
    decode = [s for s in sizes if first <= s <= last] if mode.startswith("FULL_") else []
    problem = ""
    if any(s not in decode_range for s in decode):
        problem = f"decode graphs at sizes that are not multiples of q={q}"
    pieces = list(sizes) if mode == "FULL_AND_PIECEWISE" else []
    top = decode[-1] if decode else 0
    if pieces and top < last and pieces[-1] > top:
        problem = (
            f"PIECEWISE graphs for decode batches of {top + q}..{min(last, pieces[-1])}"
            " tokens (above the largest decode size; the engine runs them without a graph)"
        )
    return [s // q for s in decode], pieces, problem


def engine_routines(
    engine: str,
    version: str,
    mode: str,
    sizes,
    q: int,
    seqs: int,
    unsupported: dict[str, str],
    diags: list,
) -> tuple[str, list[int], list[int]]:
    """For engines with FULL decode graphs and piecewise prefill graphs only: a mode they cannot
    run (``unsupported``: mode -> what is lost) becomes FULL_AND_PIECEWISE with a diagnostic, and
    the sizes split into (decode batch sizes, piecewise token counts). Returns (mode, both)."""
    if mode in unsupported:
        diags.append(
            lost(
                engine,
                version,
                "cudagraph.mode",
                unsupported[mode],
                "use FULL_AND_PIECEWISE or FULL_DECODE_ONLY",
            )
        )
        mode = "FULL_AND_PIECEWISE"
    bs, pieces, problem = split_routines(sizes, q, seqs, mode)
    if problem:
        diags.append(
            lost(
                engine,
                version,
                "cudagraph.capture_sizes",
                problem,
                f"add size {decode_token_range(q, seqs)[-1]} or drop the sizes above it",
            )
        )
    return mode, bs, pieces
