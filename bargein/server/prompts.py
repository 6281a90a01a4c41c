"""Prompts from request bodies: size checks, chat rendering, tokenizing, continuation.

Everything here that grows with the input (rendering the chat template, tokenizing,
matching remembered answers, decoding an answer to remember it) runs in the tokenizer
pool, never on the event loop, so a large input cannot delay another request's tokens or
a cancel. Before that, an input is refused by its byte length alone when it cannot fit
the context whatever its tokens (a token covers at most ``max_token_bytes`` bytes).

Chat prompts go through :func:`bargein.engine.continuation.continue_text` with the
server's :class:`PromptMemory`: a history that repeats an earlier answer of this server
reuses that answer's exact token ids. Message content is tokenized as what the user wrote
(``chat_text``): only the chat template's own text becomes control tokens. A raw
``/v1/completions`` prompt is the caller's own text and keeps its control tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from bargein.engine.continuation import Continuation, KnownText, continue_text
from bargein.engine.request import RequestOutput
from bargein.loader import ChatTemplateError
from bargein.server.chat_text import render_chat
from bargein.server.errors import APIError
from bargein.server.prompt_memory import PromptMemory

T = TypeVar("T")


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered template
    token_ids: list[int]
    reused: int  # leading ids taken from a remembered answer


def max_token_bytes(tokenizer: Any) -> int:
    """The most bytes one token stands for (special tokens as their text)."""
    known = getattr(tokenizer, "max_piece_bytes", None)  # bargein's Tokenizer knows it from its vocabulary
    if isinstance(known, int):
        return known
    return max((len(tokenizer.token_bytes(t, skip_special_tokens=False)) for t in range(tokenizer.vocab_size)),
               default=1) or 1


class PromptBuilder:
    """Renders and tokenizes prompts in ``pool``; remembers answers in ``memory``.

    All methods are called on the event loop; the work they do runs in the pool.
    """

    def __init__(self, tokenizer: Any, pool: Executor, memory: PromptMemory, *, max_model_len: int,
                 eos_token_ids: frozenset[int], token_bytes_bound: int):
        self.tokenizer = tokenizer
        self.pool = pool
        self.memory = memory
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_input_bytes = max_model_len * token_bytes_bound
        self._remembering: set[asyncio.Future] = set()  # answers being decoded for the memory

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def check_bytes(self, texts: Sequence[str], param: str) -> None:
        """A 400 before any tokenizing for input that cannot fit the context by size alone."""
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > self.max_input_bytes:
            raise APIError(400, f"{param} is {size} bytes: more than this model's context of {self.max_model_len} "
                                f"tokens can hold whatever its tokens (at most {self.max_input_bytes} bytes); "
                                "shorten it", param=param, code="context_length_exceeded")

    async def chat(self, messages: list[dict[str, Any]], tools: Any = None, *, param: str = "messages",
                   more_known: Callable[[], Sequence[KnownText]] | None = None,
                   template_kwargs: dict[str, Any] | None = None, continue_final: bool = False) -> ChatPrompt:
        """The rendered chat prompt's token ids, token-exact over remembered answers.

        ``template_kwargs`` are the template's own variables (``enable_thinking``);
        ``continue_final``: the answer continues the last (assistant) message's text.

        ``more_known`` (called in the pool) adds pairs to those in memory: a
        ``previous_response_id``'s, which must work even once memory has dropped it.
        """
        self.check_bytes([m.get("content") or "" for m in messages], param)
        if self._remembering:  # answers that finished before this request are matchable
            await asyncio.wait(set(self._remembering))
        snapshot = self.memory.snapshot()

        def work() -> tuple[str, Continuation]:
            try:
                rendered = render_chat(self.tokenizer, messages, tools, param, template_kwargs,
                                       continue_final=continue_final)
            except ChatTemplateError as exc:
                raise APIError(400, f"the chat template could not render the messages: {exc}",
                               param=param) from None
            text = rendered.text
            known = [*snapshot, *(more_known() if more_known is not None else ())]
            candidates = [k for k in known if text.startswith(k.prefix_text)]
            return text, continue_text(text, candidates, encode=rendered.encoder(self.tokenizer), decode=self._decode)

        text, cont = await self.run(work)
        if cont.source is not None:
            self.memory.touch(cont.source)
        check_prompt_length(len(cont.token_ids), self.max_model_len, param)
        return ChatPrompt(text, cont.token_ids, cont.reused)

    async def completion(self, prompt: Any, vocab_size: int) -> list[list[int]]:
        """Token lists for ``prompt``: a string, strings, token ids, or lists of token ids."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        for item in items:
            if isinstance(item, str):
                self.check_bytes([item], "prompt")
            elif len(item) >= self.max_model_len:
                check_prompt_length(len(item), self.max_model_len, "prompt")
        prompts = await self.run(lambda: [self.tokenizer.encode(i) if isinstance(i, str) else list(i) for i in items])
        for tokens in prompts:
            bad = [t for t in tokens if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                               param="prompt", code="invalid_value")
            check_prompt_length(len(tokens), self.max_model_len, "prompt")
        return prompts

    async def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return await self.run(lambda: self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def strip_eos(self, ids: Sequence[int]) -> list[int]:
        """An answer without its end-of-turn token(s), which the template writes back itself."""
        answer = list(ids)
        while answer and answer[-1] in self.eos_token_ids:
            answer.pop()
        return answer

    def remember(self, prompt_text: str, out: RequestOutput) -> None:
        """Remembers a finished output's exact ids under ``prompt_text`` + its answer's text."""
        prompt_ids = tuple(out.prompt_token_ids)
        answer = self.strip_eos(out.token_ids)
        if not prompt_ids:
            return

        def work() -> KnownText:
            return KnownText(prompt_text, prompt_ids, tuple(answer), prompt_text + self._decode(answer))

        try:
            future = asyncio.get_running_loop().run_in_executor(self.pool, work)
        except RuntimeError:  # the pool was shut down: a late final during shutdown has no one to serve
            return
        self._remembering.add(future)

        def done(f: asyncio.Future) -> None:
            self._remembering.discard(f)
            if not f.cancelled() and f.exception() is None:
                self.memory.remember(f.result())

        future.add_done_callback(done)

    def known_answer(self, prompt_text: str, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> KnownText:
        """A pair for a stored answer (``previous_response_id``); decodes: call in the pool."""
        answer = self.strip_eos(answer_ids)
        return KnownText(prompt_text, tuple(prompt_ids), tuple(answer), prompt_text + self._decode(answer))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def check_prompt_length(num_tokens: int, max_model_len: int, param: str) -> None:
    """A 400 before submitting: empty prompt, or one the context cannot hold."""
    if num_tokens == 0:
        raise APIError(400, f"{param} is empty", param=param, code="invalid_value")
    if num_tokens >= max_model_len:
        raise APIError(400, f"the prompt is {num_tokens} tokens, but this model's context holds "
                            f"{max_model_len} (room is needed for at least one generated token); "
                            "shorten the prompt", param=param, code="context_length_exceeded")
