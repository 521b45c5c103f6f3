"""The compiled path: the model compiled once by ``torch.compile`` with a dynamic token dimension,
then captured per size by the runner (vLLM's recipe: compile once with a symbolic token count,
capture a graph per size). The graphs then replay fused kernels instead of the model's own.

    runner = GraphRunner(model, table, inputs, compile=True)     # or "inductor", "aot_eager", a
    runner.capture()                                             # backend callable, a CompiledModel
    runner.stats()["compile"]  # {'backend': 'inductor', 'compiles': 1, 'recompiles': 0, ...}

How one compile serves every size, 1 included (``warm_up``):
- it runs at the largest graph's size, with dimension 0 of every input (tokens, requests) marked
  dynamic, so the compiled code takes the token count as a symbol instead of a constant;
- during that compile, sizes are *size-oblivious* (``backed_size_oblivious``): a symbol ranges over
  [0, inf) instead of [2, inf), so no guard excludes a batch of one token (by default torch
  specialises sizes 0 and 1, and a decode step of one request would compile again);
- and sizes are not *duck-shaped* (``use_duck_shape=False``), a safeguard: a token count and a
  request count that happen to be equal at warm-up never share a symbol (torch 2.13 already keeps
  dimensions marked dynamic apart), so a mixed batch does not compile again;
- every call runs under ``torch.no_grad()``, as capture does (grad mode is part of the guards);
- then the smallest graph's size runs too, not size-oblivious (as a step would): torch's lowering
  still guards ``tokens > 1`` in some ops (the HF models hit it), and the compile that size then
  needs happens inside the warm-up, not at a capture or a step.

What is compiled is the model *writing into* the caller's output buffers (``run_into``): the copy
into the runner's static outputs is fused into the model's last kernels, so a FULL graph of the
compiled model holds the model alone (reduce-overhead's graphs hold the same kernels).

Linear layers that read one input (q/k/v, gate/up) are compiled as one GEMM each: the warm-up's
eager run relays their weights end to end in place, and each graph dynamo hands the backend is
rewritten to one linear + narrows (runtime/compiled/merge_linear.py; ``merge=False`` turns it off). If the
merged graph fails to compile, the unmerged one is compiled instead (logged).

A model's repeated layers are compiled once (runtime/compiled/regions.py; ``regional=False`` turns it
off): the graph dynamo traced is cut after each layer's attention and MLP GEMMs, and the backend
compiles the head, one attention half, one MLP half and the tail; the other layers run that code.
If a region fails to compile, the whole graph is compiled instead (logged).

Every compilation goes through a counting backend: ``compiles`` counts them all, ``recompiles``
those after the warm-up, each logged as a warning (``TORCH_LOGS=recompiles`` names the guard that
failed). A model that branches on the token count (``if x.shape[0] == 1``) still compiles again
at the size that takes the other branch: counted and logged, never silent. A model that fixes the
token count to a constant fails the warm-up with ModelCompileError.

Compile applies to FULL graphs. Eager steps run the model as written (``CompiledModel.model``):
they are the shapes no graph covers (mixed batches of a FULL_DECODE_ONLY plan, sizes above the
largest graph), where a model may read the batch on the host (the HF adapter's prefill attention
does), which would compile again per shape. PIECEWISE graphs run the uncompiled model too, for now:
the run-time split's capture-time hooks (runtime/piecewise/breakable.py) would change what the compiled code
was guarded on. The hook for compiled pieces is ``CaptureJob.piecewise_model`` (capture.py): the
model the split runs.
"""

from __future__ import annotations

import inspect
import logging
import time

import torch

from graphplan.compiler.errors import GraphplanError

from ..buffers import as_tuple
from .merge_linear import merge_linears, relay_linears
from .regions import compile_regions

__all__ = ["CompiledModel", "ModelCompileError", "compiled_model"]

log = logging.getLogger("graphplan.runtime")


class ModelCompileError(GraphplanError):
    """The model could not be compiled once for every token count."""


def _shape_config():
    """The compile's shape settings (see the module docstring). torch has no public API for them:
    ``torch.fx.experimental._config`` is where torch 2.7-2.13 keep them; a torch without one of
    them compiles without it (size 1 then recompiles, which is counted and logged)."""
    from torch.fx.experimental import _config as fx_config

    want = {"backed_size_oblivious": True, "use_duck_shape": False}
    return fx_config.patch(**{k: v for k, v in want.items() if hasattr(fx_config, k)})


def _lookup(backend: str):
    # torch._dynamo.lookup_backend: torch.compile's own name -> backend table; torch.compiler only
    # lists the names (list_backends), and a counting wrapper needs the callable itself.
    return torch._dynamo.lookup_backend(backend)


INDUCTOR_DEFAULTS = {"triton.autotune_pointwise": False}
"""Inductor config patches the compiled path applies unless ``options`` sets them: one launch
configuration per pointwise kernel instead of several tried at the first run. Each
configuration is compiled, and a compile of regions waits for its kernels once per region; on
the H100 the step times did not move (bench/results/compiled_probe.md)."""


class CompiledModel:
    """``model`` compiled once for every token count; call it like the model (keyword tensors).

    ``backend``: a torch.compile backend name ("inductor", "aot_eager", "eager") or a backend
    callable ``(GraphModule, example_inputs) -> callable``. ``options``: inductor config patches
    (e.g. ``{"cpp.vec_isa_ok": False}``), for the "inductor" backend only, over
    ``INDUCTOR_DEFAULTS``. ``merge``: merge
    linear layers that read the same input into one GEMM (runtime/compiled/merge_linear.py; it lays their
    weights out end to end, in place). ``regional``: compile a model's repeated layers once
    (runtime/compiled/regions.py): the backend sees a head, one layer and a tail instead of every layer.
    Share one instance between runners of the same model (a server swapping tables) to compile
    once.
    """

    def __init__(
        self,
        model,
        backend="inductor",
        *,
        options: dict | None = None,
        fullgraph: bool = False,
        merge: bool = True,
        regional: bool = True,
    ):
        if options and backend != "inductor":
            raise ValueError(f"options are inductor config patches; backend is {backend!r}")
        self.model = model
        self.backend = (
            backend
            if isinstance(backend, str)
            else getattr(backend, "__name__", type(backend).__name__)
        )
        self._inner = _lookup(backend) if isinstance(backend, str) else backend
        self._options = {**(INDUCTOR_DEFAULTS if backend == "inductor" else {}), **(options or {})}
        self._merge = merge
        self._regional = regional
        self.merged = 0
        """Groups of linear layers merged into one GEMM, over all compilations."""
        self.regions = 0
        """Regions the compiled graphs were split into (0: compiled whole), over all
        compilations."""
        self.region_compiles = 0
        """Of those regions, how many the backend compiled (the others reuse an identical one)."""
        self.compiles = 0
        """Compilations (backend calls; a graph break makes two per compile)."""
        self.recompiles = 0
        """Compilations after the warm-up: zero when the token dimension is fully dynamic."""
        self.seconds = 0.0
        """Warm-up wall time: tracing, compiling and one run at the warm-up size."""
        self.warm = False
        self._like: tuple = ()  # per output: (dtype, device, trailing shape), once warm
        self._single = True
        self._token_input: str | None = None
        self._rows = 0  # the outputs' height at the warm-up
        # a plain callable object compiles through its __call__ (torch.compile takes functions)
        fn = (
            model
            if isinstance(model, torch.nn.Module) or inspect.isroutine(model)
            else model.__call__
        )
        self._fn = torch.compile(
            _writing_into(fn), backend=self._compile, fullgraph=fullgraph, dynamic=None
        )

    def _compile(self, gm, example_inputs):
        self.compiles += 1
        if self.warm:
            self.recompiles += 1
            log.warning(
                "the compiled model (%s) compiled again after its warm-up (recompile "
                "%d): a guard failed, so this call pays a compile. Run with "
                "TORCH_LOGS=recompiles to see which guard",
                self.backend,
                self.recompiles,
            )
        if self._merge:
            try:  # the rewrite and the compile of its result; the unmerged graph is still right
                merged = _copy(gm)
                n = merge_linears(merged, example_inputs)
                if n:
                    compiled = self._build(merged, example_inputs)
                    self.merged += n
                    return compiled
            except Exception as e:
                log.warning(
                    "merging linear layers broke this graph's compile (%s); compiling it unmerged",
                    _first_line(e),
                )
        return self._build(gm, example_inputs)

    def _build(self, gm, example_inputs):
        """``gm`` compiled region by region when it has repeated layers, else whole."""
        if self._regional:
            try:  # a failed region leaves the whole graph to compile, which is still right
                regions = compile_regions(gm, self._backend)
            except Exception as e:
                log.warning(
                    "compiling this graph region by region failed (%s); compiling it whole",
                    _first_line(e),
                )
                regions = None
            if regions is not None:
                self.regions += regions.regions
                self.region_compiles += regions.compiled
                return regions.module
        return self._backend(gm, example_inputs)

    def _backend(self, gm, example_inputs):
        if self._options:
            return self._inner(gm, example_inputs, config_patches=self._options)
        return self._inner(gm, example_inputs)

    def warm_up(
        self,
        inputs: dict[str, torch.Tensor],
        outputs: tuple | None = None,
        *,
        token_input: str | None = None,
        also: dict | None = None,
    ) -> tuple | None:
        """Compile at these inputs' sizes (use the largest), dimension 0 of each input and output
        marked dynamic. ``outputs``: where the compiled code writes (see ``run_into``); by
        default tensors shaped like the model's output, found by one eager run.
        ``token_input``: the input whose row count is the outputs' (default: the first input
        with as many rows as the eager output). ``also``: inputs at another size (the smallest
        graph's) that run in the warm-up too: torch's lowering specialises some models at one
        token (some of its ops guard ``tokens > 1`` even while sizes are size-oblivious; the HF
        models do), and that size's compile then belongs to the warm-up, counted in
        ``compiles``, not ``recompiles``. Returns the outputs written. Raises ModelCompileError
        if the model cannot be compiled for a symbolic token count. A no-op (returning None)
        once warm."""
        if self.warm:
            return None
        t0 = time.perf_counter()
        if self.backend == "inductor":
            _start_compile_workers()  # they start while the eager run and dynamo trace
        with torch.no_grad():  # eager: the outputs' dtypes, trailing shapes and rows
            if self._merge and isinstance(self.model, torch.nn.Module):
                out, _ = relay_linears(self.model, lambda: self.model(**inputs))
            else:
                out = self.model(**inputs)
        self._single = not isinstance(out, (tuple, list))
        first = as_tuple(out)[0]
        self._like = tuple((o.dtype, o.device, tuple(o.shape[1:])) for o in as_tuple(out))
        self._token_input = token_input or next(
            (
                k
                for k, t in inputs.items()
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == first.shape[0]
            ),
            None,
        )
        if self._token_input is None:
            raise ModelCompileError(
                "no input has as many rows as the model's output "
                f"({first.shape[0]}); the compiled path needs outputs with "
                "one row per token"
            )
        del out, first
        if outputs is None:
            outputs = self._empty(inputs[self._token_input].shape[0])
        self._rows = outputs[0].shape[0]
        for t in (*inputs.values(), *outputs):
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                torch._dynamo.mark_dynamic(t, 0)
        try:
            with _shape_config(), torch.no_grad():
                self._fn(tuple(outputs), inputs)
            # ``also`` runs as a step would (sizes not size-oblivious): a size the guards exclude
            # compiles here specialised to it. Size-oblivious, torch 2.11's Triton codegen failed
            # on the one-token symbol (CantSplit), found on the H100.
            if also is not None:  # into the same buffers: a capture writes into ones this tall
                with torch.no_grad():
                    self._fn(tuple(outputs), also)
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ModelCompileError(
                f"compiling the model with backend {self.backend!r} and a dynamic token dimension "
                f"failed: {type(e).__name__}: {msg}. Fix: check that the model runs eagerly at "
                "this size; a forward that fixes the token or request count to a constant (e.g. "
                "`x.view(16, -1)`) cannot compile once for every size (TORCH_LOGS=dynamic names "
                "the specialisation); or run without compile"
            ) from e
        self.seconds = time.perf_counter() - t0
        if self.compiles == 0:  # dynamo ran the frame eagerly instead (a warning says why)
            raise ModelCompileError(
                f"torch.compile ran the model without compiling it (backend {self.backend!r}), "
                "most likely because torch._dynamo.config.recompile_limit compilations of its "
                "forward exist already (one per CompiledModel). Fix: share one CompiledModel "
                "between runners of a model (GraphRunner(..., compile=compiled)), or raise "
                "torch._dynamo.config.recompile_limit"
            )
        self.warm = True
        log.info(
            "compiled the model once (%s, dynamic token dimension) in %.1f s: %d compilation(s)",
            self.backend,
            self.seconds,
            self.compiles,
        )
        return tuple(outputs)

    def run_into(self, outputs: tuple, inputs: dict[str, torch.Tensor]) -> None:
        """Run the compiled model and write output i into rows [0, n) of ``outputs[i]`` (static
        buffers of at least n rows): the copy is fused into the model's last kernels, so a graph
        of this call writes its result in place instead of copying it out."""
        if not self.warm:
            self.warm_up(inputs)
        with torch.no_grad():
            self._fn(tuple(outputs), inputs)

    def __call__(self, **inputs):
        """The model's output (one tensor or a tuple, as the model returns), computed by the
        compiled code into fresh tensors: views of the first n rows of tensors as tall as the
        warm-up's (the height the compiled code was specialised to where torch specialised a
        size; see ``warm_up``'s ``also``)."""
        outputs = self.warm_up(inputs) if not self.warm else None
        n = inputs[self._token_input].shape[0]
        if outputs is None:
            outputs = self._empty(max(self._rows, n))
            self.run_into(outputs, inputs)
        outputs = tuple(o[:n] for o in outputs)
        return outputs[0] if self._single else outputs

    def _empty(self, rows: int) -> tuple:
        assert self._like is not None  # set by the warm-up
        return tuple(
            torch.empty((rows, *shape), dtype=dtype, device=device)
            for dtype, device, shape in self._like
        )

    def stats(self) -> dict:
        return {
            "backend": self.backend,
            "compiles": self.compiles,
            "recompiles": self.recompiles,
            "seconds": self.seconds,
            "merged_linears": self.merged,
            "regions": self.regions,
            "region_compiles": self.region_compiles,
        }


def _start_compile_workers() -> None:
    """Start inductor's pool of processes that compile Triton kernels now, not when dynamo hands
    inductor its graph: until the pool is up (several seconds: each worker imports torch),
    inductor compiles kernels in this process, one by one. Not waited for: waiting cost more
    than compiling the first regions' kernels here (H100: 5 s). torch has no public API for the
    pool (``torch._inductor.async_compile``, torch 2.4-2.13); without it, nothing changes."""
    try:
        from torch.utils._triton import has_triton

        if has_triton():  # a GPU Triton compiles for
            from torch._inductor.async_compile import maybe_warm_pool

            maybe_warm_pool()
    except Exception as e:
        log.debug("inductor's compile workers: %s", _first_line(e))


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().split(chr(10))[0][:200]}"


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm``'s graph (nodes and their meta) over the same attributes, to rewrite."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def _writing_into(fn):
    """The function that is compiled: ``fn``'s outputs written into the caller's buffers."""

    def model_into(outputs: tuple, inputs: dict):
        for dst, src in zip(outputs, as_tuple(fn(**inputs))):
            dst.narrow(0, 0, src.shape[0]).copy_(src)

    return model_into


def compiled_model(model, compile) -> CompiledModel | None:
    """The runner's ``compile`` option -> a CompiledModel, or None when off (False / None).
    True is inductor; a string names a backend; a CompiledModel is used as is (it must wrap this
    model); any other callable is a backend."""
    if compile is None or compile is False:
        return None
    if isinstance(compile, CompiledModel):
        if compile.model is not model:
            raise ValueError("the CompiledModel passed as compile= wraps another model")
        return compile
    return CompiledModel(model, "inductor" if compile is True else compile)
