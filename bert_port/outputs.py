"""`ModelOutput`: what the models return, a dict whose keys are also attributes."""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree


class ModelOutput(dict):
    """A dict whose keys are also attributes: `out["pooler_output"]` or `out.pooler_output`.
    An integer or slice indexes the values that are not None, in order, as transformers'
    `ModelOutput` does, so `model(ids)[0]` is the last hidden state."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            return self.to_tuple()[key]
        return super().__getitem__(key)

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(v for v in self.values() if v is not None)

    def returned(self, return_dict: bool | None) -> ModelOutput | tuple[Any, ...]:
        """What a forward returns: this output, or for `return_dict=False` the tuple of its
        values that are not None, as transformers' models do."""
        return self.to_tuple() if return_dict is False else self


# torch.export and torch.onnx.export flatten a model's outputs with pytree, which knows
# `dict` but not its subclasses; transformers registers its ModelOutput the same way.
def _flatten(out: ModelOutput) -> tuple[list[Any], list[str]]:
    return list(out.values()), list(out.keys())


def _flatten_with_keys(out: ModelOutput) -> tuple[list[tuple[pytree.MappingKey, Any]], list[str]]:
    return [(pytree.MappingKey(k), v) for k, v in out.items()], list(out.keys())


def _unflatten(values: list[Any], keys: list[str]) -> ModelOutput:
    return ModelOutput(zip(keys, values))


pytree.register_pytree_node(
    ModelOutput,
    _flatten,
    _unflatten,
    serialized_type_name=f"{__name__}.ModelOutput",
    flatten_with_keys_fn=_flatten_with_keys,
)
