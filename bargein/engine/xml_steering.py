"""Steering a forced tool call in Qwen3-Coder's XML to close before its token budget runs out.

The call (``server/tool_grammar_xml``) writes each parameter as text between its tags::

    <tool_call>
    <function=get_time>
    <parameter=note>
    free text, any length
    </parameter>
    </function>
    </tool_call>

A string value is free text, which a weak model may never end. :class:`XmlCallTracker`
follows the call's bytes: before the function's tag, in the tags between parameters,
inside a value (with a :class:`~bargein.engine.json_steering.JsonTracker` on the value's
bytes, for values the grammar writes as JSON), after ``</function>``. In the last tokens of
the budget it prefers the tokens that spell the rest of the way out: the value's closing
tag, then the next required parameter's opening tag (the required parameters still to
come, ``Constraint.xml_call``) or ``</function>``. As in JSON steering, the preference is
only ever intersected with the grammar's mask (``json_steering.steer``): inside a JSON
value where a closing tag may not come yet, JSON's own closing tokens are preferred; where
nothing preferred is allowed, the grammar's mask stands.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from bargein.engine.json_steering import STEER_MARGIN, JsonState, JsonTracker, SteeringClasses

# The XML call's tags, as server/tool_syntax_xml writes them (the engine layer cannot import
# the server's; tests/engine/test_xml_steering.py checks that they agree).
PARAMETER = b"<parameter="
VALUE_END = b"\n</parameter>\n"
FUNCTION = b"<function="
FUNCTION_END = b"</function>\n"
CALL_END = b"</tool_call>"  # forced by the grammar after </function> (one token in Qwen's vocabulary)
_KEEP = len(VALUE_END)  # a value's last bytes are all that its end needs


class XmlPhase(Enum):
    OUTSIDE = "outside"  # before <function=NAME>\n
    TAGS = "tags"  # between parameters (or inside a parameter's opening tag)
    VALUE = "value"  # inside a parameter's value
    CLOSING = "closing"  # after </function>\n: the grammar forces the rest


@dataclass
class XmlCallTracker:
    """Where a forced XML call's text is, fed byte by byte. ``required``: per tool name, its
    required parameters in the order the grammar writes them."""

    required: Mapping[str, Sequence[str]]
    phase: XmlPhase = XmlPhase.OUTSIDE
    function: str | None = None
    written: list[str] = field(default_factory=list)  # parameters opened so far
    tag: bytes = b""  # the tag text since the last tag or value ended
    value: bytes = b""  # the value's last bytes
    json: JsonTracker = field(default_factory=JsonTracker)

    def feed(self, data: bytes) -> None:
        for byte in data:
            self._byte(bytes((byte,)))

    def _byte(self, b: bytes) -> None:
        if self.phase == XmlPhase.VALUE:
            self.value = (self.value + b)[-_KEEP:]
            self.json.feed(b)
            if self.value == VALUE_END:
                self.phase, self.tag = XmlPhase.TAGS, b""
            return
        if self.phase == XmlPhase.CLOSING:
            return
        self.tag += b
        if not self.tag.endswith(b">\n"):
            return
        tag, self.tag = self.tag, b""
        if PARAMETER in tag:
            self.written.append(tag.split(PARAMETER, 1)[1][:-2].decode(errors="replace"))
            self.phase, self.value, self.json = XmlPhase.VALUE, b"", JsonTracker.starting(outside=False)
        elif FUNCTION in tag:
            self.function = tag.split(FUNCTION, 1)[1][:-2].decode(errors="replace")
            self.phase = XmlPhase.TAGS
        elif FUNCTION_END in tag and self.phase == XmlPhase.TAGS:
            self.phase = XmlPhase.CLOSING

    @property
    def pending(self) -> list[str]:
        """The function's required parameters not opened yet."""
        return [name for name in self.required.get(self.function or "", ()) if name not in self.written]

    def preferred(self, classes: SteeringClasses, tokens_left: int) -> tuple[np.ndarray, ...]:
        """The tokens to narrow the mask to with ``tokens_left`` of the budget, best first
        (empty: no steering yet, or nothing to steer). Steering starts when the tokens left
        are at most what closing needs (the rest of this part, the required parameters
        still to come, ``</function>``, the closing tag) plus ``STEER_MARGIN``."""
        if self.phase in (XmlPhase.OUTSIDE, XmlPhase.CLOSING):
            return ()
        pending = self.pending
        after = PARAMETER + pending[0].encode() + b">\n" if pending else FUNCTION_END
        opened_value = 0  # a value still to open and close for this part
        tail = FUNCTION_END + CALL_END  # what ends the call after this part and the pending parameters
        if self.phase == XmlPhase.VALUE:
            overlap = next(k for k in range(len(VALUE_END) - 1, -1, -1) if self.value.endswith(VALUE_END[:k]))
            rest, target = VALUE_END[overlap:], VALUE_END[overlap:] + after
        elif after.startswith(self.tag):  # the tag heading for </function> or the next required one
            rest = target = after[len(self.tag):]
            pending, opened_value = pending[1:], int(bool(pending))
            tail = tail if opened_value else CALL_END  # ``rest`` is the rest of </function>
        else:  # an opening tag the grammar chose instead: its name ends at '>'
            rest = target = b">\n"
            opened_value = 1
        needed = classes.token_count(rest) + classes.token_count(tail) + 1  # + end of sequence
        needed += opened_value * (classes.token_count(VALUE_END) + 1)
        needed += sum(classes.token_count(PARAMETER + p.encode() + b">\n" + VALUE_END) + 1 for p in pending)
        if tokens_left > needed + STEER_MARGIN:
            return ()
        close = classes.text_prefixes(target)
        if self.phase != XmlPhase.VALUE or self.json.state in (JsonState.DONE, JsonState.OUTSIDE):
            return (close,)
        in_array = bool(self.json.stack) and self.json.stack[-1] == "["
        return (close, *classes.for_state(self.json.state, in_array=in_array))
