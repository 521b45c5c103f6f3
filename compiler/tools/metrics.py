"""``plan workload --from-metrics``: a workload (``trace_file``'s JSONL with counts) from the
Prometheus scrapes of a running engine. The rules, stated once (docs/workload.md explains them):

- **Series.** vLLM: the histogram ``vllm:iteration_tokens_total`` (tokens per engine step; every
  vLLM since 0.6, V0 and V1 engines, labels ``model_name`` and, V1, ``engine``); a vLLM without it
  falls back to the gauge ``vllm:num_requests_running``. SGLang publishes no tokens-per-step
  histogram: the gauge ``sglang:num_running_reqs``. graphplan: the histogram
  ``graphplan:iteration_tokens`` with a ``routine`` label (``decode`` / ``mixed``).
- **Which series** (``metrics_series``). ``--label k=v`` keeps the series with those labels. Of
  series that differ only in rank labels inside one engine (SGLang's ``tp_rank``, ``pp_rank``,
  ``moe_ep_rank``: they report the same batches) the lowest ranks are read. The rest, when they
  are of one model (one ``model_name``, or none), are the engines of one deployment (vLLM's
  data-parallel ``engine="0"``, ``engine="1"``, SGLang's ``dp_rank``), which run one plan: they add
  up (histogram counts summed, gauge samples pooled), with a note. Series of several models are
  refused, naming the models, unless ``--merge`` adds them up too.
- **Window.** One scrape: everything since the engine started. Several: the last minus the first;
  a bucket that goes down between two consecutive scrapes is a counter reset and is refused.
- **Spread.** A bucket ``(lo, hi]`` holding ``c`` steps: ``uniform`` gives the k = hi - lo whole
  token counts lo+1..hi the steps ``floor((i+1)c/k) - floor(ic/k)`` (i = 0..k-1: exact total, no
  two counts differ by more than one); ``upper`` puts all ``c`` at ``hi`` (the most each could pad
  to, a worst case). Steps above the largest finite bucket edge are left out unless
  ``--max-tokens N`` spreads them over (edge, N]; steps of 0 tokens are left out.
- **Shape.** A step of n tokens is a uniform decode step (n / q requests of q =
  ``--decode-query-len`` tokens) when n is a multiple of q and n <= q * ``--max-num-seqs``;
  otherwise one request of n tokens (a prefill chunk). graphplan's ``routine`` label says which it
  is. A gauge sample of r running requests is one decode step of r requests, one per scrape.
- **Size.** More than ``trace_file.MAX_STEPS`` steps are scaled down (floor of each bucket's
  share); the optimum depends on proportions only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..records import decode_token_range
from .metrics_series import ENGINE_METRICS, detect_engine, select
from .prom_text import NUMBER, Scrape, ScrapeError, series_text
from .trace_file import HEADER_VERSION, MAX_STEPS

MAX_TOKENS = 1 << 20
"""The schema's largest max_num_batched_tokens: bucket edges above it count as "above"."""
SPREADS = ("uniform", "upper")


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    engine: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    merge: bool = False
    spread: str = "uniform"
    decode_query_len: int = 1
    max_num_seqs: int = 256
    max_tokens: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricsWorkload:
    header: dict
    rows: tuple[tuple[int, int, int, int], ...]
    """(num_tokens, num_reqs, max_query_len, count), ascending."""
    notes: tuple[str, ...]

    @property
    def steps(self) -> int:
        return sum(r[3] for r in self.rows)


@dataclass(frozen=True, slots=True)
class _Hist:
    edges: tuple[float, ...]
    """Ascending bucket edges, the last +Inf."""
    cum: tuple[int, ...]
    lines: tuple[int, ...]


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


def _whole(v: float, source: str, line: int, what: str) -> int:
    if not math.isfinite(v) or v < 0 or v != int(v):
        raise ScrapeError(
            f"{source}:{line}: {what} is {v!r}; a count is a whole number >= 0 "
            "(a corrupted or hand-edited scrape?)"
        )
    return int(v)


def _edge(le: str, source: str, line: int) -> float:
    v = float(le) if NUMBER.fullmatch(le) else math.nan
    if v == math.inf:
        return v
    if math.isnan(v) or v < 0 or v != int(v):
        raise ScrapeError(f'{source}:{line}: bucket le="{le[:40]}" is not a whole token count >= 0')
    return v


def _histograms(scrape: Scrape, family: str) -> dict[tuple, _Hist]:
    src = scrape.source
    kind = scrape.types.get(family)
    if kind and kind[0] != "histogram":
        raise ScrapeError(f"{src}:{kind[1]}: {family} is typed {kind[0]}, not histogram")
    rows: dict[tuple, list] = {}
    for s in scrape.samples.get(family + "_bucket", []):
        le = dict(s.labels).get("le")
        if le is None:
            raise ScrapeError(f"{src}:{s.line}: {family}_bucket without an le label")
        key = tuple(kv for kv in s.labels if kv[0] != "le")
        count = _whole(s.value, src, s.line, f'{family}_bucket{{le="{le[:40]}"}}')
        rows.setdefault(key, []).append((_edge(le, src, s.line), count, s.line))
    out = {}
    for key, buckets in rows.items():
        buckets.sort()
        for a, b in zip(buckets, buckets[1:]):
            if a[0] == b[0]:
                raise ScrapeError(f"{src}:{b[2]}: bucket le={b[0]:g} repeats line {a[2]}")
            if b[1] < a[1]:
                raise ScrapeError(
                    f"{src}:{b[2]}: bucket le={b[0]:g} holds {b[1]}, fewer than le={a[0]:g} "
                    f"(line {a[2]}: {a[1]}); buckets are cumulative"
                )
        if buckets[-1][0] != math.inf:
            raise ScrapeError(
                f'{src}:{buckets[-1][2]}: {series_text(family, key)} has no le="+Inf" bucket'
            )
        out[key] = _Hist(*(tuple(x) for x in zip(*buckets)))
    for s in scrape.samples.get(family + "_count", []):
        h = out.get(s.labels)
        if h is not None and _whole(s.value, src, s.line, f"{family}_count") != h.cum[-1]:
            raise ScrapeError(
                f'{src}:{s.line}: {family}_count is {s.value:g} but its le="+Inf" bucket '
                f"(line {h.lines[-1]}) holds {h.cum[-1]}; they must agree"
            )
    return out


def _window(scrapes: list[Scrape], hists: list[dict], keys, family: str) -> dict:
    """Per-bucket counts of each series: the last scrape minus the first (resets refused)."""
    for sc, h in zip(scrapes, hists):
        missing = [k for k in keys if k not in h]
        if missing:
            raise ScrapeError(
                f"{sc.source}: no {series_text(family, missing[0])} (it is in "
                f"{scrapes[-1].source}); give scrapes of one engine run"
            )
    for (sa, ha), (sb, hb) in zip(zip(scrapes, hists), zip(scrapes[1:], hists[1:])):
        for key in keys:
            a, b = ha[key], hb[key]
            if a.edges != b.edges:
                raise ScrapeError(
                    f"{sb.source}: {series_text(family, key)} has other buckets than in "
                    f"{sa.source}; give scrapes of one engine run"
                )
            for j, (x, y) in enumerate(zip(a.cum, b.cum)):
                if y < x:
                    raise ScrapeError(
                        f'{sb.source}:{b.lines[j]}: {family}_bucket{{le="{b.edges[j]:g}"}} went '
                        f"down from {x} ({sa.source}:{a.lines[j]}) to {y}: a counter reset "
                        "between these scrapes (the engine restarted); give scrapes of one engine "
                        "run, or the last one alone"
                    )
    out = {}
    for key in keys:
        last, first = hists[-1][key], hists[0][key]
        cum = [y - (x if len(hists) > 1 else 0) for x, y in zip(first.cum, last.cum)]
        out[key] = (last.edges, [c - p for c, p in zip(cum, [0] + cum[:-1])])
    return out


def _spread(edges, counts, opts: Options, left: dict) -> tuple[np.ndarray, np.ndarray]:
    """(token counts, steps) from per-bucket counts; see the module docstring."""
    cap = opts.max_tokens or MAX_TOKENS
    tokens, steps, lo, above, top = [], [], 0, 0, 0
    spans = []
    for hi, c in zip(edges, counts):
        if hi > cap:
            above += c
        elif hi == 0:
            left["zero_token_steps"] += c
        else:
            spans.append((lo, int(hi), c))
            top = int(hi)
        lo = int(hi) if math.isfinite(hi) else lo
    if above and opts.max_tokens and opts.max_tokens > top:
        spans.append((top, opts.max_tokens, above))
    else:
        left["above_steps"] += above
        left["above_tokens"] = max(left["above_tokens"], top)
    for lo, hi, c in spans:
        if not c:
            continue
        if opts.spread == "upper":
            tokens.append(np.array([hi]))
            steps.append(np.array([c]))
            continue
        k = np.arange(hi - lo, dtype=np.int64)
        per = (k + 1) * c // (hi - lo) - k * c // (hi - lo)
        tokens.append(lo + 1 + k[per > 0])
        steps.append(per[per > 0])
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return cat(tokens), cat(steps)


def _shape(n: np.ndarray, opts: Options, routine: str | None):
    q = opts.decode_query_len
    if routine is None:
        decode = (n % q == 0) & (n <= decode_token_range(q, opts.max_num_seqs)[-1])
    else:
        decode = (n % q == 0) & (routine == "decode")
    return np.where(decode, n // q, 1), np.where(decode, q, n)


def _scale(per_key: dict, notes: list) -> dict:
    total = sum(sum(c) for _, (_, c) in per_key.items())
    if total <= MAX_STEPS:
        return per_key
    notes.append(
        f"{total} steps scaled down to at most {MAX_STEPS} (each bucket keeps the floor of its "
        "share; the optimum depends on proportions only)"
    )
    return {k: (e, [c * MAX_STEPS // total for c in cs]) for k, (e, cs) in per_key.items()}


def _from_histogram(scrapes, family: str, split, opts: Options, notes: list):
    hists = [_histograms(sc, family) for sc in scrapes]
    if not hists[-1]:
        return None
    keys = select(
        list(hists[-1]), family, opts.labels, opts.merge, scrapes[-1].source, split, notes
    )
    per_key = _scale(_window(scrapes, hists, keys, family), notes)
    merged: dict = {}
    for key, (edges, counts) in per_key.items():
        routine = dict(key).get(split) if split else None
        prev = merged.get(routine)
        if prev is not None and prev[0] != edges:
            raise ScrapeError(
                f"{scrapes[-1].source}: the series to --merge have different buckets; "
                "keep one with --label"
            )
        merged[routine] = (edges, [a + b for a, b in zip(prev[1], counts)] if prev else counts)
    left = {"above_steps": 0, "above_tokens": 0, "zero_token_steps": 0}
    rows: list[tuple[int, int, int, int]] = []  # (num_tokens, num_reqs, max_query_len, count)
    for routine, (edges, counts) in sorted(merged.items(), key=lambda kv: str(kv[0])):
        n, c = _spread(edges, counts, opts, left)
        r, m = _shape(n, opts, routine if routine in ("decode", "mixed") else None)
        rows += zip(n.tolist(), r.tolist(), m.tolist(), c.tolist())
    if left["above_steps"]:
        notes.append(
            f"{_steps(left['above_steps'])} above {left['above_tokens']} tokens (the largest "
            "bucket edge) are left out: their token counts are unknown (--max-tokens N spreads "
            "them up to N, the engine's max_num_batched_tokens)"
        )
    if left["zero_token_steps"]:
        notes.append(f"{_steps(left['zero_token_steps'])} of 0 tokens left out")
    return rows, keys, left, len(merged_groups(keys, split))


def merged_groups(keys, split) -> set:
    return {tuple(kv for kv in key if kv[0] != split) for key in keys}


def _from_gauge(scrapes, name: str, opts: Options, notes: list):
    rows: list[tuple[int, int, int, int]] = []  # (num_tokens, num_reqs, max_query_len, count)
    keys: set[tuple[tuple[str, str], ...]] = set()  # the series' labels
    q = opts.decode_query_len
    for sc in scrapes:
        samples = {s.labels: s for s in sc.samples.get(name, [])}
        if not samples:
            raise ScrapeError(f"{sc.source}: no {name} series; give scrapes of one engine")
        for key in select(list(samples), name, opts.labels, opts.merge, sc.source, notes=notes):
            s, keys = samples[key], keys | {key}
            r = _whole(s.value, sc.source, s.line, name)
            if r * q > MAX_TOKENS:
                raise ScrapeError(f"{sc.source}:{s.line}: {name} is {r}: more than any plan runs")
            if r:
                rows.append((r * q, r, q, 1))
    if not rows:
        raise ScrapeError(
            f"{scrapes[-1].source}: {name} is 0 in every scrape: the engine was idle; "
            "scrape it under load"
        )
    notes.append(
        f"decode steps sampled from the gauge {name}: one step of r requests per scrape and "
        "series (prefill steps are not seen); scrape often, under load"
    )
    return rows, sorted(keys), None, len(keys)


def workload_from_scrapes(scrapes: list[Scrape], opts: Options, sources=()) -> MetricsWorkload:
    """The workload the scrapes show (oldest first); see the module docstring."""
    engine = detect_engine(scrapes, opts.engine)
    spec = ENGINE_METRICS[engine]
    notes: list[str] = []
    got = None
    if spec.tokens:
        got = _from_histogram(scrapes, spec.tokens, spec.split, opts, notes)
        metric, kind = spec.tokens, "histogram"
    if got is None and spec.running and any(spec.running in sc.samples for sc in scrapes):
        if spec.tokens:
            notes.append(f"no {spec.tokens} histogram in {scrapes[-1].source}")
        got = _from_gauge(scrapes, spec.running, opts, notes)
        metric, kind = spec.running, "gauge"
    if got is None:
        need = " or ".join(n for n in (spec.tokens, spec.running) if n)
        raise ScrapeError(
            f"{scrapes[-1].source}: no {need} series; a {engine} workload needs it "
            "(scrape the engine's /metrics while it serves)"
        )
    rows, keys, left, merged = got
    notes[:] = list(dict.fromkeys(notes))  # a gauge's series are selected once per scrape
    total: dict[tuple, int] = {}
    for n, r, m, c in rows:
        total[(n, r, m)] = total.get((n, r, m), 0) + c
    rows = tuple((n, r, m, c) for (n, r, m), c in sorted(total.items()) if c)
    if not rows:
        raise ScrapeError(
            f"{scrapes[-1].source}: {metric} shows no steps "
            + ("between the first and last scrape" if len(scrapes) > 1 else "yet")
            + " (scrape the engine while it serves)"
        )
    header = {
        "version": HEADER_VERSION,
        "engine": engine,
        "metric": metric,
        "series": [dict(k) for k in keys[:16]],
        "merged": merged,
        "sources": list(sources) or [sc.source for sc in scrapes],
        "window": "sampled at each scrape"
        if kind == "gauge"
        else ("last scrape minus first" if len(scrapes) > 1 else "since the engine started"),
        "spread": opts.spread if kind == "histogram" else None,
        "decode_query_len": opts.decode_query_len,
        "max_num_seqs": opts.max_num_seqs,
        "max_tokens": opts.max_tokens,
        "steps": sum(r[3] for r in rows),
        "left_out": left,
        "notes": notes,
    }
    return MetricsWorkload(header=header, rows=rows, notes=tuple(notes))
