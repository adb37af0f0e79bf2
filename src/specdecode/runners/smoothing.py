"""SmoothQuant's per-channel smoothing (Xiao et al., 2023) for the w8a8 products: an input
channel j of a product is divided by s_j and its weight column multiplied by s_j, which leaves
the float product as it was, but moves range from the activations (quantized per row, where
one wide channel costs every other channel of the row its resolution) to the weights
(quantized per output channel). s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha), with max|x_j|
from a calibration forward. The division folds into what makes the input: the RMS norm's
weight before q|k|v, gate|up and the head, the up projection's rows before down.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def input_maxima(model: torch.nn.Module, token_ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:  # ids [n]
    """Per decoder layer, the largest magnitude of each input channel of q|k|v, gate|up and down
    over a forward of token_ids: {"qkv": [hidden], "gate_up": [hidden], "down": [intermediate]},
    and in the last layer's, "head": [hidden], the output head's input (after the final norm)."""
    maxima: list[dict[str, torch.Tensor]] = [{} for _ in model.model.layers]
    hooks = []
    for layer, found in zip(model.model.layers, maxima):
        for name, module in (
            ("qkv", layer.self_attn.q_proj),
            ("gate_up", layer.mlp.gate_proj),
            ("down", layer.mlp.down_proj),
        ):
            hooks.append(module.register_forward_pre_hook(_recorder(found, name)))
    # the head's input at every position: the final norm's output (the head itself sees only the
    # last position's, logits_to_keep=1)
    hooks.append(model.model.norm.register_forward_hook(_output_recorder(maxima[-1], "head")))
    try:
        model(token_ids[None].to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return maxima


def _largest(x: torch.Tensor) -> torch.Tensor:  # [..., channels] -> [channels]
    return x.detach().float().abs().reshape(-1, x.shape[-1]).amax(dim=0)


def _recorder(found: dict[str, torch.Tensor], name: str):
    def record(module: torch.nn.Module, args: tuple) -> None:
        found[name] = _largest(args[0])

    return record


def _output_recorder(found: dict[str, torch.Tensor], name: str):
    def record(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        found[name] = _largest(output)

    return record


@torch.no_grad()
def factors(x_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:  # [in], weight [out, in]
    """s_j, the divisor of input channel j (1 where a channel or its weights are all zero)."""
    w_max = weight.float().abs().amax(dim=0)
    s = x_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)
    return torch.where((x_max > 0) & (w_max > 0), s, torch.ones_like(s))
