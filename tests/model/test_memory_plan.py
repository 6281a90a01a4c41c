"""Memory stated in advance: the weights a plan maps and copies, its KV cache, ``auto``
sizing from what is available, and a clear refusal where the private memory cannot fit."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from bargein.config import CacheConfig, EngineConfig
from bargein.kernels.native import load_native_kernels
from bargein.kernels.native_structs import FastShape
from bargein.loader import load_config, resolve_model_ref
from bargein.loader.gguf_file import open_gguf
from bargein.loader.memory_plan import (
    RUNTIME_BYTES,
    MemoryPlanError,
    plan_memory,
    step_buffer_bytes,
)
from tests.model.quant_models import write_quant_gguf

GiB = 1 << 30
CPU = EngineConfig(device="cpu", precision="exact", cache=CacheConfig(kv_tokens=1024), weights_memory="mapped")


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_quant_gguf(tmp_path_factory.mktemp("plan") / "tiny.Q4_K_M.gguf", mix="Q4_K_M")
    return path


def test_the_plan_maps_the_files_blocks_and_counts_the_rest_as_private(q4_k_m: Path) -> None:
    source = resolve_model_ref(q4_k_m)
    config = load_config(source)
    tensors = open_gguf(q4_k_m).tensors
    plan = plan_memory(source, config, CPU, available=64 * GiB)
    blocks = sum(t.n_bytes for t in tensors.values() if len(t.shape) == 2)
    norms = sum(t.n_bytes for t in tensors.values() if len(t.shape) == 1)  # F32
    assert (plan.mapped_weight_bytes, plan.private_weight_bytes) == (blocks, norms)
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # exact: float32 K/V
    assert (plan.kv_tokens, plan.kv_bytes) == (1024, 1024 * per_token)
    assert plan.expected_rss == blocks + norms + plan.kv_bytes + RUNTIME_BYTES
    assert "mapped" in plan.describe() and "expected RSS" in plan.describe()
    fast = plan_memory(source, config, replace(CPU, precision="fast"), available=64 * GiB)
    assert fast.kv_bytes * 2 == plan.kv_bytes  # float16 K/V
    # the fused forward's buffers for a full step, kept by the model once a step needs them
    assert plan.step_bytes == 0 and fast.step_bytes == step_buffer_bytes(config, 512) > 0
    assert fast.expected_rss == blocks + norms + fast.kv_bytes + RUNTIME_BYTES + fast.step_bytes
    assert f"step buffers {fast.step_bytes / 2**20:,.0f} MiB" in fast.describe()
    copied = plan_memory(source, config, replace(CPU, weights_memory="private"), available=64 * GiB)
    assert (copied.mapped_weight_bytes, copied.private_weight_bytes) == (0, blocks + norms)  # the load-time copy
    assert copied.expected_rss == plan.expected_rss
    # "auto" keeps the file's pages where they are on 2 MB pages, else copies: planned as the copy
    assert plan_memory(source, config, replace(CPU, weights_memory="auto"), available=64 * GiB) == copied
    widened = plan_memory(source, config, replace(CPU, native_kernels=False), available=64 * GiB)
    assert widened.mapped_weight_bytes == 0 and widened.private_weight_bytes > 4 * blocks


def test_auto_plans_a_file_on_tmpfs_as_mapped(q4_k_m: Path) -> None:
    """auto keeps a tmpfs file's pages as they are (bargein.loader.private_weights): its plan
    is the mapped one, not the copy's."""
    from tests.model.test_huge_page_cache import tmpfs_at_dev_shm

    if not tmpfs_at_dev_shm():
        pytest.skip("no tmpfs at /dev/shm here")
    with tempfile.NamedTemporaryFile(dir="/dev/shm", suffix=".gguf") as shared:
        shared.write(q4_k_m.read_bytes())
        shared.flush()
        source = resolve_model_ref(Path(shared.name))
        config = load_config(source)
        auto = plan_memory(source, config, replace(CPU, weights_memory="auto"), available=64 * GiB)
        assert auto == plan_memory(source, config, CPU, available=64 * GiB)  # CPU: "mapped"
        assert auto.mapped_weight_bytes > 0
        copied = plan_memory(source, config, replace(CPU, weights_memory="private"), available=64 * GiB)
        assert copied.mapped_weight_bytes == 0
        assert auto.memory_file_system == "tmpfs" and "mapped (the file's pages on tmpfs)" in auto.describe()


def test_auto_kv_does_not_take_a_tmpfs_files_pages_from_the_available_memory_twice(q4_k_m: Path) -> None:
    """A tmpfs file's pages are memory already, outside MemAvailable: ``--kv-memory auto``
    gives the KV cache all that is left beside the rest, where a file on disk must keep its
    mapped pages resident out of what is available."""
    from tests.model.test_huge_page_cache import tmpfs_at_dev_shm

    if not tmpfs_at_dev_shm():
        pytest.skip("no tmpfs at /dev/shm here")
    on_disk = resolve_model_ref(q4_k_m)
    config = load_config(on_disk)
    available = int((RUNTIME_BYTES + 8 * 2**20) / 0.9) + 2**20
    disk = plan_memory(on_disk, config, CPU, kv_auto=True, available=available)
    per_token = disk.kv_bytes // disk.kv_tokens
    left = int(available * 0.9) - disk.mapped_weight_bytes - disk.private_weight_bytes - RUNTIME_BYTES
    assert disk.kv_tokens == left // per_token // 16 * 16 and disk.memory_file_system is None
    with tempfile.NamedTemporaryFile(dir="/dev/shm", suffix=".gguf") as shared:
        shared.write(q4_k_m.read_bytes())
        shared.flush()
        memory = plan_memory(resolve_model_ref(Path(shared.name)), config, CPU, kv_auto=True, available=available)
    assert memory.mapped_weight_bytes == disk.mapped_weight_bytes > 16 * per_token
    assert memory.kv_tokens == (left + disk.mapped_weight_bytes) // per_token // 16 * 16 > disk.kv_tokens
    # with less available than its expected RSS, no paging is foretold: the mapped part is held already
    assert memory.needs_available_bytes == memory.private_bytes == memory.expected_rss - memory.mapped_weight_bytes
    short = replace(memory, available_bytes=memory.private_bytes + 1)
    assert "expect paging" not in short.describe()
    assert "expect paging" in replace(short, memory_file_system=None).describe()


def test_auto_gives_the_kv_cache_what_is_left_and_refuses_when_nothing_is(q4_k_m: Path) -> None:
    source = resolve_model_ref(q4_k_m)
    config = load_config(source)
    roomy = plan_memory(source, config, CPU, kv_auto=True, available=64 * GiB)
    assert roomy.kv_tokens == config.max_position_embeddings * CPU.scheduler.max_num_seqs  # capped: all it can use
    tight = RUNTIME_BYTES + 8 * 2**20
    some = plan_memory(source, config, CPU, kv_auto=True, available=int(tight / 0.9) + 2**20)
    assert 256 <= some.kv_tokens < roomy.kv_tokens and some.kv_tokens % CPU.cache.block_size == 0
    assert some.expected_rss <= some.available_bytes
    with pytest.raises(MemoryPlanError, match="no room is left for a KV cache"):
        plan_memory(source, config, CPU, kv_auto=True, available=RUNTIME_BYTES)


def test_private_memory_that_cannot_fit_is_refused_before_loading(q4_k_m: Path) -> None:
    source = resolve_model_ref(q4_k_m)
    big_kv = replace(CPU, cache=CacheConfig(memory_bytes=8 * GiB))
    with pytest.raises(MemoryPlanError, match="private memory"):
        plan_memory(source, load_config(source), big_kv, available=2 * GiB)


def test_a_private_copy_that_cannot_fit_points_to_the_mapped_file_where_that_fits(q4_k_m: Path) -> None:
    source = resolve_model_ref(q4_k_m)
    config = load_config(source)
    copied = replace(CPU, weights_memory="private")
    need = plan_memory(source, config, copied, available=64 * GiB)
    blocks = sum(t.n_bytes for t in open_gguf(q4_k_m).tensors.values() if len(t.shape) == 2)
    with pytest.raises(MemoryPlanError, match=f"--weights-memory mapped keeps {blocks / 2**20:,.0f} MiB"):
        plan_memory(source, config, copied, available=need.private_bytes - 1)
    with pytest.raises(MemoryPlanError, match="private memory") as refused:  # not even without the copy
        plan_memory(source, config, copied, available=need.private_bytes - blocks - 1)
    assert "--weights-memory mapped" not in str(refused.value)


def test_the_bundled_models_blocks_are_mapped() -> None:
    source = resolve_model_ref(None)
    config = load_config(source)
    plan = plan_memory(source, config, CPU, available=64 * GiB)
    tensors = open_gguf(source.path).tensors
    assert plan.mapped_weight_bytes == sum(t.n_bytes for t in tensors.values() if len(t.shape) == 2)


@pytest.mark.parametrize("rows", [1, 7, 512])
@pytest.mark.parametrize("local", [False, True], ids=["global-rope", "local-rope"])
def test_the_planned_step_buffers_are_the_fused_forwards_workspace(q4_k_m: Path, rows: int, local: bool) -> None:
    native = load_native_kernels()
    if native is None:
        pytest.skip("no C compiler here")
    config = replace(load_config(resolve_model_ref(q4_k_m)), local_rope_theta=10_000.0 if local else None)
    table = 1 if local else None  # only whether the local tables are there counts
    shape = FastShape(hidden=config.hidden_size, intermediate=config.intermediate_size, num_heads=config.num_heads,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, local_cos_table=table,
                      local_sin_table=table)
    assert step_buffer_bytes(config, rows) == 4 * native.fast_workspace_floats(shape, rows)
