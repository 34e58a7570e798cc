"""RecurrentGemma (Griffin): its RG-LRU blocks keep their short-convolution inputs and recurrent state in module
attributes; the block's forward is replaced, for one traced call, by one that continues the row from state
buffers, its linear recurrence a scan."""

from __future__ import annotations

from typing import Any

import torch

from kvforge.models.families.family import Family
from kvforge.models.families.state_binding import StateBinding, StateShapes, fresh
from kvforge.models.families.surgery import backbone


def scan_linear_recurrence(gate: torch.Tensor, inputs: torch.Tensor,
                           state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t = gate_t * h_{t-1} + inputs_t over [B, S, W] (HF's RecurrentGemmaRglru._rnn_scan, gate already zero
    at a reset), accumulated in fp32 from `state` [B, W] (zeros where None): the outputs in the inputs' dtype,
    and the final state in fp32."""
    from torch._higher_order_ops.scan import scan

    if state is None:
        state = inputs.new_zeros(inputs.shape[0], inputs.shape[2], dtype=torch.float32)

    def step(state: torch.Tensor, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, x = xs
        state = a * state + x
        return state, state.clone()

    final, out = scan(step, state.float().contiguous(),
                      [gate.float().transpose(0, 1), inputs.float().transpose(0, 1)])
    return out.transpose(0, 1).to(inputs.dtype), final


def _rglru(lru: Any, activations: torch.Tensor, position_ids: torch.Tensor,
           state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RecurrentGemmaRglru.forward from an explicit state, its sequence loop a scan; (outputs, final state)."""
    batch, seq, width = activations.shape
    reset = position_ids[:, :, None] == 0
    blocks = activations.reshape(batch * seq, lru.num_attention_heads, lru.block_width).permute(1, 0, 2)

    def gate(bias: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.baddbmm(bias[:, None, :], blocks, weight).transpose(0, 1).reshape(batch, seq, width))

    input_gate = gate(lru.input_gate_bias, lru.input_gate_weight)
    log_a = -8.0 * gate(lru.recurrent_gate_bias, lru.recurrent_gate_weight) * torch.nn.functional.softplus(
        lru.recurrent_param)
    multiplier = torch.sqrt(1 - torch.exp(2 * log_a))  # HF's SqrtBoundDerivative only changes the gradient
    multiplier = reset + ~reset * multiplier
    normalized = activations * input_gate * multiplier.type(activations.dtype)
    # Detached: scan's autograd form fails torch.onnx's decomposition; an export never trains.
    return scan_linear_recurrence((torch.exp(log_a) * ~reset).detach(), normalized.detach(), state)


class _States:
    def _blocks(self, model: Any) -> dict[int, Any]:
        return {i: layer.temporal_block for i, layer in enumerate(backbone(model).layers)
                if hasattr(layer.temporal_block, "rg_lru")}

    def probe(self, model: Any) -> StateShapes:
        config = model.config
        dtype = next(model.parameters()).dtype
        return {layer: {"conv0": ((config.lru_width, config.conv1d_width - 1), dtype),
                        "recurrent0": ((config.lru_width,), torch.float32)} for layer in self._blocks(model)}

    def bind(self, model: Any, past: dict[tuple[int, str], torch.Tensor], past_lens: torch.Tensor) -> StateBinding:
        binding = StateBinding()
        binding.use_cache = False  # the attention layers' KV is kvforge's; the blocks' states are bound below
        layer_of = {id(block): layer for layer, block in self._blocks(model).items()}

        def forward(block: Any, input_states: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any = None,
                    use_cache: bool = True, **kwargs: Any) -> tuple[torch.Tensor, None]:
            # Griffin's recurrent block, continuing the row: the short convolution runs over the previous
            # conv1d_width - 1 inputs and the new ones (HF's prefill restarts it from zeros), then the RG-LRU.
            layer = layer_of[id(block)]
            seq = input_states.shape[1]
            y_branch = block.act_fn(block.linear_y(input_states))
            x_branch = block.linear_x(input_states).transpose(1, 2)
            full = torch.cat([fresh(past[(layer, "conv0")], past_lens).to(x_branch.dtype), x_branch], dim=-1)
            binding.present[(layer, "conv0")] = full[..., seq:]
            conv = block.conv_1d
            x_branch = torch.nn.functional.conv1d(full, conv.weight, conv.bias, groups=conv.groups)
            x_branch, state = _rglru(block.rg_lru, x_branch.transpose(1, 2), position_ids,
                                     fresh(past[(layer, "recurrent0")], past_lens))
            binding.present[(layer, "recurrent0")] = state
            return block.linear_out(x_branch * y_branch), None

        block_class = type(next(iter(self._blocks(model).values())))
        binding.patch(block_class, "forward", forward)
        return binding


FAMILIES = (Family("recurrent_gemma", (), "RG-LRU and convolution states, the recurrence a scan", states=_States()),)
