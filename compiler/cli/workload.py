"""``plan workload``: a workload file for ``plan optimize`` / ``plan report --trace`` from an
engine's Prometheus scrapes (the rules: ``compiler/tools/metrics.py``, docs/workload.md).

Exit codes are the CLI's: 2 for a malformed scrape or one without the series a workload needs,
1 for a scrape that cannot be fetched or read and for bad options; nothing is written on failure.
"""

from __future__ import annotations

import json
import re

RULE = (
    "A step of n tokens counts as uniform decode (n/q requests of q = --decode-query-len tokens) "
    "when n is a multiple of q and n <= q * --max-num-seqs, else as one request of n tokens "
    "(graphplan's scrapes say which); a histogram bucket's steps are spread evenly over its whole "
    "token counts (--spread uniform) or put at its upper edge (--spread upper, the worst case)."
)


def _plan_limits(a, engine: str) -> tuple[dict, str | None]:
    """The seats, tokens (and, for graphplan's scrapes, q) of ``--plan``; flags given win."""
    if not a.plan:
        return {}, None
    from .inputs import load_any

    table, _ = load_any(a.plan, [])
    limits = {"max_num_seqs": table.max_num_seqs, "max_tokens": table.max_tokens}
    if engine == "graphplan":  # vLLM counts emitted tokens per step, not the q a step runs
        limits["decode_query_len"] = table.q
    given = {k: getattr(a, k) for k in limits if getattr(a, k) is not None}
    used = {k: v for k, v in limits.items() if k not in given}
    flag = {"max_num_seqs": "max_num_seqs", "max_tokens": "max_num_batched_tokens"}
    note = (
        f"from plan {a.plan}: "
        + ", ".join(f"{flag.get(k, k)}={v}" for k, v in used.items())
        + (f" (given flags win: {', '.join(k.replace('_', '-') for k in given)})" if given else "")
        if used
        else None
    )
    return used, note


def _options(a, from_plan: dict):
    from ..tools.metrics import MAX_TOKENS, Options
    from .inputs import UsageError

    def pick(key: str, default):  # the flag, else the plan's, else the default
        given = getattr(a, key)
        return given if given is not None else from_plan.get(key, default)

    labels = []
    for pair in a.label:
        k, eq, v = pair.partition("=")
        if not eq or not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", k):
            raise UsageError(f"plan workload: --label {pair[:80]!r}: expected NAME=VALUE")
        labels.append((k, v))
    q: int = pick("decode_query_len", 1)
    seqs: int = pick("max_num_seqs", 256)
    tokens: int | None = pick("max_tokens", None)
    for flag, value, hi in (
        ("--decode-query-len", q, 1024),
        ("--max-num-seqs", seqs, MAX_TOKENS),
        ("--max-tokens", tokens, MAX_TOKENS),
    ):
        if value is not None and not 1 <= value <= hi:
            raise UsageError(f"plan workload: {flag} {value}: give 1..{hi}")
    if not 0 < a.timeout <= 600:
        raise UsageError(f"plan workload: --timeout {a.timeout:g}: give 0 < seconds <= 600")
    return Options(
        engine=a.engine,
        labels=tuple(labels),
        merge=a.merge,
        spread=a.spread,
        decode_query_len=q,
        max_num_seqs=seqs,
        max_tokens=tokens,
    )


def cmd_workload(a) -> int:
    from ..tools import prom_text
    from ..tools.metrics import detect_engine, workload_from_scrapes
    from ..tools.trace_file import write_workload
    from .outputs import check_output

    files = [s for s in a.from_metrics if "://" not in s]
    check_output(a.output, files + ([a.plan] if a.plan else []))
    scrapes = [prom_text.read(src, a.timeout) for src in a.from_metrics]
    from_plan, plan_note = _plan_limits(a, detect_engine(scrapes, a.engine))
    opts = _options(a, from_plan)
    work = workload_from_scrapes(
        scrapes, opts, sources=[prom_text.display(s) for s in a.from_metrics]
    )
    if plan_note:
        work.header["plan"] = a.plan
        work.header["notes"].insert(0, plan_note)
    if a.output:
        write_workload(a.output, work.header, work.rows)
    h = work.header
    decode = sum(c for n, r, m, c in work.rows if m == opts.decode_query_len and n == m * r)
    if a.format == "json":
        print(
            json.dumps(
                {
                    "output": a.output,
                    "engine": h["engine"],
                    "metric": h["metric"],
                    "steps": work.steps,
                    "decode_steps": decode,
                    "rows": len(work.rows),
                    "header": h,
                },
                sort_keys=True,
            )
        )
        return 0
    series = ", ".join(
        "{" + ",".join(f'{k}="{v}"' for k, v in s.items()) + "}" for s in h["series"]
    )
    print(
        f"{h['engine']}: {h['metric']}{series if len(h['series']) == 1 else ''} in "
        f"{len(scrapes)} scrape(s) ({h['window']})"
        + (f"; {h['merged']} series added up" if h["merged"] > 1 else "")
    )
    print(
        f"{work.steps} steps: {decode} uniform decode, {work.steps - decode} mixed"
        + (f"; bucket counts spread: {h['spread']}" if h["spread"] else "")
    )
    for note in h["notes"]:
        print(f"note: {note}")
    if a.output:
        print(f"wrote {a.output} ({len(work.rows)} lines and a header)")
        print(f"next: plan optimize {a.plan or 'PLAN'} --trace {a.output} -o tuned.yaml")
    else:
        print("(no workload written; add -o workload.jsonl)")
    return 0


def add_workload_command(sub, common) -> None:
    sp = sub.add_parser(
        "workload",
        help="a workload file for plan optimize from an engine's Prometheus /metrics",
        description="Read Prometheus text scrapes of vLLM, SGLang or graphplan (files, or "
        "http(s):// URLs) and write the steps they show as a workload for plan optimize. "
        "Several scrapes of one run: the last minus the first. " + RULE,
    )
    sp.add_argument(
        "--from-metrics",
        nargs="+",
        required=True,
        metavar="SCRAPE",
        help="scrape files or http(s):// URLs of /metrics, oldest first",
    )
    sp.add_argument("-o", "--output", help="where to write workload.jsonl (atomically)")
    sp.add_argument(
        "--engine",
        choices=("vllm", "sglang", "graphplan"),
        help="the engine (default: the one whose series the scrape holds)",
    )
    sp.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="K=V",
        help="keep the series with this label (repeatable), e.g. --label engine=0",
    )
    sp.add_argument(
        "--merge",
        action="store_true",
        help="add up the series left even when they are of several models (the engines of "
        "one model are added up without it)",
    )
    sp.add_argument(
        "--plan",
        metavar="PLAN",
        help="the plan to tune (or its table.json): its max_num_seqs and max_num_batched_tokens "
        "(and, for graphplan's scrapes, decode_query_len) set --max-num-seqs, --max-tokens "
        "(and --decode-query-len) unless given",
    )
    sp.add_argument(
        "--spread",
        choices=("uniform", "upper"),
        default="uniform",
        help="a bucket's steps: evenly over its token counts (default; tune on this), or all at "
        "its upper edge (the worst case, to price a list with)",
    )
    sp.add_argument(
        "--decode-query-len",
        type=int,
        metavar="Q",
        help="tokens per request in a decode step (1 + speculative tokens; default 1, or the "
        "--plan's for graphplan's scrapes)",
    )
    sp.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="R",
        help="the engine's max running requests: steps of at most Q*R tokens count as decode "
        "(default: the --plan's, else 256)",
    )
    sp.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="the engine's max_num_batched_tokens: spreads steps above the largest bucket edge "
        "up to N and leaves out buckets above N (default: the --plan's; without one, steps above "
        "the largest edge are left out)",
    )
    sp.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to fetch each URL, in all (default 10)",
    )
    common(sp, sets=False)
    sp.set_defaults(fn=cmd_workload)
