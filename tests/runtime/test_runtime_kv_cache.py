"""KV cache allocation and the capacity rules (no graph needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.core.errors import CapacityError, InputError, ManifestError
from kvforge.runtime.backends.kv_cache import KVCache, choose_capacity, needed_positions


def test_needed_positions_excludes_the_last_generated_token() -> None:
    # 5-token prompt, 3 new tokens: positions 0..4 for the prompt, 5 and 6 for the two fed back.
    assert needed_positions([5, 2], 3) == 7
    assert needed_positions([1], 1) == 1


def test_capacity_defaults_to_what_the_request_needs() -> None:
    assert choose_capacity(needed=70, max_capacity=128) == 70
    assert choose_capacity(needed=70, max_capacity=128, requested=100) == 100


def test_capacity_errors_say_what_to_do() -> None:
    with pytest.raises(CapacityError, match="needs 130 positions .* allows at most 128"):
        choose_capacity(needed=130, max_capacity=128)
    with pytest.raises(CapacityError, match=r"needs 70 positions but the KV cache holds 64; raise capacity \(max 128\)"):
        choose_capacity(needed=70, max_capacity=128, requested=64)
    with pytest.raises(CapacityError, match="exceeds the export's max_capacity 128"):
        choose_capacity(needed=10, max_capacity=128, requested=129)
    with pytest.raises(InputError, match="capacity must be a positive integer"):
        choose_capacity(needed=10, max_capacity=128, requested=0)


def test_buffers_are_preallocated_zeroed_and_distinct() -> None:
    cache = KVCache(num_layers=3, batch=2, num_kv_heads=2, capacity=16, head_dim=4, dtype="float16")
    assert cache.num_layers == 3
    for layer in range(3):
        key, value = cache.read(layer)
        assert key.shape == value.shape == (2, 2, 16, 4)
        assert key.dtype == np.float16 and not key.any() and not value.any()
    assert len(set(cache.addresses().values())) == 6
    assert cache.past_lens.dtype == np.int32 and cache.past_lens.tolist() == [0, 0]


def test_check_fits_per_row_and_for_running_rows_only() -> None:
    cache = KVCache(num_layers=1, batch=2, num_kv_heads=1, capacity=8, head_dim=2, max_capacity=32)
    cache.past_lens[:] = [8, 5]
    with pytest.raises(CapacityError, match=r"needs 9 positions but the KV cache holds 8; raise capacity \(max 32\)"):
        cache.check_fits(1)
    cache.check_fits(3, rows=np.array([False, True]))  # the full row is finished (frozen)
    with pytest.raises(CapacityError):
        cache.check_fits(4, rows=np.array([False, True]))


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ManifestError, match="KV cache dtype 'bfloat16' is not supported"):
        KVCache(num_layers=1, batch=1, num_kv_heads=1, capacity=4, head_dim=2, dtype="bfloat16")
