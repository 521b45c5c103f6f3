"""Which engine and which series ``plan workload --from-metrics`` reads (the rules:
``compiler/tools/metrics.py``, docs/workload.md): the engine whose series the scrapes hold, and of
a histogram's or gauge's series those ``--label`` keeps, one of each set of replica ranks, and all
the engines of one model (a data-parallel deployment runs one plan); several models are refused.
Every message names the scrape it is about.
"""

from __future__ import annotations

from dataclasses import dataclass

from .prom_text import Scrape, ScrapeError, series_text

SHOWN = 8
MODEL_LABEL = "model_name"
"""The label vLLM and SGLang name the served model with: series of two models are two workloads."""
REPLICA_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
"""Labels of ranks inside one engine (SGLang): they report the same batches, so one is read."""


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    prefix: str
    tokens: str | None
    """Histogram of tokens per step."""
    running: str | None
    """Gauge of running requests (the decode batch)."""
    split: str | None = None
    """Label of ``tokens`` that tells decode steps from mixed ones."""


ENGINE_METRICS = {
    "vllm": EngineMetrics("vllm:", "vllm:iteration_tokens_total", "vllm:num_requests_running"),
    "sglang": EngineMetrics("sglang:", None, "sglang:num_running_reqs"),
    "graphplan": EngineMetrics("graphplan:", "graphplan:iteration_tokens", None, "routine"),
}


def _engines_in(scrape: Scrape) -> list[str]:
    return [
        e for e, m in ENGINE_METRICS.items() if any(n.startswith(m.prefix) for n in scrape.samples)
    ]


def detect_engine(scrapes: list[Scrape], engine: str | None = None) -> str:
    """The engine whose series the scrapes hold; every message names the scrape it is about."""
    found = [(sc.source, _engines_in(sc)) for sc in scrapes]
    if engine is not None:
        for src, engines in found:
            if engine not in engines:
                raise ScrapeError(
                    f"{src}: no {engine} series (no metric name starts with "
                    f"{ENGINE_METRICS[engine].prefix!r}); is this a scrape of {engine}?"
                )
        return engine
    for src, engines in found:
        if not engines:
            raise ScrapeError(
                f"{src}: no vLLM, SGLang or graphplan series (no metric name starts with vllm:, "
                "sglang: or graphplan:); scrape an engine's /metrics (SGLang needs "
                "--enable-metrics)"
            )
        if len(engines) > 1:
            raise ScrapeError(
                f"{src}: series of {' and '.join(engines)} in this one scrape; say which with "
                "--engine"
            )
    kinds = {engines[0] for _, engines in found}
    if len(kinds) > 1:
        shown = "; ".join(f"{src} holds {engines[0]} series" for src, engines in found)
        raise ScrapeError(
            f"{shown}: the scrapes of one workload come from one engine (give them separately)"
        )
    return found[0][1][0]


def select(
    keys, name: str, labels: tuple, merge: bool, source: str, split: str | None = None, notes=None
) -> list:
    """The series to read: those ``--label`` keeps, one of each set of replicas (series apart
    only in ``REPLICA_LABELS``), all engines of one model (added up, with a note); series of
    several models are refused unless ``--merge``."""
    known = {k for key in keys for k, _ in key}
    for k, _ in labels:
        if k not in known:
            raise ScrapeError(
                f"{source}: --label {k}=...: no {name} series has a label {k!r} (its labels: "
                f"{', '.join(sorted(known)) or 'none'})"
            )
    kept = [key for key in keys if all(dict(key).get(k) == v for k, v in labels)]
    if not kept:
        every = "; ".join(series_text(name, k) for k in sorted(keys)[:SHOWN])
        raise ScrapeError(f"{source}: no {name} series has every --label given; there are: {every}")
    kept, replicas = _one_replica(sorted(kept))
    groups = sorted({tuple(kv for kv in key if kv[0] != split) for key in kept})
    models = sorted({dict(g).get(MODEL_LABEL) for g in groups}, key=str)
    if len(models) > 1 and not merge:
        shown = ", ".join(repr(m) for m in models[:SHOWN]) + (
            ", ..." if len(models) > SHOWN else ""
        )
        raise ScrapeError(
            f"{source}: {name} series of {len(models)} models: {shown}; a workload is one "
            f"model's: keep one with --label {MODEL_LABEL}=NAME (or add them up with --merge)"
        )
    if notes is not None and replicas:
        notes.append(
            f"{len(replicas)} {name} series left out as replicas of another "
            f"({', '.join(REPLICA_LABELS)} differ only: the ranks of one engine report the same "
            f"batches): {'; '.join(series_text(name, r) for r in replicas[:SHOWN])}"
        )
    if notes is not None and len(groups) > 1 and not merge:
        differ = sorted(
            {k for g in groups for k, v in g if any(dict(h).get(k) != v for h in groups)}
        )
        shown = "; ".join(series_text(name, g) for g in groups[:SHOWN])
        notes.append(
            f"{len(groups)} {name} series of one model added up (they differ in "
            f"{', '.join(differ)}: the data-parallel engines of one deployment run one plan): "
            f"{shown}" + ("; ..." if len(groups) > SHOWN else "") + "; --label k=v keeps one"
        )
    return kept


def _one_replica(keys: list) -> tuple[list, list]:
    """(kept, left out): of series that differ only in ``REPLICA_LABELS`` the lowest ranks."""
    kept: dict[tuple, tuple] = {}
    out = []
    rank = lambda key: tuple(int(v) if v.isdigit() else 0 for k, v in key if k in REPLICA_LABELS)
    for key in sorted(keys, key=rank):
        base = tuple(kv for kv in key if kv[0] not in REPLICA_LABELS)
        if base in kept:
            out.append(key)
        else:
            kept[base] = key
    return sorted(kept.values()), out
