"""Tokens to text as they arrive: incremental detokenization that cuts the text at a stop string.

Text is released only when it can no longer change: not while the last token ends in the middle of
a UTF-8 character (the decoder shows U+FFFD there), and not while the end of the text could be the
start of a stop string (stop strings are matched incrementally, each character once: see
StopMatcher). Decoding reads a short window of recent tokens, not the whole answer, so a
long answer costs O(tokens), and the window starts a few tokens early because some decoders
(SentencePiece) drop a token's leading space when it comes first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CONTEXT_TOKENS = 4  # tokens decoded before the new ones, as context for the decoder
REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self._matchers = [StopMatcher(s) for s in self.stops]
        self._fed = 0  # characters of self.text the stop matchers have seen
        self.ids: list[int] = []
        self.text = ""  # settled text (complete characters), stop string not yet cut
        self.sent = 0  # characters of self.text already handed out
        self._start = 0  # first token of the decode window
        self._read = 0  # tokens whose text is already in self.text
        self.stopped = False  # a stop string was found; self.text ends just before it
        self.owners: list[int] = []  # per character of self.text: the index of the token that wrote it

    @property
    def tokens(self) -> int:
        """Tokens consumed: all of them, or those up to the one that completed the stop string."""
        return len(self.ids)

    def add(self, token: int) -> str:
        """Take one token; return the text that became final (cut at a stop string, once found)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        before = self.decode(self.ids[self._start : self._read])
        window = self.decode(self.ids[self._start :])
        if window.endswith(REPLACEMENT) or len(window) <= len(before):
            return ""  # an unfinished character (or a token without text): wait for the next token
        self._append(window[len(before) :])
        self._start = max(0, len(self.ids) - CONTEXT_TOKENS)
        self._read = len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of the answer (a dangling partial character included)."""
        if not self.stopped and self._read < len(self.ids):
            before = self.decode(self.ids[self._start : self._read])
            self._append(self.decode(self.ids[self._start :])[len(before) :])
            self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._matchers and not self.stopped:
            new, self._fed = self.text[self._fed :], len(self.text)
            hits = [i for i in (m.feed(new, self._fed) for m in self._matchers) if i is not None]
            if hits:
                self.text = self.text[: min(hits)]
                del self.owners[len(self.text) :]
                self.stopped = True
        end = len(self.text)
        if not (final or self.stopped):
            end -= max((m.state for m in self._matchers), default=0)  # could begin a stop string
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _append(self, piece: str) -> None:
        self.text += piece
        self.owners.extend([len(self.ids) - 1] * len(piece))

    def pieces(self, start: int, end: int) -> list[tuple[str, int]]:
        """text[start:end] split where the token that wrote it changes: [(text, token index)]."""
        out = []
        for i in range(start, min(end, len(self.text))):
            if out and out[-1][1] == self.owners[i]:
                out[-1][0] += self.text[i]
            else:
                out.append([self.text[i], self.owners[i]])
        return [(text, owner) for text, owner in out]


class StopMatcher:
    """Knuth-Morris-Pratt over the text as it grows: each character is looked at once per stop string, so
    a token costs O(its characters), however long the answer or the stop strings.

    `state` is the length of the longest end of the text fed so far that begins the stop string: those
    characters are held back, since the next token may complete it."""

    def __init__(self, stop: str):
        self.stop, self.state = stop, 0
        self.fail = [0] * len(stop)  # fail[i]: longest proper border of stop[: i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, new: str, end: int) -> int | None:
        """Take the text's next characters (the text is `end` long after them); where the first
        occurrence of the stop string in them starts, or None."""
        stop, fail, q = self.stop, self.fail, self.state
        for j, c in enumerate(new):
            while q and c != stop[q]:
                q = fail[q - 1]
            if c == stop[q]:
                q += 1
            if q == len(stop):
                self.state = 0
                return end - len(new) + j + 1 - len(stop)
        self.state = q
        return None
