"""Engine adapters: plans to and from vLLM, SGLang and TensorRT-LLM configurations.

``export_plan`` turns a compiled plan into an engine's flags or config file, with one diagnostic per
feature the engine cannot express (an error under ``strict: true``); ``import_plan`` turns an
engine's flags, config file or (vLLM) log into a plan whose every value carries a comment saying
where it came from. Torch-free; engine versions and sources: docs/engines.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import ModuleType

from ..errors import Diagnostic, PlanError
from . import flags as F

ENGINES = ("vllm", "sglang", "trtllm")


def adapter(engine: str) -> ModuleType:
    if engine == "vllm":
        from . import vllm

        return vllm
    if engine == "sglang":
        from . import sglang

        return sglang
    if engine == "trtllm":
        from . import trtllm

        return trtllm
    raise F.input_error(
        "<engine>",
        "unknown-engine",
        f"{engine!r} is not an engine graphplan speaks",
        "one of vllm, sglang, trtllm",
    )


def _checked_version(mod, engine: str, version: str | None) -> str:
    """An adapter that reads releases by rule (TensorRT-LLM) checks its own; others list labels."""
    own = getattr(mod, "check_version", None)
    if own is not None:
        return own(version)
    return F.check_version(engine, version, mod.VERSIONS, mod.DEFAULT_VERSION)


@dataclass(frozen=True, slots=True)
class Exported:
    text: str
    config: dict
    """The engine-native settings (EngineArgs / ServerArgs / LLM API options)."""
    version: str
    diagnostics: tuple[Diagnostic, ...] = field(default_factory=tuple)

    @property
    def lost(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.code == F.LOST)


def export_plan(
    loaded, sizes, engine: str, fmt: str | None = None, version: str | None = None
) -> Exported:
    """``loaded``: a LoadedPlan; ``sizes``: the compiled table's capture sizes."""
    from ..modes import resolve_mode

    mod = adapter(engine)
    version = _checked_version(mod, engine, version)
    fmt = fmt or mod.FORMATS[0]
    if fmt not in mod.FORMATS:
        raise F.input_error(
            f"<{engine}>",
            "unknown-format",
            f"{F.ENGINE_NAMES[engine]} export has no format {fmt!r}",
            f"one of {', '.join(mod.FORMATS)}",
        )
    spec = loaded.spec
    mode, _ = resolve_mode(spec.cudagraph, spec.scheduler.decode_query_len)
    cfg, diags = mod.export_config(spec, mode.name, tuple(sizes), version)
    diags = [loaded.locate(d) for d in diags]
    if spec.cudagraph.strict and any(d.code == F.LOST for d in diags):
        raise PlanError(
            [
                replace(d, severity="error", hint=d.hint + "; or set strict: false")
                for d in diags
                if d.code == F.LOST
            ]
        )
    text = mod.render(cfg, fmt, version, spec.name)
    return Exported(text=text, config=cfg, version=version, diagnostics=tuple(diags))


@dataclass(frozen=True, slots=True)
class Imported:
    text: str
    """The plan YAML, one comment per value."""
    plan: dict
    version: str
    diagnostics: tuple[Diagnostic, ...] = field(default_factory=tuple)


def import_plan(
    engine: str,
    *,
    args=None,
    config: str | None = None,
    log: str | None = None,
    version: str | None = None,
    sets: dict | None = None,
    allow_unknown: bool = False,
) -> Imported:
    """A plan from flags (``args``: a list or a command line), a config file path, or (vLLM) a
    log file path. Raises PlanError (exit code 2) for bad input; nothing is written."""
    from .. import compile_plan

    mod = adapter(engine)
    inferred = version is None and not hasattr(mod, "check_version")  # TensorRT-LLM: main
    version = _checked_version(mod, engine, version)
    given = [k for k, v in (("args", args), ("--config", config), ("--log", log)) if v is not None]
    if len(given) != 1:
        raise F.input_error(
            f"<{engine}>",
            "one-source",
            "give exactly one of --config FILE, --log FILE or -- ARGS...",
            f"got {', '.join(given) or 'none'}",
        )
    notes: list[Diagnostic] = []
    assumed = ""
    if inferred and log is None:
        from . import version_infer

        read = (
            (lambda v: mod.read_args(args, v, allow_unknown))
            if args is not None
            else (lambda v: mod.read_config(config, v, allow_unknown))
        )
        version, assumed = version_infer.from_flags(mod, engine, read)
    if args is not None:
        settings, notes = mod.read_args(args, version, allow_unknown)
        source = "flags"
    elif config is not None:
        settings, notes = mod.read_config(config, version, allow_unknown)
        source = config
    else:
        assert log is not None  # exactly one source was given
        if not hasattr(mod, "read_log"):
            raise F.input_error(
                log,
                "no-log-reader",
                f"{F.ENGINE_NAMES[engine]} logs are not read",
                "give --config FILE or -- ARGS...",
            )
        settings, seen, notes = mod.read_log(log)
        source = log
        if inferred:
            from . import version_infer

            version, assumed = version_infer.from_release(mod, engine, seen)
        elif seen and seen != version:
            notes.append(
                F.note(
                    "",
                    f"the log is from vLLM {seen}; read with the rules of {version}",
                    "pass --engine-version to match",
                )
            )
    if assumed:
        notes.insert(0, Diagnostic(code=F.VERSION_NOTE, message=assumed))
    draft = mod.to_draft(settings, version)
    draft.apply_sets(dict(sets or {}))
    mod.finish_sizes(draft, version)
    draft.fill_defaults()
    plan = draft.as_dict()
    compile_plan(plan)  # an imported plan that does not compile is an error, not a file
    header = [
        f"Imported by graphplan's `plan import --engine {engine}` "
        f"({F.ENGINE_NAMES[engine]} {version}) from {source}.",
        "Each comment says where the value came from, or which default was assumed.",
    ]
    return Imported(
        text=draft.yaml(header), plan=plan, version=version, diagnostics=tuple(notes + draft.notes)
    )
