"""Mark and intercept splitting ops at run time, for piecewise graphs of any model.

While a piecewise graph is being captured with the run-time split (``runtime/piecewise/graphs.py``),
every call of a splitting op is handed to the capture, which ends the current graph segment, runs
the op eagerly and begins the next segment. Outside a capture the hooks cost one check per call.

A plan name (``cudagraph.splitting_ops``, e.g. ``attention``) reaches its op in one of three ways:

1. a **torch custom op** called from Python (``torch.library.custom_op``): by the name rule, an op
   whose qualified name ``ns::op`` or its ``op`` part equals the name (``tiny_llama::attention``
   for ``attention``), or bound explicitly (``splitting_ops={"attention": torch.ops.ns.op}``);
   caught by a ``TorchFunctionMode`` that is active only while capturing. The name rule also
   takes a module-level function named ``attention`` in a module that defines one of the model's
   classes, called by that global name;
2. a **function marked once** with :func:`split_point`, the one-line hook for adapters::

       from .breakable import split_point
       AttentionInterface.register("graphplan", split_point("attention")(my_attention))

   (transformers looks the registered function up at every call, so every layer reaches it);
3. a **function or module the caller names**: ``GraphRunner(..., splitting_ops={"attention": x})``
   where ``x`` is an ``nn.Module`` instance (its ``forward`` is swapped while capturing), an
   ``nn.Module`` subclass (every instance of it inside the model), a ``split_point`` function, or a
   plain module-level function (its binding in the module that defines it is swapped while
   capturing; a caller that imported it under another name is not reached: use 2 then).

A declared name that no call reaches during a capture is a ``SplitError`` naming it and these fixes.
"""

from __future__ import annotations

import functools
import inspect
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from graphplan.compiler.errors import GraphplanError

from ..graphs import HostSyncInCapture

_TORCH_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_ACTIVE: list = []  # the Intercept of the capture running now (at most one)
_STEP: list = [None]  # the Step being replayed or captured


class SplitError(GraphplanError):
    """A model cannot be split into piecewise graphs at the plan's splitting ops."""


def qualified_op_name(target) -> str | None:
    """``ns::op`` for a torch op (an overload or its packet), None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target.name().partition(".")[0]  # "ns::op.overload" -> "ns::op"
    if isinstance(target, torch._ops.OpOverloadPacket) and target.overloads():
        return getattr(target, target.overloads()[0]).name().partition(".")[0]
    return None


@dataclass(frozen=True, slots=True)
class Step:
    """What a splitting op may need to know about the step that runs it."""

    num_tokens: int
    """Real tokens of the batch (the op's token tensors have ``padded_tokens`` rows)."""
    padded_tokens: int
    """Rows of the graph being replayed; rows past ``num_tokens`` carry the pad values."""
    num_reqs: int
    """Real requests; per-request inputs reach the op at this count."""


def current_step() -> Step | None:
    """The piecewise step being replayed or captured now, for a splitting op that needs the real
    counts (None outside one)."""
    return _STEP[0]


def set_step(step: Step | None) -> None:
    _STEP[0] = step


def split_point(name: str, fn: Callable | None = None):
    """Mark ``fn`` as the splitting op ``name``: ``@split_point("attention")`` or
    ``split_point("attention", fn)``. Eagerly (and in captures whose plan does not split at
    ``name``) the marked function just runs."""

    def mark(f: Callable) -> Callable:
        @functools.wraps(f)
        def split(*args, **kwargs):
            if _ACTIVE:
                return _ACTIVE[-1].reached(name, f, args, kwargs)
            return f(*args, **kwargs)

        vars(split)["graphplan_split_point"] = name  # what binding by function looks up
        return split

    return mark if fn is None else mark(fn)


class _OpMode(TorchFunctionMode):
    """Sends calls of matching torch ops to the capture; everything else runs as usual."""

    def __init__(self, intercept: "Intercept"):
        super().__init__()
        self.intercept = intercept
        self.names: dict = {}  # op -> plan name or None (cached match)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not isinstance(func, _TORCH_OPS):  # torch.* functions and Tensor methods
            return func(*args, **kwargs)
        name = self.names.get(func, False)
        if name is False:
            name = self.names[func] = self.intercept.op_name(func)
        if name is None:
            return func(*args, **kwargs)
        return self.intercept.on_split(name, func, args, kwargs)


class Intercept:
    """Where each plan name's op is reached, and the patches that reach it while active.

    ``on_split(name, fn, args, kwargs)`` is called instead of the op and returns its result."""

    def __init__(
        self, model, names: Sequence[str], bindings: Mapping[str, object], on_split: Callable
    ):
        names, bindings = list(names), dict(bindings or {})
        if not names:
            raise SplitError(
                "the plan declares no splitting ops (cudagraph.splitting_ops is "
                "empty), so there is nothing to split at: declare e.g. [attention]"
            )
        unknown = sorted(set(bindings) - set(names))
        if unknown:
            raise SplitError(
                f"splitting_ops binds {unknown}, which the plan's "
                f"cudagraph.splitting_ops {names} does not declare: add them to the "
                "plan or drop the binding"
            )
        self.names, self.on_split = names, on_split
        self.ops: dict[str, str] = {}  # qualified torch op name -> plan name
        self.points: dict[str, str] = {}  # split_point name -> plan name
        self.modules: list[tuple[torch.nn.Module, str]] = []
        self.globals: list[tuple[dict, str, Callable, str]] = []  # (namespace, attr, fn, name)
        self.rule = [n for n in names if n not in bindings]  # names matched by the name rule
        for name in self.rule:
            self.points[name] = name
            self.globals += _functions_named(name, model)
        for name, obj in bindings.items():
            self._bind(model, name, obj)

    def _bind(self, model, name: str, obj: Any) -> None:
        q = qualified_op_name(obj)
        if q is not None:
            self.ops[q] = name
        elif isinstance(obj, torch.nn.Module):
            self.modules.append((obj, name))
        elif isinstance(obj, type) and issubclass(obj, torch.nn.Module):
            found = model.modules() if isinstance(model, torch.nn.Module) else ()
            self.modules += [(m, name) for m in found if isinstance(m, obj)]
        elif hasattr(obj, "graphplan_split_point"):
            self.points[obj.graphplan_split_point] = name
        elif callable(obj) and hasattr(obj, "__module__") and hasattr(obj, "__name__"):
            fn: Callable = obj
            module = sys.modules.get(fn.__module__)
            if module is None or vars(module).get(fn.__name__) is not fn:
                raise SplitError(
                    f"splitting_ops binds {name!r} to {fn.__qualname__}, which is "
                    f"not a module-level function of {fn.__module__}, so the run-"
                    f"time split cannot reach its calls: mark it where it is defined "
                    f"or registered with split_point({name!r}, fn)"
                )
            self.globals.append((vars(module), fn.__name__, fn, name))
        else:
            raise SplitError(
                f"splitting_ops binds {name!r} to {obj!r}: bind a torch op, an "
                "nn.Module (instance or class), or a function"
            )

    def op_name(self, func) -> str | None:
        """The plan name a torch op called under the capture splits at, or None."""
        q = qualified_op_name(func)
        if q is None:
            return None
        if q in self.ops:
            return self.ops[q]
        return next((n for n in self.rule if n == q or n == q.split("::")[-1]), None)

    def reached(self, point: str, fn: Callable, args: tuple, kwargs: dict):
        """A function marked ``split_point(point)`` was called under the capture."""
        name = self.points.get(point)
        if name is None:  # marked, but this plan does not split there
            return fn(*args, **kwargs)
        return self.on_split(name, fn, args, kwargs)

    def __enter__(self) -> "Intercept":
        _ACTIVE.append(self)
        for m, name in self.modules:
            m.forward = _call_as(self.on_split, name, type(m).forward.__get__(m))
        for namespace, attr, fn, name in self.globals:
            namespace[attr] = _call_as(self.on_split, name, fn)
        self.mode = _OpMode(self) if self.rule or self.ops else None
        if self.mode is not None:
            self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.mode is not None:
            self.mode.__exit__(*exc)
        for namespace, attr, fn, _ in self.globals:
            namespace[attr] = fn
        for m, _ in self.modules:
            vars(m).pop("forward", None)  # the class's forward again
        _ACTIVE.remove(self)


def _functions_named(name: str, model) -> list[tuple[dict, str, Callable, str]]:
    """Module-level functions called ``name`` in the modules that define the model's classes
    (reached where those modules call them by that global name)."""
    classes = (type(m) for m in model.modules()) if isinstance(model, torch.nn.Module) else ()
    found: list[tuple[dict, str, Callable, str]] = []
    for module in {
        sys.modules.get(c.__module__) for c in classes if not c.__module__.startswith("torch.")
    } - {None}:
        fn = vars(module).get(name)
        if (
            inspect.isfunction(fn)
            and fn.__name__ == name
            and not hasattr(fn, "graphplan_split_point")
        ):
            found.append((vars(module), name, fn, name))
    return found


def _call_as(on_split: Callable, name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def split(*args, **kwargs):
        return on_split(name, fn, args, kwargs)

    return split


SEGMENT_FIX = (
    "compute it before the step from host values, or inside a splitting op, and keep "
    "every shape a function of the token count; or capture FULL graphs only "
    "(runner.capture(modes=('FULL',))), or use a plan without piecewise graphs "
    "(splitting_ops: [])"
)
_CAPTURE_REFUSED = (
    "stream is capturing",
    "cudaerrorstreamcapture",
    "graph capture",
    "capture invalidated",
    "capture_invalidated",
)  # CUDA's and torch's words
# torch's frames and the whole runtime's (graphs.py raises HostSyncInCapture): the frame named is
# the model's own line
_SKIP_FRAMES = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))


def segment_error(
    e: BaseException, what: str, tokens: int, calls: list[str], capturing: bool
) -> SplitError | None:
    """A SplitError for a graph segment that no graph can hold (a host sync, a data-dependent
    shape), naming the op, the segment (after ``calls``, the split ops called so far), the model's
    line and the fix; None for any other failure."""
    if isinstance(e, HostSyncInCapture):
        did = f"calls {e.op}, which syncs the host or has a data-dependent output shape"
    elif (
        capturing
        and isinstance(e, RuntimeError)
        and any(m in str(e).lower() for m in _CAPTURE_REFUSED)
    ):
        did = f"does something CUDA refuses while capturing ({str(e).splitlines()[0]})"
    else:
        return None
    seg = (
        "before the first splitting op"
        if not calls
        else f"after splitting op {calls[-1]!r} (call {len(calls)})"
    )
    frame = next(
        (
            f
            for f in reversed(traceback.extract_tb(e.__traceback__))
            if not f.filename.startswith(_SKIP_FRAMES)
        ),
        None,
    )
    at = f" at {frame.filename}:{frame.lineno} ({frame.line})" if frame else ""
    return SplitError(
        f"cannot capture {what} piecewise at {tokens} tokens: the graph segment "
        f"{seg}{at} {did}. Fix: {SEGMENT_FIX}"
    )
