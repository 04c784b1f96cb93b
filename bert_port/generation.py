"""Text generation for `BertLMHeadModel`: greedy decoding and sampling (temperature, top-k,
top-p), step by step on a `KVCache`, as transformers' `GenerationMixin.generate` does it.

Each step runs the model on the new token only (the prompt on the first step), the cache
holding every earlier position's keys and values; `use_cache=False` reruns the whole sequence
each step instead, the reference the cache is checked against. Left-padded prompts get
transformers' positions: each row counts from its first real token (the attention mask's
cumulative sum), and the pads are masked out of every step. The filters follow transformers'
logits processors (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` with
`min_tokens_to_keep=1`) operation for operation.

Shapes: B batch, T prompt length, V vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .cache import KVCache

# `model` below is a `heads.BertLMHeadModel`, which binds `generate` as its method: typed as a
# module here, so that generation does not import the heads back.

log = logging.getLogger(__name__)


def top_k_filter(scores: Tensor, top_k: int) -> Tensor:
    """(B, V) scores with all but the `top_k` highest set to -inf (ties at the k-th kept), as
    transformers' `TopKLogitsWarper`."""
    top_k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, top_k)[0][..., -1, None]
    return scores.masked_fill(scores < kth, -float("inf"))


def top_p_filter(scores: Tensor, top_p: float) -> Tensor:
    """(B, V) scores keeping the smallest set of highest-probability tokens whose probabilities
    add up to more than `top_p` (at least one), the rest -inf, as transformers'
    `TopPLogitsWarper`: sorted ascending, a token goes when the mass up to and including it is
    at most 1 - top_p."""
    sorted_scores, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # min_tokens_to_keep=1: the most probable token stays
    remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
    return scores.masked_fill(remove, -float("inf"))


def next_tokens(
    logits: Tensor,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The next token of each row from its (B, V) fp32 logits: the argmax, or with `do_sample`
    a draw from the softmax of the logits divided by `temperature` and filtered by `top_k`
    and `top_p`, in transformers' order, from `generator` (torch's global RNG when None)."""
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits / temperature if temperature != 1.0 else logits
    if top_k:
        scores = top_k_filter(scores, top_k)
    if top_p is not None and top_p < 1.0:
        scores = top_p_filter(scores, top_p)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def as_prompts(batch: Mapping[str, Tensor], drop_sep: bool = True) -> dict[str, Tensor]:
    """Prompts to continue from a right-padded batch (`encode`'s): `input_ids` and
    `attention_mask` (B, T') with each row's real tokens moved to the right end and the pads to
    the left, since generation appends on the right; with `drop_sep`, without the closing
    [SEP], so that generation continues the text rather than start after its end."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lengths = (mask.sum(1) - int(drop_sep)).tolist()
    T = max(lengths)
    out_ids, out_mask = ids.new_zeros(len(lengths), T), mask.new_zeros(len(lengths), T)
    for i, n in enumerate(lengths):
        out_ids[i, T - n :], out_mask[i, T - n :] = ids[i, :n], 1
    return {"input_ids": out_ids, "attention_mask": out_mask}


def _check_arguments(
    model: nn.Module, input_ids: Tensor, max_new_tokens: int, do_sample: bool, temperature: float, top_k, top_p
) -> None:
    """A `ValueError` saying what to change, before any step runs."""
    config = model.config
    if not config.is_decoder:
        raise ValueError(
            "generate needs a causal model, and this config has is_decoder=False (every token attends to later "
            "ones); load it with is_decoder=True, e.g. BertLMHeadModel.from_pretrained(path, is_decoder=True)"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer of at least 1, got {max_new_tokens!r}")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError("input_ids must be a (batch, prompt_length) tensor of token ids, e.g. encode(tok, texts)")
    limit = config.max_position_embeddings
    if input_ids.shape[1] + max_new_tokens > limit:
        room = (
            f"shorten the prompt to at most {limit - max_new_tokens} tokens or ask for fewer new tokens"
            if max_new_tokens < limit
            else f"ask for at most {limit - input_ids.shape[1]} new tokens"
            if input_ids.shape[1] < limit
            else f"shorten the prompt below {limit} tokens"
        )
        raise ValueError(
            f"a prompt of {input_ids.shape[1]} tokens plus max_new_tokens={max_new_tokens} exceeds "
            f"max_position_embeddings={limit}: {room}"
        )
    if not do_sample:  # greedy ignores the sampling settings; transformers warns and goes on
        ignored = {
            "temperature": temperature != 1.0,
            "top_k": top_k not in (None, 50),
            "top_p": top_p not in (None, 1.0),
        }
        if any(ignored.values()):
            log.warning(
                "do_sample=False: %s only apply to sampling and are ignored; pass do_sample=True to use them",
                ", ".join(name for name, set_ in ignored.items() if set_),
            )
        return
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a number above 0, got {temperature!r} (for greedy, do_sample=False)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be a positive integer (or None or 0 for no top-k filter), got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 or None for no top-p filter), got {top_p!r}")


def _check_padding(config, input_ids: Tensor, attention_mask: Tensor | None) -> None:
    """Refuse a row with no real token; warn on right padding (as transformers does): new
    tokens are appended after the pads, so the row continues differently from itself alone.
    `as_prompts` turns `encode`'s right-padded batch into left-padded prompts."""
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} and input_ids {tuple(input_ids.shape)}; "
                "pass the mask of these ids"
            )
        empty = (~attention_mask.bool().any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"row(s) {empty[:10]} of the batch are all padding (attention_mask all 0): nothing to continue; "
                "drop them or give them a prompt"
            )
        right = bool((attention_mask[:, -1] == 0).any())
    else:
        right = config.pad_token_id is not None and input_ids.shape[0] > 1
        right = right and bool((input_ids[:, -1] == config.pad_token_id).any())
    if right:
        log.warning(
            "right padding in the prompts: new tokens would follow the pads, and those rows continue differently "
            "from each alone. Pad on the left: generate(model, **as_prompts(encode(...)))"
        )


def _start_positions(attention_mask: Tensor | None, input_ids: Tensor) -> Tensor:
    """(B, T) positions of the prompt: each row counts from its first real token, pads at 0,
    as transformers' `_prepare_position_ids_for_generation`."""
    if attention_mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def _eos_and_pad(
    config, eos_token_id: int | list[int] | None, pad_token_id: int | None, device: torch.device
) -> tuple[Tensor | None, int | None]:
    """The end-of-sequence ids (the config's when not given; BERT configs usually have none)
    and the id that fills a finished row: `pad_token_id`, else the config's, else the first
    eos, as transformers chooses them."""
    if eos_token_id is None:
        eos_token_id = config.extra.get("eos_token_id")
    if eos_token_id is None:
        return None, pad_token_id
    eos = torch.as_tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    if pad_token_id is None:
        pad_token_id = config.pad_token_id if config.pad_token_id is not None else int(eos[0])
    return eos, pad_token_id


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    use_cache: bool = True,
    token_type_ids: Tensor | None = None,
) -> Tensor:
    """Continue each prompt of `input_ids` (B, T) by up to `max_new_tokens` tokens; returns
    (B, T + new) ids, prompts first, as transformers' `generate`.

    Greedy by default (`do_sample=False`). Sampling draws from `generator`, or from a fresh
    one seeded with `seed`, or from torch's global RNG: the same seed gives the same tokens.
    `top_k` None (transformers' default is 50) and `top_p` None filter nothing.
    `attention_mask` (B, T) marks real tokens: pad prompts on the left. A row that emits one
    of `eos_token_id` (default: the config's, usually none) is finished: its later tokens are
    `pad_token_id` (default the config's, else the first eos), and generation stops when every
    row is finished. `use_cache=False` recomputes the whole sequence at every step.
    """
    _check_arguments(model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p)
    _check_padding(model.config, input_ids, attention_mask)
    if generator is not None and seed is not None:
        raise ValueError("pass generator or seed, not both (a seed makes a new generator)")
    device = model.device
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    eos, pad_token_id = _eos_and_pad(model.config, eos_token_id, pad_token_id, device)
    ids = input_ids.to(device)
    mask = attention_mask.to(device) if attention_mask is not None else None
    if mask is not None and bool(mask.bool().all()):
        mask = None  # no padding: plain causal attention, as transformers drops an all-ones mask
    positions = _start_positions(mask, ids)
    types = token_type_ids.to(device) if token_type_ids is not None else torch.zeros_like(ids)
    cache = KVCache(model.config.num_hidden_layers) if use_cache else None
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=device)
    fresh = ids.shape[1]  # tokens the next forward runs on: the prompt, then one
    for _ in range(max_new_tokens):
        step = slice(-fresh, None) if cache is not None else slice(None)
        out = model(ids[:, step], mask, types[:, step], positions[:, step], cache=cache, logits_to_keep=1)
        new = next_tokens(out.logits[:, -1].float(), do_sample, temperature, top_k, top_p, generator)  # (B,)
        if eos is not None:
            new = torch.where(unfinished, new, pad_token_id)
            unfinished &= ~torch.isin(new, eos)
        ids = torch.cat([ids, new[:, None]], dim=-1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=-1)
        types = torch.cat([types, types[:, -1:]], dim=-1)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        fresh = 1
        if eos is not None and not bool(unfinished.any()):
            break
    return ids
