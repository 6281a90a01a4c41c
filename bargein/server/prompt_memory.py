"""PromptMemory: recent (rendered prompt + answer text) -> exact token ids, bounded.

Every answer the server produces (finished, or cancelled by id, disconnect, deadline or
shutdown) is remembered with the token ids it really had: the prompt's ids and the
delivered answer's. A later request whose rendered prompt starts with such a text
reuses those ids (see ``bargein.engine.continuation``), so the engine's prefix cache hits
on the whole previous prompt and the partial answer, never missing on re-tokenization.

Bounded in entries and in total tokens, least recently used first out. Owned by the
event loop thread (no locks): the expensive parts (decoding, matching) run in the
tokenizer pool on a snapshot from ``candidates``.
"""

from __future__ import annotations

from collections import OrderedDict

from bargein.engine.continuation import KnownText


class PromptMemory:
    def __init__(self, max_entries: int, max_tokens: int):
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, KnownText] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def remember(self, item: KnownText) -> None:
        """Keeps ``item`` (most recent); drops the oldest entries beyond the bounds."""
        if self.max_entries == 0 or item.num_tokens > self.max_tokens:
            return
        old = self._entries.pop(item.text, None)
        if old is not None:
            self._tokens -= old.num_tokens
        self._entries[item.text] = item
        self._tokens += item.num_tokens
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= dropped.num_tokens

    def snapshot(self) -> list[KnownText]:
        """The entries now, for matching in the tokenizer pool (entries are immutable)."""
        return list(self._entries.values())

    def candidates(self, text: str) -> list[KnownText]:
        """Entries whose prompt ``text`` starts with: the only ones a continuation can reuse."""
        return [item for item in self._entries.values() if text.startswith(item.prefix_text)]

    def touch(self, item: KnownText) -> None:
        """Marks an entry as just used, so it is the last to be dropped."""
        if item.text in self._entries:
            self._entries.move_to_end(item.text)
