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


def _options(a):
    from ..tools.metrics import MAX_TOKENS, Options
    from .inputs import UsageError

    labels = []
    for pair in a.label:
        k, eq, v = pair.partition("=")
        if not eq or not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", k):
            raise UsageError(f"plan workload: --label {pair[:80]!r}: expected NAME=VALUE")
        labels.append((k, v))
    for flag, value, hi in (
        ("--decode-query-len", a.decode_query_len, 1024),
        ("--max-num-seqs", a.max_num_seqs, MAX_TOKENS),
        ("--max-tokens", a.max_tokens, MAX_TOKENS),
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
        decode_query_len=a.decode_query_len,
        max_num_seqs=a.max_num_seqs,
        max_tokens=a.max_tokens,
    )


def cmd_workload(a) -> int:
    from ..tools import prom_text
    from ..tools.metrics import workload_from_scrapes
    from ..tools.trace_file import write_workload
    from .outputs import check_output

    files = [s for s in a.from_metrics if "://" not in s]
    check_output(a.output, files)
    opts = _options(a)
    scrapes = [prom_text.read(src, a.timeout) for src in a.from_metrics]
    work = workload_from_scrapes(
        scrapes, opts, sources=[prom_text.display(s) for s in a.from_metrics]
    )
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
        + (f"; {h['merged']} series pooled (--merge)" if h["merged"] > 1 else "")
    )
    print(
        f"{work.steps} steps: {decode} uniform decode, {work.steps - decode} mixed"
        + (f"; bucket counts spread: {h['spread']}" if h["spread"] else "")
    )
    for note in work.notes:
        print(f"note: {note}")
    if a.output:
        print(f"wrote {a.output} ({len(work.rows)} lines and a header)")
        print(f"next: plan optimize PLAN --trace {a.output} -o tuned.yaml")
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
        help="add up the series left (e.g. the engines of one deployment) instead of refusing",
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
        default=1,
        metavar="Q",
        help="tokens per request in a decode step (1 + speculative tokens; default 1)",
    )
    sp.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        metavar="R",
        help="the engine's max running requests: steps of at most Q*R tokens count as decode "
        "(default 256)",
    )
    sp.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="the engine's max_num_batched_tokens: spreads steps above the largest bucket edge "
        "up to N (default: they are left out)",
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
