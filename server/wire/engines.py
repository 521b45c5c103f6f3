"""A front end's view of several engine processes (data parallelism, server/core/dp_serving.py):
the server's state from each engine's, where the next request goes, and /metrics of them all.

- State: failed as soon as any engine failed; ready once every engine is; stopped once every engine
  stopped (drained when every one drained); draining while any drains or has stopped.
- Routing: each request goes to the engine with the fewest of this front end's requests open on it
  (those it sent there and not yet done), ties in turn; it stays there (its cancel goes there).
  Each front end balances its own requests: with ``--api-server-count`` > 1 the engines' loads
  are the sum of the front ends' balanced shares.
- /metrics: every engine's series, each sample labelled ``engine="d"`` (one HELP and TYPE per
  family): sum them with ``sum without (engine)``."""

from __future__ import annotations

import re


def server_state(states: list[str]) -> str:
    """The server's state from its engines' (the module's docstring)."""
    if "failed" in states:
        return "failed"
    if all(s == "stopped" for s in states):
        return "stopped"
    if any(s in ("draining", "stopped") for s in states):
        return "draining"
    if "starting" in states:
        return "starting"
    return "ready"


class Router:
    """Where this front end's next request goes: the least loaded engine, ties in turn."""

    def __init__(self, engines: int):
        self.load = [0] * engines
        self.sent = [0] * engines
        self._next = 0

    def pick(self) -> int:
        n = len(self.load)
        least = min(self.load)
        for i in range(n):
            d = (self._next + i) % n
            if self.load[d] == least:
                self._next = (d + 1) % n
                self.load[d] += 1
                self.sent[d] += 1
                return d
        raise AssertionError("unreachable")

    def done(self, d: int) -> None:
        self.load[d] -= 1


_HEADER = re.compile(r"# (HELP|TYPE) (\S+)")


def merge_metrics(texts: list[str]) -> str:
    """Prometheus text from each engine as one exposition: a family's HELP and TYPE once, then
    its samples from every engine, labelled ``engine="d"``."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for d, text in enumerate(texts):
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if h := _HEADER.match(line):
                family = h.group(2)
                head = headers.setdefault(family, [])
                if d == 0 or not any(x.startswith(f"# {h.group(1)} ") for x in head):
                    head.append(line)
                samples.setdefault(family, [])
                continue
            if line.startswith("#"):
                continue
            samples.setdefault(family or line.split("{")[0].split()[0], []).append(
                _labelled(line, d)
            )
    out = []
    for family in dict.fromkeys([*headers, *samples]):
        out += headers.get(family, [])
        out += samples.get(family, [])
    return "\n".join(out) + "\n"


def _labelled(line: str, d: int) -> str:
    """A sample line with ``engine="d"`` first among its labels."""
    cut = min(i for i in (line.find("{"), line.find(" ")) if i >= 0)
    name, rest = line[:cut], line[cut:]
    if rest.startswith("{}"):
        return f'{name}{{engine="{d}"}}{rest[2:]}'
    if rest.startswith("{"):
        return f'{name}{{engine="{d}",{rest[1:]}'
    return f'{name}{{engine="{d}"}}{rest}'
