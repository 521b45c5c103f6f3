"""The engine release ``plan import`` reads with when ``--engine-version`` is absent: for flags and
config files, the newest release graphplan knows whose options include every one given (a
command line of vLLM 0.23 is read as 0.23, one with ``--cuda-graph-sizes`` as the newest release
that still has it); for a vLLM log, the release the log names. Import says which it assumed.
"""

from __future__ import annotations

from ..errors import PlanError
from . import flags as F

VERSION_CODES = frozenset({"flag-not-in-version", "unknown-flag", "ambiguous-flag"})
"""Errors that say a release lacks an option (another release may have it)."""


def _key(label: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in label.split("."))


def newest_first(versions) -> list[str]:
    return sorted(versions, key=_key, reverse=True)


def from_flags(mod, engine: str, read) -> tuple[str, str]:
    """(label, note): the newest label ``read(label)`` accepts every option of; the default (with
    no note) when none does, so the read that follows reports what is wrong."""
    labels = newest_first(mod.VERSIONS)
    for label in labels:
        try:
            read(label)
        except PlanError as e:
            if any(d.code in VERSION_CODES for d in e.diagnostics):
                continue
        name = F.ENGINE_NAMES[engine]
        if len(labels) == 1:
            return (
                label,
                f"no --engine-version: read as {name} {label} (the release graphplan knows)",
            )
        newer = labels[: labels.index(label)]
        why = (
            f"the newest release graphplan knows ({', '.join(labels)})"
            if not newer
            else f"the newest of {', '.join(labels)} with every option given ({newer[-1]} "
            "lacks one)"
        )
        return (
            label,
            f"no --engine-version: read as {name} {label}, {why}; pass --engine-version to choose",
        )
    return mod.DEFAULT_VERSION, ""


def from_release(mod, engine: str, release: str | None) -> tuple[str, str]:
    """(label, note) for a release named in a log: the newest label at or below it (the oldest
    label for an older release); the default when the log names none."""
    name = F.ENGINE_NAMES[engine]
    if not release:
        return mod.DEFAULT_VERSION, (
            f"no --engine-version and the log names no release: read as {name} "
            f"{mod.DEFAULT_VERSION}; pass --engine-version to choose"
        )
    labels = newest_first(mod.VERSIONS)
    label = next((v for v in labels if _key(v) <= _key(release)), labels[-1])
    return label, (
        f"no --engine-version: the log is from {name} {release}, read as {name} {label}; "
        "pass --engine-version to choose"
    )
