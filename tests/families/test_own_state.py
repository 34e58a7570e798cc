"""The traced recurrences of families whose state lives outside transformers' cache (models/families/: rwkv,
minimax, recurrent_gemma, xlstm):
each equals Hugging Face's own form on random inputs, from a zero state and from a given one. The exports of
these families (parity, batches, chunked prefill, second turns, the scheduler) are checked by
tests/families/test_recurrent_state.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvforge.models.families import families, family_modules  # noqa: E402
from kvforge.models.families import minimax as own_minimax  # noqa: E402
from kvforge.models.families import recurrent_gemma as own_griffin  # noqa: E402
from kvforge.models.families import rwkv as own_rwkv  # noqa: E402
from kvforge.models.families import xlstm as own_xlstm  # noqa: E402


def _close(got, want, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_the_rwkv_scan_equals_hfs_loop() -> None:
    from transformers.models.rwkv import modeling_rwkv as rwkv

    torch.manual_seed(0)
    b, s, a = 2, 7, 6
    decay, first, key, value = torch.randn(a), torch.randn(a), torch.randn(b, s, a), torch.randn(b, s, a)
    given = [torch.randn(b, a), torch.rand(b, a) + 0.5, torch.randn(b, a)]
    for state in (None, given):
        want = rwkv.rwkv_linear_attention_cpu(decay, first, key, value, state=None if state is None else
                                              [t.clone() for t in state], return_state=True)
        got = own_rwkv.scan_rwkv_linear_attention(decay, first, key, value, state=state, return_state=True)
        _close(got[0], want[0])
        for a_, b_ in zip(got[1], want[1], strict=True):
            _close(a_, b_)


def _minimax_layer(block_size: int):
    from transformers import MiniMaxConfig
    from transformers.models.minimax import modeling_minimax as minimax

    config = MiniMaxConfig(hidden_size=32, num_attention_heads=4, head_dim=8, num_hidden_layers=2,
                           layer_types=["full_attention", "linear_attention"], block_size=block_size)
    torch.manual_seed(0)
    # Layer 0: the decay falls with depth, to about none at the last layer, where a missing decay would pass.
    layer = minimax.MiniMaxLightningAttention(config, 0).eval()
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return minimax, layer


def test_the_lightning_attention_scan_equals_hfs_block_and_per_token_forms() -> None:
    # block_size 4 over 11 positions: HF's blockwise form for a fresh prompt crosses blocks (one of them short).
    minimax, layer = _minimax_layer(block_size=4)
    hidden, more = torch.randn(2, 11, 32), torch.randn(2, 3, 32)
    with torch.no_grad():
        cache = minimax.MiniMaxCache()
        want, want_state = layer(hidden, None, None, cache=cache)  # fresh: the blockwise form
        want_more, want_more_state = layer(more, None, None, cache=cache)  # from a state: the per-token form

        class Cache:
            state = None

            def get_linear_cache(self, layer_idx):
                return self.state

            def set_linear_cache(self, layer_idx, state):
                self.state = state

        ours = Cache()
        got, got_state = own_minimax._lightning_forward(layer, hidden, cache=ours)
        got_more, got_more_state = own_minimax._lightning_forward(layer, more, cache=ours)
    for got_, want_ in ((got, want), (got_state, want_state), (got_more, want_more), (got_more_state, want_more_state)):
        _close(got_, want_, 1e-4)


def test_the_rglru_scan_equals_hfs_from_a_state_and_resets_at_position_zero() -> None:
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as griffin

    config = RecurrentGemmaConfig(hidden_size=16, lru_width=16, num_attention_heads=4, num_hidden_layers=2)
    torch.manual_seed(0)
    lru = griffin.RecurrentGemmaRglru(config).eval()
    for param in lru.parameters():
        torch.nn.init.normal_(param, std=0.5)
    x, state = torch.randn(2, 6, 16), torch.randn(2, 16)
    # Row 0 continues at position 3; row 1 starts a new sequence (position 0 resets the state).
    positions = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        lru.recurrent_states = state.clone()
        want = lru(x, positions)
        got, final = own_griffin._rglru(lru, x, positions, state)
        _close(got, want)
        _close(final, lru.recurrent_states)
        # One token from that state: HF's decode path.
        lru.recurrent_states = final.clone()
        want_one = lru(x[:, :1], positions[:, -1:] + 1)
        got_one, _ = own_griffin._rglru(lru, x[:, :1], positions[:, -1:] + 1, final)
        _close(got_one, want_one)


def test_the_mlstm_scan_equals_hfs_sequence_and_chunkwise_forms() -> None:
    from transformers.models.xlstm import modeling_xlstm as xlstm

    torch.manual_seed(0)
    b, h, s, dk, dv = 2, 3, 11, 4, 5
    q, k, v = torch.randn(b, h, s, dk), torch.randn(b, h, s, dk), torch.randn(b, h, s, dv)
    i, f = torch.randn(b, h, s), torch.randn(b, h, s) + 2.0
    given = (torch.randn(b, h, dk, dv), torch.randn(b, h, dk), torch.randn(b, h, 1))
    for state in ((None, None, None), given):
        want = xlstm.mlstm_recurrent_sequence_native(q, k, v, i, f, *state, return_last_states=True)
        got = own_xlstm.scan_mlstm(q, k, v, i, f, *state)
        _close(got[0], want[0])
        for a_, b_ in zip(got[1], want[1], strict=True):
            _close(a_, b_)
    # From chunk_size positions on, HF runs its chunkwise kernel: the same sums, regrouped.
    want = xlstm.wrap_chunkwise_arbitrary_sequence_length(
        xlstm.mlstm_chunkwise_native_autograd, xlstm.mlstm_recurrent_sequence_native, xlstm.mlstm_recurrent_step_native,
        q, k, v, f, i, *given, chunk_size=4, autocast_kernel_dtype=torch.float32)
    got = own_xlstm.scan_mlstm(q, k, v, i, f, *given)
    _close(got[0], want[0], 1e-4)
    for a_, b_ in zip(got[1], want[1], strict=True):
        _close(a_, b_, 1e-4)


def test_only_the_own_state_families_are_bound_their_way() -> None:
    assert families()["llama"].states is None and families()["mamba"].states is None
    own = {name for name, family in family_modules().items() if family.states is not None}
    assert own == {"rwkv", "minimax", "recurrent_gemma", "xlstm"}
