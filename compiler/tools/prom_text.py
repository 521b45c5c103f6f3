"""Prometheus text exposition (format 0.0.4, what vLLM, SGLang and graphplan serve at /metrics):
read from a file or an ``http(s)://`` URL, parsed strictly and within bounds.

A scrape is untrusted input. Reading is bounded (``MAX_SCRAPE_BYTES`` in all, ``MAX_LINE_BYTES``
a line, ``MAX_SAMPLES`` samples, ``MAX_LABELS`` labels a sample; a URL gets ``timeout`` seconds in
all and is never followed to another host or scheme); parsing is linear in the input (no regular
expression can backtrack over a line). A malformed line, a duplicated series or a family typed
twice is a ``ScrapeError`` (exit code 2) naming the line, as Prometheus itself refuses the
scrape; a scrape that cannot be fetched is a ``FetchError`` (exit code 1).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import GraphplanError

MAX_SCRAPE_BYTES = 16 << 20
MAX_LINE_BYTES = 64 << 10
MAX_SAMPLES = 200_000
MAX_LABELS = 64
TYPES = ("counter", "gauge", "histogram", "summary", "untyped", "unknown", "info", "stateset")
SHAPE = 'NAME{LABEL="VALUE",...} VALUE [TIMESTAMP]'

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,?)')
_END = re.compile(r"[ \t]*\}")
NUMBER = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|Inf|inf|NaN|nan)")
"""A sample value or bucket edge as the text format spells it (Go's ParseFloat without hex)."""
_TIMESTAMP = re.compile(r"-?[0-9]{1,19}")
_UNESCAPE = re.compile(r"\\(.)")


class ScrapeError(GraphplanError):
    """A scrape is malformed, or lacks what a workload needs."""

    exit_code = 2


class FetchError(GraphplanError):
    """A scrape cannot be read from its file or URL."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    """Sorted (name, value) pairs."""
    value: float
    line: int


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Scrape:
    source: str
    samples: dict
    """sample name -> [Sample, ...] in file order."""
    types: dict
    """family name -> (type, line) from ``# TYPE`` lines."""

    def names(self) -> list[str]:
        return list(self.samples)


def _fail(source: str, line: int, what: str, hint: str = "") -> ScrapeError:
    return ScrapeError(f"{source}:{line}: {what}" + (f" ({hint})" if hint else ""))


def _comment(text: str, source: str, i: int, types: dict) -> None:
    parts = text[1:].split(None, 2)
    if len(parts) < 2 or parts[0] != "TYPE":
        return  # HELP, EOF and free comments carry nothing a workload needs
    name, kind = parts[1], parts[2].strip() if len(parts) > 2 else ""
    if not _NAME.fullmatch(name) or kind not in TYPES:
        raise _fail(source, i, f"bad TYPE line {text[:120]!r}", f"# TYPE NAME {'|'.join(TYPES)}")
    if name in types:
        raise _fail(source, i, f"{name} is typed twice (first on line {types[name][1]})")
    types[name] = (kind, i)


def _sample(text: str, source: str, i: int) -> tuple[str, tuple, float]:
    m = _NAME.match(text)
    if not m:
        raise _fail(source, i, f"expected a metric name at {text[:60]!r}", SHAPE)
    name, pos, labels = m.group(), m.end(), {}
    if text.startswith("{", pos) or text[pos:].lstrip(" \t").startswith("{"):
        pos = text.index("{", pos) + 1
        while True:
            end = _END.match(text, pos)
            if end:
                pos = end.end()
                break
            lab = _LABEL.match(text, pos)
            if not lab:
                raise _fail(source, i, f"bad label at column {pos + 1} of {name}", SHAPE)
            key = lab.group(1)
            if key in labels:
                raise _fail(source, i, f"label {key!r} given twice in {name}")
            labels[key] = _UNESCAPE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), lab[2])
            if len(labels) > MAX_LABELS:
                raise _fail(source, i, f"more than {MAX_LABELS} labels in {name}")
            pos = lab.end()
            if not lab.group(3) and not _END.match(text, pos):
                raise _fail(source, i, f"expected ',' or '}}' at column {pos + 1} of {name}", SHAPE)
    rest = text[pos:]
    if "#" in rest:  # an OpenMetrics exemplar: "value # {labels} value"
        rest = rest[: rest.index("#")]
    fields = rest.split()
    if not rest[:1].isspace() or not 1 <= len(fields) <= 2:
        raise _fail(source, i, f"expected a value after {name}", SHAPE)
    if not NUMBER.fullmatch(fields[0]):
        raise _fail(source, i, f"{name}: {fields[0][:40]!r} is not a number", SHAPE)
    if len(fields) == 2 and not _TIMESTAMP.fullmatch(fields[1]):
        raise _fail(source, i, f"{name}: timestamp {fields[1][:40]!r} is not an integer", SHAPE)
    return name, tuple(sorted(labels.items())), float(fields[0])


def parse(raw: bytes, source: str) -> Scrape:
    """Every sample of a text-format scrape, by name; see the module docstring for the rules."""
    if len(raw) > MAX_SCRAPE_BYTES:
        raise ScrapeError(f"{source}: {len(raw)} bytes; a scrape is at most {MAX_SCRAPE_BYTES}")
    samples: dict[str, list[Sample]] = {}
    types: dict[str, tuple[str, int]] = {}
    seen: dict[tuple, int] = {}
    for i, line in enumerate(raw.split(b"\n"), 1):
        if len(line) > MAX_LINE_BYTES:
            raise _fail(source, i, f"line of {len(line)} bytes; at most {MAX_LINE_BYTES}")
        try:
            text = line.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            raise _fail(source, i, "not UTF-8", "a scrape is UTF-8 text") from None
        stripped = text.strip(" \t")
        if not stripped:
            continue
        if stripped.startswith("#"):
            _comment(stripped, source, i, types)
            continue
        name, labels, value = _sample(stripped, source, i)
        key = (name, labels)
        if key in seen:
            raise _fail(source, i, f"{series_text(name, labels)} repeats line {seen[key]}")
        seen[key] = i
        if len(seen) > MAX_SAMPLES:
            raise _fail(source, i, f"more than {MAX_SAMPLES} samples in one scrape")
        samples.setdefault(name, []).append(Sample(name, labels, value, i))
    return Scrape(source=source, samples=samples, types=types)


def series_text(name: str, labels, skip=()) -> str:
    """``name{k="v",...}`` as a scrape spells it (for messages), at most 200 characters."""
    lab = ",".join(f'{k}="{v}"' for k, v in labels if k not in skip)
    return (f"{name}{{{lab}}}" if lab else name)[:200]


def display(src: str) -> str:
    """A source as messages and headers show it: a URL without its user:password part."""
    if "://" in src and "@" in src.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = src.split("://", 1)
        host, _, path = rest.partition("/")
        return f"{scheme}://{host.rsplit('@', 1)[1]}" + (f"/{path}" if path else "")
    return src


def fetch(url: str, timeout: float = 10.0, limit: int = MAX_SCRAPE_BYTES) -> bytes:
    """The body of ``url`` (http or https): at most ``limit`` bytes within ``timeout`` seconds in
    all, redirects followed on the same scheme, host and port only, no compression."""
    import http.client
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    shown = display(url)
    try:
        first = urlsplit(url)
        origin = (first.scheme, first.hostname, first.port)
    except ValueError as e:
        raise FetchError(f"{shown}: not a URL ({e})") from None
    if first.scheme not in ("http", "https") or not first.hostname:
        raise FetchError(f"{shown}: only http:// and https:// URLs are scraped")

    class SameHost(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            new = urlsplit(newurl)
            if (new.scheme, new.hostname, new.port) != origin:
                raise FetchError(
                    f"{shown}: redirected ({code}) to {display(newurl)[:200]}, another host or "
                    "scheme; not followed (scrape that URL directly if you trust it)"
                )
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    headers = {
        "Accept": "text/plain;version=0.0.4",
        "Accept-Encoding": "identity",
        "User-Agent": "graphplan",
    }
    if first.username is not None:  # user:password@host: basic auth, kept off the URL
        import base64
        from urllib.parse import unquote

        pair = f"{unquote(first.username)}:{unquote(first.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        url = shown
    opener = urllib.request.build_opener(SameHost)
    request = urllib.request.Request(url, headers=headers)
    deadline = time.monotonic() + timeout
    try:
        with opener.open(request, timeout=timeout) as resp:
            encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise FetchError(f"{shown}: the response is {encoding}-compressed; not read")
            chunks, size = [], 0
            while size <= limit:
                if time.monotonic() > deadline:
                    raise FetchError(f"{shown}: not read in {timeout:g} s (--timeout)")
                chunk = resp.read(min(1 << 16, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except urllib.error.HTTPError as e:
        raise FetchError(f"{shown}: HTTP {e.code} {str(e.reason)[:100]}") from None
    except urllib.error.URLError as e:
        raise FetchError(f"{shown}: cannot fetch ({str(e.reason)[:200]})") from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise FetchError(f"{shown}: cannot fetch ({type(e).__name__}: {str(e)[:200]})") from None
    if size > limit:
        raise FetchError(f"{shown}: more than {limit} bytes; a scrape is at most {limit}")
    return b"".join(chunks)


def read(src: str, timeout: float = 10.0) -> Scrape:
    """A scrape from a file or an ``http(s)://`` URL."""
    if src.startswith(("http://", "https://")):
        return parse(fetch(src, timeout), display(src))
    if "://" in src:
        raise FetchError(f"{display(src)}: only files and http:// or https:// URLs are read")
    from ..limits import read_regular_file  # regular files only, size first

    raw = read_regular_file(
        Path(src),
        MAX_SCRAPE_BYTES,
        "scrape",
        "give a file saved from /metrics (curl -s http://HOST:PORT/metrics > scrape.txt)",
        error=ScrapeError,
    )
    return parse(raw, src)
