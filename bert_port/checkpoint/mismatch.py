"""Why a checkpoint does not fit a model: every missing, unexpected, mis-shaped and mis-typed
tensor in one message, with a hint when the file's LayerNorms are the other arrangement's."""

from __future__ import annotations


def mismatch_message(source, name, tensors, expected, missing, unexpected, mismatched, wrong_kind=()) -> str:
    """Why a checkpoint does not fit a model, every tensor listed (the first 50 of each kind):
    `name` spells a model key as the file does, `tensors` and `expected` map model keys to the
    file's and the model's tensors."""
    limit = 50  # per list: a config or file off by thousands of tensors still gives a readable error

    def listed(keys, describe):
        out = [f"    {describe(k)}" for k in keys[:limit]]
        return out + ([f"    ... and {len(keys) - limit} more"] if len(keys) > limit else [])

    lines = [
        (
            f"cannot load {source}: the checkpoint does not fit the model. "
            "Tensors are named as in the file (-> the port's name, where it differs)."
        )
    ]
    if missing:
        lines.append(f"  missing ({len(missing)}), the model needs these and the checkpoint lacks them:")
        lines += listed(missing, lambda k: f"{name(k)}: expected {tuple(expected[k].shape)}")
    if unexpected:
        lines.append(f"  unexpected ({len(unexpected)}), in the checkpoint but not in the model:")
        lines += listed(unexpected, lambda k: f"{name(k)}: {tuple(tensors[k].shape)}")
    if wrong_kind:
        lines.append(f"  wrong dtype ({len(wrong_kind)}), not castable to what the model holds:")
        lines += listed(wrong_kind, lambda k: f"{name(k)}: checkpoint {tensors[k].dtype}, model {expected[k].dtype}")
    if mismatched:
        lines.append(f"  wrong shape ({len(mismatched)}):")
        lines += listed(
            mismatched,
            lambda k: f"{name(k)}: checkpoint {tuple(tensors[k].shape)}, model {tuple(expected[k].shape)}",
        )
        lines.append(
            "  Shapes come from config.json (hidden_size, vocab_size, intermediate_size, ...): check that "
            "the config belongs to these weights."
        )
    lines += _layer_norm_hint(missing, unexpected)
    lines.append("Nothing was loaded. Check that the checkpoint is a BERT model matching its config.json.")
    return "\n".join(lines)


# Port names (bert.py) of the LayerNorms of each arrangement: post-LN (BERT), pre-LN (Megatron-BERT).
POST_LN_NAMES = {"embed_layer_norm", "attention_layer_norm", "out_layer_norm"}
PRE_LN_NAMES = {"pre_attention_layer_norm", "pre_ffn_layer_norm", "final_layer_norm"}


def _any_named(keys, names: set[str]) -> bool:
    return any(names & set(k.split(".")) for k in keys)


def _layer_norm_hint(missing, unexpected) -> list[str]:
    """What to fix when the file's LayerNorms are those of the other arrangement: the model's
    comes from config.json (`pre_norm`, implied by model_type "megatron-bert")."""
    if _any_named(unexpected, PRE_LN_NAMES) and _any_named(missing, POST_LN_NAMES):
        found, wanted, model_type, pre_norm = "pre-LN (Megatron-BERT)", "post-LN (BERT)", "megatron-bert", True
    elif _any_named(unexpected, POST_LN_NAMES) and _any_named(missing, PRE_LN_NAMES):
        found, wanted, model_type, pre_norm = "post-LN (BERT)", "pre-LN (Megatron-BERT)", "bert", False
    else:
        return []
    hint = (
        f"  The checkpoint's LayerNorms are {found} and the config's are {wanted}: its config.json "
        f'should say "model_type": "{model_type}" (or pass pre_norm={pre_norm}).'
    )
    return [hint]
