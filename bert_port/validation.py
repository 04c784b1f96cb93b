"""Input checks for `BertModel.forward`: malformed input is a clear `ValueError` before any
kernel runs, so a bad id never becomes a CUDA device-side assert or silent garbage."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import BertConfig

ID_DTYPES = (torch.long, torch.int32)


def check_inputs(
    config: BertConfig,
    input_ids: Tensor | None,
    attention_mask: Tensor | None,
    token_type_ids: Tensor | None,
    position_ids: Tensor | None,
    inputs_embeds: Tensor | None,
    past_length: int = 0,
) -> None:
    """Raise `ValueError` for input `BertModel.forward` cannot run correctly. `past_length`:
    the positions a `KVCache` already holds, which the new tokens follow (and a 2-D
    `attention_mask` covers too).

    Shapes and dtypes are always checked. The id ranges and the finiteness of `inputs_embeds`
    need the values on the host (a device sync), which `torch.export` and `torch.compile`
    cannot trace: while they trace, those checks are skipped, so an exported program trusts its
    caller's ids and embeddings.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    names = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
    _check_not_meta(dict(zip(names, (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds))))
    B, T = _input_shape(config, input_ids, inputs_embeds)
    if input_ids is not None:
        _check_range("input_ids", input_ids, config.vocab_size, "the vocabulary (vocab_size)")
    longest = config.max_sequence_length  # RoBERTa: pad_token_id + 1 fewer than max_position_embeddings
    offset = config.max_position_embeddings - longest
    if position_ids is None and past_length + T > longest:
        cached = f" after {past_length} cached positions" if past_length else ""
        raise ValueError(
            f"sequence length {T}{cached} exceeds max_position_embeddings={config.max_position_embeddings}"
            + (f" less the {offset} positions up to the padding index" if offset else "")
            + f"; truncate the input (e.g. tokenizer truncation to {longest})"
        )
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[-1] != T or position_ids.shape[0] not in (1, B):
            raise ValueError(f"position_ids must be (batch or 1, {T}), got {tuple(position_ids.shape)}")
        _check_range("position_ids", position_ids, config.max_position_embeddings, "max_position_embeddings")
    if token_type_ids is not None:
        if tuple(token_type_ids.shape) != (B, T):
            raise ValueError(f"token_type_ids shape {tuple(token_type_ids.shape)} does not match input {(B, T)}")
        if config.type_vocab_size:  # none (DistilBERT): a tokenizer's segment ids are not used, as it has none
            _check_range("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size")
    if attention_mask is not None:
        _check_mask(attention_mask, B, T, past_length)


def _check_not_meta(inputs: dict[str, Tensor | None]) -> None:
    for name, tensor in inputs.items():
        if tensor is not None and tensor.is_meta:
            raise ValueError(
                f"{name} is on the meta device, which holds shapes but no values; pass real values on the "
                "model's device (the tokenizer's output, for one)"
            )


def _input_shape(config: BertConfig, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> tuple[int, int]:
    """(B, T) of the one input given; `inputs_embeds` (B, T, H) must also be finite, as the
    weights must be: a NaN there would reach every output of its row without a word."""
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        if input_ids.is_floating_point():
            raise ValueError("input_ids must be integer token ids, got a floating tensor")
        shape = tuple(input_ids.shape)
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.embedding_width:
            raise ValueError(
                f"inputs_embeds must be (batch, seq_len, {config.embedding_width}), got {tuple(inputs_embeds.shape)}"
            )
        shape = tuple(inputs_embeds.shape[:2])
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"empty input of shape {shape}: need at least one sequence of at least one token")
    if inputs_embeds is not None:
        _check_finite(inputs_embeds)
    return shape


def _check_finite(inputs_embeds: Tensor) -> None:
    if not inputs_embeds.is_floating_point():
        raise ValueError(f"inputs_embeds must be a floating tensor, got {inputs_embeds.dtype}")
    if torch.compiler.is_compiling():
        return  # a host-side branch on the values cannot be traced (see check_inputs)
    # One reduction and one device sync, as the weights' check does per tensor.
    if not bool(torch.isfinite(inputs_embeds).all()):
        bad = (~torch.isfinite(inputs_embeds)).nonzero()[0].tolist()
        raise ValueError(
            f"inputs_embeds holds NaN or Inf (first at batch {bad[0]}, token {bad[1]}, feature {bad[2]}); "
            "the model would return NaN for that row. Find where the embeddings were computed and fix them"
        )


def _check_mask(attention_mask: Tensor, B: int, T: int, past_length: int = 0) -> None:
    K = past_length + T  # keys: the cached positions and the new ones
    ok = {2: (B, K), 3: (B, T, K)}.get(attention_mask.dim())
    cached = f" ({past_length} cached positions + {T} new)" if past_length else ""
    if attention_mask.dim() == 4:
        ok_4d = attention_mask.shape[-2:] == (T, K) and attention_mask.shape[0] in (1, B)
        if not ok_4d:
            raise ValueError(
                f"4-D attention_mask must be (batch, 1 or heads, {T}, {K}){cached}, got {tuple(attention_mask.shape)}"
            )
    elif tuple(attention_mask.shape) != ok:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match the input{cached}: expected "
            f"({B}, {K}) (1 = token, 0 = padding) or ({B}, {T}, {K})"
        )


def _check_range(name: str, ids: Tensor, upper: int, what: str) -> None:
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be integer ids (torch.long), got {ids.dtype}")
    if ids.dtype not in ID_DTYPES:  # an embedding lookup takes int64 or int32 indices only
        raise ValueError(f"{name} must be torch.long (or torch.int32) ids, got {ids.dtype}; convert it with .long()")
    if torch.compiler.is_compiling():
        return  # min/max on the host would be a data-dependent branch in the traced graph
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{name} contains {bad}, outside [0, {upper}) of {what}; check the tokenizer matches the model"
        )
