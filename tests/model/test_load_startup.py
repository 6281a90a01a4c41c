"""Start-up of a load (issue 33's load time): the fast paths give what the plain definitions
give, and loading does only what its first token needs.

- A GGUF string array decodes as item by item does, whatever its items (empty, holding a
  NUL, not UTF-8): in one decode of the joined bytes where it can, item by item where not.
- Merges split into pairs as ``tuple(m.split(" ", 1))`` of each merge.
- Loading a model (config, weights, tokenizer) imports no Jinja (the chat template's
  renderer), which the first render does; the cyclic garbage collector is off
  while ``Engine.from_pretrained`` loads and back on after.
"""

from __future__ import annotations

import gc
import subprocess
import sys

import gguf
import numpy as np
import pytest

import bargein.loader
from bargein.engine.engine import Engine
from bargein.loader.gguf_parse import StringArray, parse_gguf
from bargein.loader.gguf_tokenizer import merge_pairs
from tests.tiny_models import TinySpec, tiny_weights, write_gguf

CASES = {
    "plain": [b"a b", b"cd e", b"\xc4\xa0t he"],
    "empty items": [b"", b"a b", b"", b""],
    "a NUL inside": [b"a b", b"c\x00 d", b"e f"],
    "not UTF-8": [b"\xff b", b"c d", b"\xe2\x82 x"],
    "one without a space": [b"a b", b"cd", b"e f g"],  # as many spaces as merges, misplaced
    "two spaces": [b"ab", b"c  d"],
    "trailing newline": [b"a b", b"xy\n"],
    "spaces at the ends": [b" b", b"c "],
    "one item": [b"x y"],
}


def _string_array(tmp_path, items: list[bytes]):
    """``items`` written as a GGUF metadata string array and parsed back."""
    path = tmp_path / "strings.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_key_value("test.items", items, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return parse_gguf(path).fields["test.items"]


@pytest.mark.parametrize("name", CASES)
def test_string_arrays_decode_as_item_by_item(tmp_path, name: str) -> None:
    items = CASES[name]
    array = _string_array(tmp_path, items)
    assert array.items == items
    assert array.decoded(errors="replace") == [i.decode("utf-8", errors="replace") for i in items]
    try:
        strict = [i.decode("utf-8") for i in items]
    except UnicodeDecodeError:
        with pytest.raises(UnicodeDecodeError):
            array.decoded()
    else:
        assert array.decoded() == strict
    assert merge_pairs(array) == [tuple(i.decode("utf-8", errors="replace").split(" ", 1)) for i in items]


def test_an_empty_string_array_decodes_to_nothing() -> None:
    empty = StringArray(b"", np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
    assert empty.decoded() == [] and merge_pairs(empty) == []


def test_loading_imports_no_jinja_until_a_template_renders() -> None:
    code = ("import sys; import bargein.loader as L; s = L.resolve_model_ref(None); c = L.load_config(s); "
            "L.load_weights(s, c, progress=False, blocks=True); t = L.load_tokenizer(s); "
            "before = 'jinja2' in sys.modules; "
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}]); print(before, 'jinja2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_from_pretrained_loads_with_the_collector_paused(tmp_path, monkeypatch) -> None:
    spec = TinySpec()
    path = write_gguf(tmp_path / "tiny.gguf", spec, tiny_weights(spec))
    seen: list[bool] = []
    load_tokenizer = bargein.loader.load_tokenizer

    def spy(source):
        seen.append(gc.isenabled())
        return load_tokenizer(source)

    monkeypatch.setattr(bargein.loader, "load_tokenizer", spy)
    assert gc.isenabled()
    engine = Engine.from_pretrained(str(path), progress=False)
    assert seen == [False] and gc.isenabled()
    engine.close()
