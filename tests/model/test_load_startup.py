"""Start-up of a load (issue 33's load time): the fast paths give what the plain definitions
give, and loading does only what its first token needs.

- A GGUF string array's items are where reading the lengths one by one finds them: found
  at once where every item is 1-255 bytes long, by that loop where not.
- A GGUF string array decodes as item by item does, whatever its items (empty, holding a
  NUL, not UTF-8): in one decode of the joined bytes where it can, item by item where not.
- Merges split into pairs as ``tuple(m.split(" ", 1))`` of each merge.
- Loading a model (config, weights, tokenizer) imports no Jinja (the chat template's
  renderer), which the first render does; the cyclic garbage collector is off
  while ``Engine.from_pretrained`` loads and back on after.
"""

from __future__ import annotations

import gc
import mmap
import random
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

import bargein.loader
from bargein.engine.engine import Engine
from bargein.loader.gguf_parse import StringArray, parse_gguf, short_item_starts
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
    "a length's bytes inside an item": [b"a b", b"x\x07\0\0\0\0\0\0\0y z", b"c d"],
    "an item of 256 bytes": [b"a b", b"x " + b"y" * 254, b"c d"],
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


def _items_loop(data: bytes, first: int, count: int) -> tuple[list[int], int] | None:
    """Where each item begins and the last ends, one length at a time (None: past the end)."""
    pos, starts = first, []
    for _ in range(count):
        if pos + 8 > len(data):
            return None
        starts.append(pos + 8)
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
    return (starts, pos) if pos <= len(data) else None


def test_the_items_found_at_once_are_those_a_loop_finds(tmp_path) -> None:
    """short_item_starts on arrays of plain items (1-255 bytes: found at once) and of items
    that defeat it (empty, long, a length's bytes inside one, truncated, one too many
    asked for): whatever it returns is what reading the lengths one by one gives."""
    rng = random.Random(33)
    odd = [b"", b"\0" * 9, b"q\x05\0\0\0\0\0\0\0", b"z" * 256, b"w" * 70_000]
    found = 0
    for trial in range(400):
        items = [bytes(rng.randint(1, 255) for _ in range(rng.randint(1, rng.choice((8, 40, 200)))))
                 for _ in range(rng.randint(1, 300))]
        if trial % 2:
            items.insert(rng.randrange(len(items) + 1), rng.choice(odd))
        lead, trail = bytes(rng.randrange(256) for _ in range(3)), bytes(rng.randrange(4) for _ in range(12))
        data = lead + b"".join(struct.pack("<Q", len(i)) + i for i in items) + trail
        if trial % 7 == 0:
            data = data[: rng.randrange(len(lead) + 8, len(data))]
        count = len(items) + (trial % 11 == 0)
        path = tmp_path / "items.bin"
        path.write_bytes(data)
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            got = short_item_starts(buffer, len(lead), len(data), count)
        if got is not None:
            found += 1
            assert (got[0].tolist(), got[1]) == _items_loop(data, len(lead), count), trial
        elif trial % 2 == 0 and trial % 7 and trial % 11:
            raise AssertionError(f"plain items not found at once (trial {trial})")
    assert found >= 150


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


def test_an_engine_imports_no_grammar_engine_or_disk_tier_until_used() -> None:
    """llguidance and the disk tier's modules (6-8 ms each of a start) wait for a
    constraint to check and a tier to open."""
    later = ["llguidance", "bargein.engine.kv_disk.tier", "bargein.engine.kv_disk.local_tier"]
    code = ("import sys; from bargein import Engine, SamplingParams; e = Engine.from_pretrained(progress=False); "
            "e.generate(['Hi'], SamplingParams(max_tokens=2)); "
            f"print(*[m in sys.modules for m in {later!r}]); "
            "from bargein.engine.constraint import Constraint; from bargein.engine.grammar import check_constraint; "
            "check_constraint(Constraint.json_object()); print('llguidance' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False", "True"]


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
