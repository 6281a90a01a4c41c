"""Speculative decoding that never changes an answer.

A proposer guesses the next k tokens of a decoding request (``ngram``: prompt lookup;
``draft_model``: a small model of the same vocabulary); the scheduler places the guesses
after the request's pending token in the same step (``Scheduler.add_drafts``), so one
forward returns k+1 logits rows; ``verify`` keeps the longest prefix of guesses equal to
the tokens the request would have picked anyway (the argmax, or the draw from its own
random stream for that token index), plus the one token after them; the scheduler keeps
the K/V of confirmed guesses only (``Scheduler.update``). ``controller.Speculation`` ties
these together for the engine: which requests speculate, how many guesses (k adapts to
the acceptance rate), when the batch is too wide to gain, and the drafted/accepted counts.
"""
