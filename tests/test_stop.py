"""cpkv_jax/stop.py: the incremental decode and stop strings, against full decodes of every prefix (the
tiny model's byte-level tokenizer, whose tokens split UTF-8 characters)."""

import numpy as np
import pytest

from cpkv_jax.engine import _load_tokenizer
from cpkv_jax.stop import StopMatcher


@pytest.fixture(scope="module")
def decode():
    tok = _load_tokenizer("tiny")
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def sequences(decode, count=40, length=200):
    """Random token ids, and runs of whole words (merged tokens and multi-byte characters)."""
    rng = np.random.default_rng(0)
    tok = _load_tokenizer("tiny")
    out = [rng.integers(0, 512, length).tolist() for _ in range(count)]
    out += [tok.encode(t, add_special_tokens=False).ids for t in ("Grüße aus Köln, 東京 und São Paulo — ok?",
                                                                   "the end of the story, the end.")]
    return out


def feed(matcher, ids):
    """Append tokens one by one; returns (text emitted per token, index of the token that stopped it)."""
    pieces, stopped_at = [], None
    for i, t in enumerate(ids):
        if matcher.append(t) and stopped_at is None:
            stopped_at = i
        last = stopped_at is not None or i == len(ids) - 1
        pieces.append(matcher.emit(final=last))
        if stopped_at is not None:
            break
    return pieces, stopped_at


def test_incremental_text_equals_the_full_decode(decode):
    """Without stop strings the emitted pieces concatenate to the full decode, and the text after each
    token is a prefix of the decode of the tokens so far; the decode window stays short."""
    for ids in sequences(decode):
        widths = []
        m = StopMatcher(lambda t: widths.append(len(t)) or decode(t))
        pieces, stopped_at = feed(m, ids)
        assert stopped_at is None and "".join(pieces) == decode(ids)
        assert sum(widths[:-1]) <= 16 * len(ids), widths   # while appending: windows, never the whole output
        for k in range(1, len(ids)):
            assert decode(ids[:k]).startswith("".join(pieces[:k]))


def test_stop_strings_cut_at_the_first_match_across_tokens(decode):
    """A stop string (taken from the full text, often spanning tokens) ends the text just before its
    first occurrence, at the first token whose prefix decode contains it; nothing after it is emitted."""
    rng = np.random.default_rng(1)
    checked = 0
    for ids in sequences(decode):
        full = decode(ids)
        starts = [a for a in range(2, len(full) - 4) if "\ufffd" not in full[a:a + 4]]
        if not starts:
            continue
        a = int(rng.choice(starts))
        stop = full[a:a + int(rng.integers(2, 5))]
        other = "\x00never"
        m = StopMatcher(decode, [other, stop])
        pieces, stopped_at = feed(m, ids)
        first = next(k for k in range(1, len(ids) + 1) if stop in decode(ids[:k]))
        assert stopped_at == first - 1
        assert "".join(pieces) == m.final_text() == full[:full.find(stop)]
        checked += 1
    assert checked > 20


def test_a_possible_stop_prefix_is_held_back():
    """Text that could still become a stop string is not emitted until decided."""
    m = StopMatcher(lambda ids: "".join(chr(i) for i in ids), ["END"])
    out = [m.emit(final=False) for _ in [m.append(ord(c)) for c in "abEN"]]
    assert "".join(out) == "ab"                      # "EN" may begin "END"
    for c in "xyEN":
        m.append(ord(c))
        out.append(m.emit(final=False))
    assert "".join(out) == "abENxy"
    assert m.append(ord("D")) and m.emit(final=True) == "" and m.final_text() == "abENxy"
