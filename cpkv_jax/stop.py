"""A request's output text, decoded as its tokens arrive, and its stop strings: one implementation for
Engine.generate, Engine.stream, the CLI and the server.

Decoding is incremental: each token re-decodes a short window (the tokens of the previous new text
and those after it: the window starts at a token boundary with text before it, so the decoder sees the
context a full decode would), never the whole output. Text that ends inside an incomplete UTF-8
sequence waits for the next token; a token that adds no text (a skipped special token) leaves the
window as it was. Stop strings are looked for in the new text plus the tail before it (one character
shorter than the longest stop string), so a stop string split over tokens is found.
"""

from __future__ import annotations

from typing import Callable, Sequence


class StopMatcher:
    """The text of one request's tokens so far, cut before the first of `stops`. `append` takes the
    next token (True once a stop string has matched: the request should end); `emit` returns the text
    that is decided since the last call: a tail as long as the longest stop string minus one character
    is held back while it could still become the start of one."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode = decode
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False
        self._window: list[int] = []   # the tokens decoded again with each new one
        self._read = 0                  # how many of them are already in self.text
        self._sent = 0                  # characters of the text already emitted

    def append(self, token_id: int) -> bool:
        if self.stopped:
            return True
        self.tokens.append(int(token_id))
        window = self._window + [int(token_id)]
        before = self.decode(window[:self._read])
        now = self.decode(window)
        if now.endswith("\ufffd"):          # a character still incomplete: wait for its next bytes
            self._window = window
            return False
        if len(now) <= len(before):          # no text from this token
            return False
        checked = len(self.text)
        self.text += now[len(before):]
        self._window = window[self._read:]
        self._read = len(self._window)
        if self.stops:
            start = max(0, checked - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
        return self.stopped

    def final_text(self) -> str:
        """The finished request's text: cut before the stop string, else the decode of every token
        (an incomplete character at the end included, as a full decode gives it)."""
        return self.text if self.stopped else self.decode(self.tokens)

    def emit(self, final: bool) -> str:
        if final:
            text = self.final_text()
            end = len(text)
        else:
            text = self.text
            end = len(text) if self.stopped else len(text) - self.hold
        if end <= self._sent:
            return ""
        out, self._sent = text[self._sent:end], end
        return out
