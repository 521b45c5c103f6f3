"""server/frontend/stop_strings.py: stop strings matched across token boundaries, never emitted; the same
text comes out whatever the split of the stream into increments (properties, hypothesis)."""

from hypothesis import given
from hypothesis import strategies as st

from graphplan.server.frontend.stop_strings import StopMatcher


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The rule, directly: the text ends where a stop string first ends (the longest, on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def stream(parts: list[str], stops: list[str]) -> tuple[str, StopMatcher, list[str]]:
    matcher = StopMatcher(stops)
    emitted = []
    for part in parts:
        emitted.append(matcher.feed(part))
        assert len(matcher.held) < max((len(s) for s in stops), default=1)
    rest, _ = matcher.finish()
    return "".join(emitted) + rest, matcher, emitted


def test_a_stop_string_split_over_tokens_is_never_emitted():
    matcher = StopMatcher(["</s>", "\n\n"])
    assert [matcher.feed(t) for t in ["Hi", " there<", "/", "s> more"]] == ["Hi", " there", "", ""]
    assert matcher.matched == "</s>" and matcher.finish() == ("", "stop")
    assert matcher.feed("after") == ""


def test_a_held_back_prefix_is_released_when_it_stops_being_one():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("go ST") == "go " and matcher.held == "ST"
    assert matcher.feed("ART") == "START" and matcher.held == ""
    assert matcher.feed("ST") == "" and matcher.finish() == ("ST", "length")


def test_the_finish_reason_is_stop_for_a_stop_string_or_token_and_length_otherwise():
    assert StopMatcher([]).finish(stop_token=True) == ("", "stop")
    assert StopMatcher(["x"]).finish() == ("", "length")


def test_the_earliest_ending_stop_wins_and_the_longest_on_a_tie():
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.feed("zabcd") == "za" and matcher.matched == "bc"
    matcher = StopMatcher(["c", "abc"])
    assert matcher.feed("xabc") == "x" and matcher.matched == "abc"


texts = st.text(alphabet="abc\n", max_size=40)
stop_lists = st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3)


@given(texts, stop_lists, st.lists(st.integers(0, 40), max_size=12))
def test_any_split_of_the_stream_gives_the_same_text_as_the_rule(text, stops, cuts):
    cuts = sorted({min(c, len(text)) for c in cuts})
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out, matcher, emitted = stream(parts, stops)
    want, stop = reference(text, stops)
    assert out == want and matcher.matched == stop
    assert out == stream([text], stops)[0] == stream(list(text), stops)[0]
    for i in range(1, len(emitted) + 1):  # nothing emitted so far ever contains a stop
        assert not any(s in "".join(emitted[:i]) for s in stops)


@given(texts, stop_lists)
def test_only_a_tail_that_could_start_a_stop_string_is_held_back(text, stops):
    matcher = StopMatcher(stops)
    matcher.feed(text)
    if matcher.matched is None:
        held = matcher.held
        assert not held or any(s.startswith(held) and s != held for s in stops)
        longer = text[len(text) - len(held) - 1 :] if len(held) < len(text) else None
        assert longer is None or not any(s.startswith(longer) for s in stops)
