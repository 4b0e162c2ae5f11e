"""Load a model named on the command line: ``hf:<model_type>``, ``config.json``, ``file.py:factory``,
``package.module:factory``; and make inputs for it.

    model, args, kwargs = load_target("hf:llama", device="meta", layers=2)
    model(*args, **kwargs)

- ``hf:<model_type>``: a transformers config with its real default sizes (``AutoConfig.for_model``),
  built with ``AutoModel.from_config``; ``device="meta"`` builds it on the meta device, so a
  70B-shaped model takes no memory. ``layers`` and ``overrides`` change config fields.
- a path to a local ``config.json`` (or a folder holding one): the same, from that file.
- ``file.py:factory`` / ``package.module:factory``: ``factory(**overrides)`` returns a model, or
  ``(model, example_args)`` where example_args is a tuple of positional inputs, a dict of keyword
  inputs, or ``(args_tuple, kwargs_dict)``.

Every bad target raises ``normfuse.errors.TargetError`` saying what is wrong and what to do.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
from typing import Any

import torch
import torch.nn as nn

from normfuse.errors import TargetError, closest
from normfuse.zoo import prepare_torchvision

__all__ = ["load_target", "is_config_target", "make_inputs", "default_seq", "parse_overrides", "parse_dtype", "hf_model_types",
           "LAYER_FIELDS"]

# config fields that hold a layer count; --layers sets every one the config has
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers",
                "decoder_layers", "n_layers")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def parse_dtype(dtype: Any) -> torch.dtype | None:
    """``torch.bfloat16``, ``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` -> torch.bfloat16; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise TargetError(f"unknown dtype {dtype!r}.{closest(name, _DTYPES)} Use one of: {', '.join(_DTYPES)}.")
    return _DTYPES[name]


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["hidden_size=8192", "tie_word_embeddings=false"]`` -> ``{"hidden_size": 8192, ...}``.

    Values are read as Python/JSON literals (ints, floats, booleans, lists, None); anything
    else stays a string.
    """
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TargetError(f"--set takes key=value, got {item!r}. Example: --set num_hidden_layers=4.")
        out[key.strip()] = _parse_value(value)
    return out


def hf_model_types() -> list[str]:
    """Every model type transformers knows (``transformers.CONFIG_MAPPING``)."""
    prepare_torchvision()  # before transformers imports a torchvision that cannot load its extension
    from transformers import CONFIG_MAPPING

    return sorted(CONFIG_MAPPING.keys())


# --------------------------------------------------------------------------- transformers configs

def _hf_config_for_type(model_type: str):
    from transformers import AutoConfig

    known = hf_model_types()
    if model_type not in known:
        import difflib
        near = difflib.get_close_matches(model_type, known, n=5, cutoff=0.5)
        hint = f" Closest known: {', '.join(near)}." if near else ""
        raise TargetError(f"unknown transformers model type {model_type!r}.{hint} "
                          "Run `python -c \"import transformers; print(sorted(transformers.CONFIG_MAPPING))\"` "
                          "for the full list.")
    return AutoConfig.for_model(model_type)


def _hf_config_from_file(path: str):
    prepare_torchvision()
    from transformers import AutoConfig

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise TargetError(f"no such file: {file!r}. Give the path of a transformers config.json "
                          "(or the folder that holds it).")
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise TargetError(f"cannot read {file!r} as JSON: {error}. Give a transformers config.json.") from error
    model_type = data.pop("model_type", None) if isinstance(data, dict) else None
    if not model_type:
        raise TargetError(f"{file!r} has no \"model_type\" field, so it is not a transformers config. "
                          "Add \"model_type\": \"<type>\" (e.g. \"llama\") or use a file.py:factory target.")
    _hf_config_for_type(model_type)  # same message for an unknown type
    return AutoConfig.for_model(model_type, **data)


def _configure(config, layers: int | None, overrides: dict[str, Any]):
    if layers is not None:
        if not isinstance(layers, int) or layers < 1:
            raise TargetError(f"--layers must be a positive integer, got {layers!r}.")
        fields = [f for f in LAYER_FIELDS if hasattr(config, f)]
        if not fields:
            raise TargetError(f"{type(config).__name__} has none of the layer-count fields {LAYER_FIELDS}; "
                              "set the right one with --set <field>=N.")
        for f in fields:
            setattr(config, f, layers)
    known = set(config.to_dict()) | {k for k in dir(config) if not k.startswith("_")}
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise TargetError(f"{type(config).__name__} has no field {key!r}.{closest(key, known)} "
                              "--set only changes fields the config already has.")
        setattr(config, key, value)
    if layers is not None or any(k in LAYER_FIELDS for k in overrides):
        # per-layer lists sized for the default depth (layer_types, ...) would no longer fit
        if getattr(config, "layer_types", None) is not None and "layer_types" not in overrides:
            n = next((getattr(config, f) for f in LAYER_FIELDS if hasattr(config, f)), None)
            if n is not None and len(config.layer_types) != n:
                config.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(n)]
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def _build_hf(config, dtype: torch.dtype | None, device: str) -> nn.Module:
    from transformers import AutoModel

    try:
        with torch.device(device):
            model = AutoModel.from_config(config, dtype=dtype or torch.float32)
    except Exception as error:  # noqa: BLE001 - a bad override surfaces here
        raise TargetError(f"transformers could not build {type(config).__name__} "
                          f"(model_type {config.model_type!r}): {type(error).__name__}: {error}. "
                          "Check the --set/--layers values against the config's own constraints.") from error
    return model.eval()


# --------------------------------------------------------------------------- factories

def _load_factory(spec: str):
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise TargetError(f"cannot read target {spec!r}. Use hf:<model_type>, path/to/config.json, "
                          "file.py:factory or package.module:factory.")
    if where.endswith(".py") or os.sep in where or "/" in where:
        if not os.path.isfile(where):
            raise TargetError(f"no such file: {where!r} (from target {spec!r}). Check the path; it is read "
                              f"relative to {os.getcwd()!r}.")
        mod_name = "_normfuse_target_" + os.path.splitext(os.path.basename(where))[0]
        loader_spec = importlib.util.spec_from_file_location(mod_name, os.path.abspath(where))
        module = importlib.util.module_from_spec(loader_spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        try:
            loader_spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001
            raise TargetError(f"importing {where!r} failed: {type(error).__name__}: {error}") from error
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as error:
            raise TargetError(f"no module named {where!r} (from target {spec!r}): {error}. Install it or put it "
                              "on PYTHONPATH, or give a file path: path/to/file.py:factory.") from error
        except Exception as error:  # noqa: BLE001
            raise TargetError(f"importing {where!r} failed: {type(error).__name__}: {error}") from error
    factory = getattr(module, name, None)
    if factory is None:
        names = [n for n in dir(module) if not n.startswith("_")]
        raise TargetError(f"{where!r} has no attribute {name!r}.{closest(name, names)}")
    if not callable(factory):
        raise TargetError(f"{where}:{name} is a {type(factory).__name__}, not a callable returning a model.")
    return factory


def _split_example(example: Any) -> tuple[tuple, dict]:
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, tuple) and len(example) == 2 and isinstance(example[0], (tuple, list)) \
            and isinstance(example[1], dict):
        return tuple(example[0]), dict(example[1])
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def _to(value: Any, device: str, dtype: torch.dtype | None) -> Any:
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value


# config fields that bound the sequence length a model takes
MAX_SEQ_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


def default_seq(model: nn.Module, cap: int = 2048) -> int:
    """``cap``, or the model's maximum sequence length when that is shorter."""
    from normfuse import zoo

    if isinstance(model, zoo.ToyTransformer):
        return min(cap, model.pos.num_embeddings)
    config = getattr(model, "config", None)
    limits = [getattr(config, f) for f in MAX_SEQ_FIELDS if isinstance(getattr(config, f, None), int)]
    return min([cap, *[n for n in limits if n > 0]])


def make_inputs(model: nn.Module, batch: int = 2, seq: int | None = 8) -> tuple[tuple, dict]:
    """Inputs for a model that came without any: token ids, pixel values or audio features for a
    transformers model, token ids for a ``zoo.ToyTransformer``. ``seq=None``: ``default_seq(model)``."""
    from normfuse import zoo

    seq = default_seq(model) if seq is None else seq

    if isinstance(model, zoo.ToyTransformer):
        vocab, max_len = model.tok.num_embeddings, model.pos.num_embeddings
        if seq > max_len:
            raise TargetError(f"seq={seq} is longer than the ToyTransformer's max_len={max_len}; lower --seq.")
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, vocab, (batch, seq), generator=g).to(model.tok.weight.device),), {}
    if not hasattr(getattr(model, "config", None), "to_dict"):
        raise TargetError(f"cannot make inputs for a {type(model).__name__}: only transformers models and "
                          "zoo.ToyTransformer get them made. Return (model, example_args) from the factory.")
    if not any(True for _ in model.parameters()):
        raise TargetError(f"{type(model).__name__} has no parameters to take a device and dtype from; "
                          "return (model, example_args) from the factory.")
    return (), zoo.example_inputs(model, batch=batch, seq=seq)


# --------------------------------------------------------------------------- entry point

def is_config_target(spec: str) -> bool:
    """Whether ``spec`` names a transformers config (``hf:<type>``, a config.json or its folder)
    rather than a factory."""
    spec = spec.strip()
    return spec.startswith("hf:") or spec.endswith(".json") or os.path.isdir(spec)


def load_target(spec: str, *, layers: int | None = None, overrides: dict[str, Any] | None = None,
                dtype: Any = None, device: str = "cpu", batch: int = 2, seq: int | None = 8
                ) -> tuple[nn.Module, tuple, dict]:
    """``(model, args, kwargs)`` for a target; ``model(*args, **kwargs)`` runs it.

    spec:      ``hf:<model_type>`` | path to ``config.json`` (or its folder) | ``file.py:factory`` |
               ``package.module:factory``.
    layers:    set the layer count of a transformers config.
    overrides: config fields to change (hf and config.json targets) or keyword arguments of the
               factory (factory targets).
    dtype:     parameters and floating inputs in this dtype (``torch.bfloat16`` or ``"bf16"``).
    device:    ``"cpu"``, or ``"meta"`` to build without memory (shapes and dtypes only).
    batch/seq: sizes of the inputs made for the model (``seq=None``: up to 2048 tokens, fewer when
               the model's maximum sequence length is shorter).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TargetError(f"a target is a non-empty string, got {spec!r}. Use hf:<model_type>, "
                          "path/to/config.json, file.py:factory or package.module:factory.")
    if batch < 1 or (seq is not None and seq < 1):
        raise TargetError(f"batch and seq must be positive, got batch={batch}, seq={seq}.")
    spec = spec.strip()
    overrides = dict(overrides or {})
    dtype = parse_dtype(dtype)
    prepare_torchvision()  # hf targets and factories alike may import transformers
    if is_config_target(spec):
        if spec.startswith("hf:"):
            config = _hf_config_for_type(spec[3:].strip())
        else:
            config = _hf_config_from_file(spec)
        model = _build_hf(_configure(config, layers, overrides), dtype, device)
        args, kwargs = make_inputs(model, batch, seq)
        return model, args, kwargs

    factory = _load_factory(spec)
    if layers is not None:
        raise TargetError("--layers applies to hf:<model_type> and config.json targets; for a factory, pass "
                          "its own argument with --set (e.g. --set depth=4).")
    try:
        with torch.device(device):
            made = factory(**overrides)
    except TypeError as error:
        raise TargetError(f"calling {spec} failed: TypeError: {error}. --set passes keyword arguments "
                          "to the factory; check its signature.") from error
    except Exception as error:  # noqa: BLE001 - show the user's error as it is
        raise TargetError(f"the factory {spec} raised {type(error).__name__}: {error}") from error
    example = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        made, example = made
    if not isinstance(made, nn.Module):
        raise TargetError(f"{spec} returned a {type(made).__name__}; a factory returns an nn.Module or "
                          "(model, example_args).")
    model = made.eval()
    if dtype is not None:
        model = model.to(dtype)
    if device != "cpu":
        model = model.to(device)
    if example is None:
        args, kwargs = make_inputs(model, batch, seq)
    else:
        args, kwargs = _split_example(example)
        args, kwargs = _to(args, device, dtype), _to(kwargs, device, dtype)
    return model, args, kwargs
