"""Tokens to text as they arrive: incremental detokenization that cuts the text at a stop string.

Text is released only when it can no longer change: not while the last token ends in the middle of
a UTF-8 character (the decoder shows U+FFFD there), and not while the end of the text could be the
start of a stop string. Decoding reads a short window of recent tokens, not the whole answer, so a
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
        if self.stops and not self.stopped:
            # a stop string may start up to (longest stop - 1) characters before the unsent text
            start = max(0, self.sent - max(map(len, self.stops)) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                del self.owners[len(self.text) :]
                self.stopped = True
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._held_back()
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

    def _held_back(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
