"""What `from_pretrained` accepts: transformers' loader arguments it refuses and why
(`UNSUPPORTED_LOADER_ARGUMENTS`, `LoaderArgumentError`), the dtype and `device_map`
arguments, and config overrides. Every check here runs before the weights are read.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from .config import RUNTIME_OPTIONS, BertConfig
from .devices import resolve_device
from .speed.quantization import check_quantization

if TYPE_CHECKING:
    from .base_bert import BertPreTrainedModel
    from .checkpoint import CheckpointFiles

CHECK_FINITE_MODES = ("error", "warn", "ignore")

_NO_NETWORK = "the port never uses the network: it reads local folders and the local HF cache only"
_ONE_DEVICE = "the port keeps the whole model on one device (pass device= or device_map='cuda:0')"
_NO_QUANTISATION = (
    "transformers' quantisation backends are not supported; pass quantization='int8' for the port's own int8 "
    "inference on the CPU, or load in floating point (dtype=torch.float16, ...)"
)
_NOT_TORCH = "only PyTorch (.bin) and safetensors weights are read; convert the weights with transformers first"
# transformers' from_pretrained arguments the port does not take, and why: a user passing them
# is told so, not to check the spelling.
UNSUPPORTED_LOADER_ARGUMENTS = {
    "token": _NO_NETWORK,
    "use_auth_token": _NO_NETWORK,
    "force_download": _NO_NETWORK,
    "resume_download": _NO_NETWORK,
    "proxies": _NO_NETWORK,
    "mirror": _NO_NETWORK,
    "trust_remote_code": "the port runs only its own BERT code, never code shipped with a checkpoint",
    "low_cpu_mem_usage": (
        "there is nothing to switch: loading always builds the model on the meta device and adopts the "
        "checkpoint's tensors, without a second copy"
    ),
    "subfolder": "pass the subfolder's path itself as the checkpoint",
    "from_tf": _NOT_TORCH,
    "from_flax": _NOT_TORCH,
    "use_safetensors": "the loader takes model.safetensors when there is one, else pytorch_model.bin",
    "variant": "variant weight files (model.fp16.safetensors) are not looked for; pass the weights file itself",
    "quantization_config": _NO_QUANTISATION,
    "load_in_8bit": _NO_QUANTISATION,
    "load_in_4bit": _NO_QUANTISATION,
    "max_memory": _ONE_DEVICE,
    "offload_folder": _ONE_DEVICE,
    "offload_state_dict": _ONE_DEVICE,
    "offload_buffers": _ONE_DEVICE,
    "tp_plan": _ONE_DEVICE,
    "key_mapping": "checkpoint names are mapped by the port's own key table (bert_port.checkpoint.keys)",
    # The port's own former options, now bert_port.speed's.
    "unpad_inputs": "speed left the config: pass optimize=False for the plain model of bert.py (the padded path)",
}


class LoaderArgumentError(TypeError):
    """A keyword argument `from_pretrained` does not take: transformers loader arguments the
    port does not support (each said why), or names that are neither an argument nor a config
    field (`unknown`). `named` gives the same error for a caller's own from_pretrained."""

    def __init__(self, owner: str, unsupported: list[str], unknown: list[str], arguments: Iterable[str]):
        self.owner, self.unsupported, self.unknown = owner, unsupported, unknown
        self.arguments = sorted(set(arguments))
        parts = [f"{owner}() does not support {k}=: {UNSUPPORTED_LOADER_ARGUMENTS[k]}" for k in unsupported]
        if unknown:
            parts.append(
                f"{owner}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: not a "
                f"from_pretrained argument ({', '.join(self.arguments)}), nor a field of BertConfig or of the "
                "checkpoint's config.json; check the spelling"
            )
        super().__init__("; ".join(parts))

    def named(self, owner: str, arguments: Iterable[str] = ()) -> LoaderArgumentError:
        return LoaderArgumentError(owner, self.unsupported, self.unknown, [*self.arguments, *arguments])


def refuse_unsupported(cls: type[BertPreTrainedModel], kwargs: dict) -> None:
    """A `LoaderArgumentError` naming each transformers loader argument in `kwargs` that the
    port does not support, and why."""
    unsupported = [k for k in kwargs if k in UNSUPPORTED_LOADER_ARGUMENTS]
    if unsupported:
        raise LoaderArgumentError(f"{cls.__name__}.from_pretrained", unsupported, [], argument_names(cls))


def check_finite_mode(mode: str) -> None:
    if mode not in CHECK_FINITE_MODES:
        raise ValueError(f"check_finite must be one of {CHECK_FINITE_MODES}, got {mode!r}")


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A floating dtype from `torch.float16`, `"float16"`, `"torch.float16"`, or None /
    `"auto"` for the checkpoint's own (as transformers accepts them). Anything else is a
    `ValueError`, raised before a file is read or a tensor is touched."""
    if dtype is None or dtype == "auto":
        return None
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(
            f"dtype must be a floating torch dtype (torch.float32, 'float16', 'bfloat16', ...) or 'auto', "
            f"got {dtype!r}: BERT's weights are floating point"
        )
    return resolved


def resolve_dtypes(dtype: torch.dtype | str | None, torch_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`dtype`, or transformers' older name for it, `torch_dtype`; both given must agree."""
    if torch_dtype is None:
        return resolve_dtype(dtype)
    if dtype is not None and resolve_dtype(dtype) != resolve_dtype(torch_dtype):
        raise ValueError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree; pass only dtype")
    return resolve_dtype(torch_dtype)


def resolve_device_map(device: str | torch.device | None, device_map: object) -> torch.device | None:
    """transformers' `device_map` when it names one device (`"cuda:0"`, `0`, `torch.device`,
    `{"": "cuda:0"}`, or `"auto"`: the accelerator when there is one, else the CPU), parsed by
    `devices.resolve_device`; this port holds a model on one device, so a map over several is
    a `ValueError`."""
    if device_map is None:
        return resolve_device(device)
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if isinstance(device_map, dict):
        # A dict is a valid device_map; what it asks for (several devices) is not supported.
        raise ValueError(  # noqa: TRY004
            f"device_map {device_map!r} spreads the model over several devices; this port keeps a model on "
            "one device: pass one device, e.g. device_map='cuda:0' or device='cpu'"
        )
    resolved = resolve_device(device_map, what="device_map")
    if device is not None and resolve_device(device) != resolved:
        raise ValueError(f"device={device!r} and device_map={device_map!r} disagree; pass only one of them")
    return resolved


def resolve_quantization(
    quantization: str | None, dtype: torch.dtype | None, device: torch.device | None
) -> str | None:
    """`quantization` (None or "int8", `quantization.check_quantization`), checked against the
    dtype and device asked for: int8 runs on the CPU, from float32 weights."""
    check_quantization(quantization)
    if quantization is None:
        return None
    if device is not None and device.type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU, not on {device}: drop device= (or pass device='cpu'), "
            "or load in floating point for the GPU (e.g. dtype=torch.bfloat16)"
        )
    if dtype is not None and dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} quantizes the float32 weights and runs in float32 between the int8 "
            f"matmuls; dtype={str(dtype).removeprefix('torch.')} cannot go with it: drop dtype= or pass torch.float32"
        )
    return quantization


def init_kwarg_names(cls: type[BertPreTrainedModel]) -> set[str]:
    """The keyword arguments of the model's constructor (`add_pooling_layer`, ...)."""
    return set(inspect.signature(cls.__init__).parameters) - {"self", "config"}


def argument_names(cls: type[BertPreTrainedModel]) -> set[str]:
    """The keyword arguments `from_pretrained` takes: its own and the constructor's."""
    own = inspect.signature(cls.from_pretrained).parameters  # bound: `cls` is not among them
    return {n for n, p in own.items() if p.kind == p.KEYWORD_ONLY} | init_kwarg_names(cls)


def resolve_config(
    cls: type[BertPreTrainedModel], files: CheckpointFiles, config: BertConfig | None, overrides: dict
) -> BertConfig:
    """The config to build with: `config`, or the checkpoint's config.json, with `overrides`
    applied. A keyword that is neither a config field (BertConfig's, or one the checkpoint's
    config.json has) nor an argument is a `LoaderArgumentError`: transformers refuses those
    too, and keeping them would write a typo into config.json."""
    unknown = [k for k in overrides if k not in BertConfig.field_names()]
    if unknown:
        known = config if config is not None else BertConfig.from_json_file(files.config_file)
        unknown = [k for k in unknown if k not in known.extra]
    if unknown:
        raise LoaderArgumentError(f"{cls.__name__}.from_pretrained", [], unknown, argument_names(cls))
    if config is None:
        return BertConfig.from_json_file(files.config_file, **overrides)
    if not overrides:
        return config
    runtime = {name: getattr(config, name) for name in RUNTIME_OPTIONS}
    return BertConfig.from_dict(config.to_dict(), **{**runtime, **overrides})
