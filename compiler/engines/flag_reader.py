"""Engine command lines and ``--config`` files read against the engine's own option table
(``cli_options``): every option the release defines is accepted, the ones graphplan maps (the
adapter's ``FLAGS``) become settings, the others are listed in one note as ignored, with their
values consumed as the engine's parser consumes them. Refused is only what the engine refuses: an
unknown option (with a spelling suggestion) or an ambiguous prefix (with its candidates).
"""

from __future__ import annotations

from ..errors import Diagnostic, did_you_mean
from . import cli_options as O
from .flags import (
    NOTE,
    Setting,
    config_value,
    flag_value,
    input_error,
    read_yaml_file,
)

_BOOL_WORDS = ("true", "false", "1", "0")


def lookup(name: str, flags: dict, options: O.Options, removed: dict, ctx: tuple):
    """(option, spec) for ``name``: spec None = an option graphplan ignores; option None = an
    unknown option skipped under ``--ignore-unknown``. Raises for what the engine refuses."""
    file, line, col, where, engine, allow_unknown = ctx
    if name in removed:
        raise input_error(file, "flag-not-in-version", f"{where}: {removed[name]}", "", line, col)
    found = O.resolve(name, options)
    if found.option is not None:
        return found.option, flags.get(found.option)
    if found.candidates:
        raise input_error(
            file,
            "ambiguous-flag",
            f"{where}: ambiguous option: {name} could match {', '.join(found.candidates)}",
            f"{options.name} reads a prefix only when one option starts with it: spell it out",
            line,
            col,
        )
    elsewhere = [
        other.name
        for label in O.labels(engine)
        if label != options.label and (other := O.load(engine, label)) and name in other.arity
    ]
    if elsewhere:
        raise input_error(
            file,
            "flag-not-in-version",
            f"{where}: {options.name} has no {name} ({', '.join(elsewhere)} has)",
            "pass --engine-version for the release you run",
            line,
            col,
        )
    hint = did_you_mean(name, list(options.arity))
    if allow_unknown:
        return None, None
    raise input_error(
        file,
        "unknown-flag",
        f"{where}: not a {options.name} option",
        (hint + "; " if hint else "")
        + f"graphplan reads every option of {options.name}: pass --ignore-unknown to skip it",
        line,
        col,
    )


def read_args(
    words: list[str],
    flags: dict,
    options: O.Options,
    removed: dict,
    engine: str,
    file: str = "<args>",
    allow_unknown: bool = False,
    normalise=lambda name: name,
) -> tuple[dict, list[Diagnostic]]:
    """Flags -> ({key: Setting}, notes)."""
    out, notes, ignored, i = {}, [], [], 0
    while i < len(words):
        word, col = words[i], i + 1
        where = f"argument {col} ({word})"
        if word == "--":  # argparse: what follows is positional, never an option
            notes.append(
                _note(file, col, f"{where}: the words after '--' are not options; not read")
            )
            break
        if not O.is_option_word(word):
            raise input_error(
                file,
                "stray-value",
                f"{where}: a value with no flag before it",
                "every value follows its flag, e.g. --max-num-seqs 128",
                1,
                col,
            )
        head, eq, inline = word.partition("=")
        name = normalise(head)
        ctx = (file, 1, col, where, engine, allow_unknown)
        option, spec = lookup(name, flags, options, removed, ctx)
        if option is None:  # unknown, skipped: so are the values that follow it
            j = i + 1
            while j < len(words) and not O.is_option_word(words[j]):
                j += 1
            notes.append(_note(file, col, f"{where}: unknown {options.name} option ignored"))
            i = j
            continue
        arity = options.arity[option]
        if not eq and option != name and not name.startswith("--") and name[:2] == option:
            eq, inline = "=", name[2:]  # '-tp4': a short option with its value attached
        if eq:
            values = [inline]
            if (arity == 0 and inline.lower() not in _BOOL_WORDS) or (
                isinstance(arity, int) and arity > 1
            ):
                raise input_error(
                    file,
                    "bad-value",
                    f"{where}: ignored explicit argument {inline!r}",
                    f"{option} takes no value" if arity == 0 else f"give {option} its values",
                    1,
                    col,
                )
        else:
            taken = O.take_values(arity, words, i + 1)
            if isinstance(taken, str):
                raise input_error(file, "missing-value", f"{where}: {taken}", "", 1, col)
            values = taken
            if arity == 0 and i + 1 < len(words) and words[i + 1].lower() in _BOOL_WORDS:
                values = [words[i + 1]]
        if arity == 0 and values:  # vLLM before 0.10 read '--flag False'; argparse does not
            notes.append(
                _note(
                    file,
                    col,
                    f"{where}: {options.name} reads {option} as a switch without a value",
                    f"read as {'on' if values[0].lower() in ('true', '1') else 'off'}; "
                    f"write {option} or its --no- form",
                )
            )
        read_as = "" if option == name else f" (read as {option})"
        if spec is None and option == "--config":
            notes.append(
                _note(file, col, f"{where}: the file is not read here", "import it: --config FILE")
            )
        elif spec is None:
            ignored.append(head + read_as)
        else:
            value, _ = flag_value(spec, values, where, file, col)
            shown = [] if spec.kind == "json" or eq else values
            out[spec.key] = Setting(value, " ".join([head] + shown) + read_as)
        i += 1 + (0 if eq else len(values))
    if ignored:
        notes.append(
            _note(
                file,
                1,
                f"{len(ignored)} {options.name} flag(s) that do not shape CUDA graphs, ignored: "
                + ", ".join(ignored),
            )
        )
    return out, notes


def read_config(
    path: str,
    flags: dict,
    options: O.Options,
    removed: dict,
    engine: str,
    allow_unknown: bool,
    normalise=lambda name: name,
) -> tuple[dict, list[Diagnostic]]:
    """A ``key: value`` config whose keys are the engine's option names without dashes (the
    engine turns each into ``--key`` and parses it like a command line)."""
    data, pos = read_yaml_file(path)
    if not isinstance(data, dict):
        raise input_error(path, "not-a-mapping", "expected `flag-name: value` lines", "", 1, 1)
    out, notes, ignored = {}, [], []
    for key, value in data.items():
        line, col = pos.get((key, "<key>"), (0, 0))
        name = normalise("--" + str(key))
        ctx = (path, line, col, str(key), engine, allow_unknown)
        option, spec = lookup(name, flags, options, removed, ctx)
        if option is None:
            notes.append(_note(path, col, f"{key}: unknown {options.name} key ignored", "", line))
        elif spec is None:
            ignored.append(str(key))
        else:
            vline, vcol = pos.get((key,), (line, col))
            out[spec.key] = Setting(
                config_value(spec, value, str(key), path, vline, vcol), f"{path}:{vline} {key}"
            )
    if ignored:
        notes.append(
            _note(
                path,
                1,
                f"{len(ignored)} {options.name} key(s) that do not shape CUDA graphs, ignored: "
                + ", ".join(ignored),
            )
        )
    return out, notes


def _note(file: str, col: int, message: str, hint: str = "", line: int = 1) -> Diagnostic:
    return Diagnostic(code=NOTE, message=message, hint=hint, file=file, line=line, col=col)
