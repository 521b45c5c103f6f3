"""Stop strings over streamed text: which text a request may emit now, matched across token
boundaries, so that no part of a stop string ever reaches the client. Pure Python.

    matcher = StopMatcher(params.stop)
    for delta in detokenized_increments:  # the text each new token adds
        send(matcher.feed(delta))
        if matcher.matched is not None:
            break                          # abort the request: its text is complete
    rest, finish_reason = matcher.finish(stop_token=last_token_was_eos_or_a_stop_id)
    send(rest)

The rule, the same whatever the split of the text into increments: the text ends at the first
place where a stop string ends (the longest one, when several end there), and what is emitted is
the text before that stop string starts. Until it is known whether a tail of the text begins a stop
string, that tail is held back (never longer than the longest stop string minus one character).
"""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    __slots__ = ("stops", "matched", "_held")

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in dict.fromkeys(stops) if s)
        self.matched: str | None = None
        """The stop string that ended the text, once one has."""
        self._held = ""

    @property
    def held(self) -> str:
        """Text received but not emitted yet: it may be the start of a stop string."""
        return self._held

    def feed(self, text: str) -> str:
        """Take the text of the next token(s); return what can be emitted now ("" once stopped)."""
        if self.matched is not None:
            return ""
        buf = self._held + text
        first = None  # (end, -length) of the earliest-ending match, longest first on a tie
        for s in self.stops:
            i = buf.find(s)  # a stop's earliest start is also its earliest end
            if i >= 0 and (first is None or (i + len(s), -len(s)) < first[0]):
                first = ((i + len(s), -len(s)), s)
        if first is not None:
            (end, minus_len), self.matched = first
            self._held = ""
            return buf[: end + minus_len]
        keep = self._prefix_tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self, *, stop_token: bool = False) -> tuple[str, str]:
        """End of generation: the text still held back (none after a stop string) and the
        OpenAI ``finish_reason``: "stop" for a stop string or a stop token (EOS, a stop token id),
        "length" otherwise (max_tokens or the context ran out)."""
        rest, self._held = ("" if self.matched is not None else self._held), ""
        return rest, ("stop" if self.matched is not None or stop_token else "length")

    def _prefix_tail(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
