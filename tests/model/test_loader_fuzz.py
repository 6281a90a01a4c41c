"""Fuzzing the GGUF and safetensors readers: a corrupt file is a LoaderError, nothing else.

Hypothesis corrupts a valid tiny model: truncations, bytes overwritten in the header,
KV and tensor tables (with extreme integers where counts, lengths, dims and offsets
live), metadata of the wrong type or out of range, safetensors headers with wrong
dtypes, shapes and offsets. Loading the result (config, weights, tokenizer) either
works or raises ``LoaderError``: never another exception, a hang (pytest-timeout), or
an allocation sized by a header value rather than by the bytes that are there (the
process's peak RSS is checked after the run).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import struct
from pathlib import Path

import gguf
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from bargein.loader import LoaderError, load_config, load_tokenizer, load_weights, resolve_model_ref
from bargein.model.llama import LlamaStage
from tests.tiny_models import TinySpec, hf_name, tiny_weights, write_gguf, write_hf_folder

pytestmark = pytest.mark.timeout(240)
SPEC = TinySpec()
EXAMPLES = int(os.environ.get("BARGEIN_FUZZ_EXAMPLES", "40"))  # bench/fuzz_long.sh raises it
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
EXTREME_U64 = [0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**64 - 1]
RSS_BUDGET_MB = 1500  # peak growth allowed over the whole module; a header-sized allocation is far above
_names = itertools.count()


@pytest.fixture(scope="module")
def rss_guard():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < RSS_BUDGET_MB, f"peak RSS grew {grown_mb:.0f} MB while loading corrupt files"


@pytest.fixture(scope="module")
def valid_path(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("valid") / "tiny.gguf", SPEC, tiny_weights(SPEC), tensor_type="Q8_0")


@pytest.fixture(scope="module")
def valid_gguf(valid_path) -> bytes:
    return valid_path.read_bytes()


@pytest.fixture(scope="module")
def tables_end(valid_path) -> int:
    """Where the tensor data starts: everything before is header, KV and tensor tables."""
    return int(gguf.GGUFReader(valid_path).data_offset)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def load_all(ref: Path) -> None:
    """Everything ``bargein serve`` reads from a model: config, weights, tokenizer."""
    source = resolve_model_ref(ref)
    config = load_config(source)
    weights = load_weights(source, config, progress=False)
    load_tokenizer(source).encode("hello")
    LlamaStage(config, weights)  # allocates from the config (RoPE table, ...); PyTorch kernels


def only_loader_errors(ref: Path) -> None:
    with contextlib.suppress(LoaderError):
        load_all(ref)


def _fresh(fuzz_dir: Path, data: bytes, suffix: str = ".gguf") -> Path:
    """A new file per example: the GGUF cache is keyed by path, mtime and size."""
    path = fuzz_dir / f"f{next(_names)}{suffix}"
    path.write_bytes(data)
    return path


def test_valid_file_loads(valid_gguf, fuzz_dir):
    load_all(_fresh(fuzz_dir, valid_gguf))


@FUZZ
@given(cut=st.floats(0.0, 1.0, exclude_max=True))
def test_truncated_gguf(valid_gguf, fuzz_dir, rss_guard, cut):
    only_loader_errors(_fresh(fuzz_dir, valid_gguf[: int(len(valid_gguf) * cut)]))


@FUZZ
@given(data=st.data())
def test_gguf_header_and_tables_with_extreme_integers(valid_gguf, tables_end, fuzz_dir, rss_guard, data):
    end = tables_end
    blob = bytearray(valid_gguf)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(4, end - 8))
        value = data.draw(st.sampled_from(EXTREME_U64) | st.integers(0, 2**64 - 1))
        blob[at:at + 8] = struct.pack("<Q", value)
    only_loader_errors(_fresh(fuzz_dir, bytes(blob)))


@FUZZ
@given(data=st.data())
def test_gguf_random_bytes_in_header_and_tables(valid_gguf, tables_end, fuzz_dir, rss_guard, data):
    end = tables_end
    blob = bytearray(valid_gguf)
    for _ in range(data.draw(st.integers(1, 16))):
        blob[data.draw(st.integers(0, end - 1))] = data.draw(st.integers(0, 255))
    only_loader_errors(_fresh(fuzz_dir, bytes(blob)))


_META_KEYS = ["llama.embedding_length", "llama.block_count", "llama.attention.head_count",
              "llama.attention.head_count_kv", "llama.feed_forward_length", "llama.context_length",
              "llama.attention.key_length", "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
              "general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.eos_token_id", "tokenizer.ggml.tokens", "tokenizer.chat_template"]
_META_VALUES = st.one_of(st.integers(-2**63, 2**63 - 1), st.sampled_from([0, -1, 2**31, 2**40]),
                         st.floats(allow_nan=True, width=32), st.text(max_size=20), st.lists(st.integers(0, 2**31), max_size=4),
                         st.lists(st.text(max_size=4), max_size=4))


@FUZZ
@given(overrides=st.dictionaries(st.sampled_from(_META_KEYS), _META_VALUES, min_size=1, max_size=3))
def test_gguf_metadata_of_wrong_type_or_range(valid_path, fuzz_dir, rss_guard, overrides):
    src = gguf.GGUFReader(valid_path)
    path = fuzz_dir / f"m{next(_names)}.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.kv_data[0].clear()  # drop the architecture the constructor wrote; copied or overridden below
    for name, field in src.fields.items():
        if name.startswith("GGUF.") or name in overrides:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    for name, value in overrides.items():
        _add_any(writer, name, value)
    for tensor in src.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    only_loader_errors(path)


def _add_any(writer: gguf.GGUFWriter, name: str, value) -> None:
    if isinstance(value, (bool, int)):
        if -2**63 <= value < 0:
            writer.add_int64(name, value)
        else:
            writer.add_uint64(name, value)
    elif isinstance(value, float):
        writer.add_float32(name, value)
    elif isinstance(value, str):
        writer.add_string(name, value)
    else:
        writer.add_array(name, value)


# ---------------------------------------------------------------- safetensors

@pytest.fixture(scope="module")
def valid_folder(tmp_path_factory) -> Path:
    return write_hf_folder(tmp_path_factory.mktemp("hf") / "tiny", SPEC, tiny_weights(SPEC), num_shards=1)


def _copy_folder(fuzz_dir: Path, valid_folder: Path, weights: bytes) -> Path:
    folder = fuzz_dir / f"hf{next(_names)}"
    folder.mkdir()
    for item in valid_folder.iterdir():
        if item.suffix != ".safetensors":
            (folder / item.name).write_bytes(item.read_bytes())
    (folder / "model.safetensors").write_bytes(weights)
    return folder


@FUZZ
@given(cut=st.floats(0.0, 1.0, exclude_max=True))
def test_truncated_safetensors(valid_folder, fuzz_dir, rss_guard, cut):
    data = (valid_folder / "model.safetensors").read_bytes()
    only_loader_errors(_copy_folder(fuzz_dir, valid_folder, data[: int(len(data) * cut)]))


_DTYPES = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "XYZ", ""])
_DIMS = st.lists(st.one_of(st.integers(0, 300), st.sampled_from([2**31, 2**40, 2**63 - 1, -1])), max_size=4)


@FUZZ
@given(data=st.data())
def test_safetensors_tensor_table_corruptions(valid_folder, fuzz_dir, rss_guard, data):
    raw = (valid_folder / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    for name in data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
        entry = header[name]
        what = data.draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "swap"]))
        if what == "dtype":
            entry["dtype"] = data.draw(_DTYPES)
        elif what == "shape":
            entry["shape"] = data.draw(_DIMS)
        elif what == "offsets":
            entry["data_offsets"] = data.draw(st.lists(st.one_of(st.integers(-1, len(raw)), st.just(2**64 - 1)),
                                                       min_size=0, max_size=3))
        elif what == "drop":
            del header[name]
        else:
            other = header[data.draw(st.sampled_from(names))]
            entry["data_offsets"] = list(other["data_offsets"]) if isinstance(other, dict) else entry["data_offsets"]
    body = json.dumps(header).encode()
    length = data.draw(st.sampled_from([len(body), len(body) + 1, 2**63, 0]))
    blob = struct.pack("<Q", length) + body + raw[8 + n:]
    only_loader_errors(_copy_folder(fuzz_dir, valid_folder, blob))


@FUZZ
@given(data=st.data())
def test_safetensors_shapes_that_do_not_fit_the_config(valid_folder, fuzz_dir, rss_guard, data):
    weights = {hf_name(k): v for k, v in tiny_weights(SPEC).items()}
    name = data.draw(st.sampled_from(sorted(weights)))
    rows = data.draw(st.integers(0, 5))
    weights[name] = torch.zeros(rows, 3)
    folder = fuzz_dir / f"hfs{next(_names)}"
    folder.mkdir()
    (folder / "config.json").write_bytes((valid_folder / "config.json").read_bytes())
    for extra in valid_folder.iterdir():
        if extra.suffix == ".json" and extra.name != "config.json":
            (folder / extra.name).write_bytes(extra.read_bytes())
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(LoaderError):
        load_all(folder)
