"""Load a model named on the command line: ``hf:<model_type>``, ``config.json``, ``file.py:factory``,
``package.module:factory``; and make inputs for it.

    model, args, kwargs = load_target("hf:llama", device="meta", layers=2)
    model(*args, **kwargs)

- ``hf:<model_type>``: a transformers config with its real default sizes (``AutoConfig.for_model``),
  built with ``AutoModel.from_config``; ``device="meta"`` builds it on the meta device, so a
  70B-shaped model takes no memory. ``layers`` and ``overrides`` change config fields.
- a path to a local ``config.json`` (or a folder holding one): the same, from that file.
- ``diffusers:<ClassName>``: a diffusers transformer (``diffusers:FluxTransformer2DModel``) at its class's
  default config (the real sizes), built on the meta device; ``seq`` is the image-token count, the
  inputs are made per family from the config and ``forward``'s signature (``DIFFUSERS_FAMILIES``).
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
           "LAYER_FIELDS", "DIFFUSERS_FAMILIES", "DIFFUSERS_LAYER_FIELDS", "DIFFUSERS_TEXT_TOKENS", "DIFFUSERS_IMAGE_TOKENS",
           "diffusers_classes"]

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


def _check_layers(layers: Any) -> None:
    if not isinstance(layers, int) or layers < 1:
        raise TargetError(f"--layers must be a positive integer, got {layers!r}.")


def _configure(config, layers: int | None, overrides: dict[str, Any]):
    if layers is not None:
        _check_layers(layers)
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


# --------------------------------------------------------------------------- diffusers transformers

# __init__ parameters of a diffusers transformer that hold a layer count; --layers sets every one it takes
DIFFUSERS_LAYER_FIELDS = ("num_layers", "n_layers", "num_single_layers", "num_refiner_layers", "n_refiner_layers",
                          "num_mmdit_layers", "num_single_dit_layers")
DIFFUSERS_TEXT_TOKENS = 512     # text tokens of the made prompt (CogVideoX: its max_text_seq_length)
DIFFUSERS_IMAGE_TOKENS = 4096   # image tokens when --seq is not given (a 1024x1024 image at 16x16 pixels a token)

# class -> family: how its inputs are made (``_diffusers_inputs``). Latent layouts: "tokens" (B, S, C) packed by
# the pipeline; "image" (B, C, H, W); "video" (B, C, F, H, W); CogVideoX's (B, F, C, H, W).
DIFFUSERS_FAMILIES = {
    "DiTTransformer2DModel": "dit", "PixArtTransformer2DModel": "pixart", "SD3Transformer2DModel": "sd3",
    "FluxTransformer2DModel": "flux", "Flux2Transformer2DModel": "flux2", "WanTransformer3DModel": "wan",
    "CogVideoXTransformer3DModel": "cogvideox", "LTXVideoTransformer3DModel": "ltx",
    "HunyuanVideoTransformer3DModel": "hunyuan_video", "SanaTransformer2DModel": "sana",
    "QwenImageTransformer2DModel": "qwen_image", "ZImageTransformer2DModel": "z_image",
    "ChromaTransformer2DModel": "chroma", "SkyReelsV2Transformer3DModel": "wan",
    "AuraFlowTransformer2DModel": "auraflow", "CogView4Transformer2DModel": "cogview4",
}


def diffusers_classes() -> list[str]:
    """The transformer classes diffusers exports (``diffusers.*Transformer*``)."""
    prepare_torchvision()  # diffusers imports peft, which imports transformers, which imports torchvision
    import diffusers

    return sorted(n for n in dir(diffusers) if "Transformer" in n and n[0].isupper())


def _diffusers_class(name: str):
    try:
        import diffusers  # noqa: F401
    except ImportError as error:
        raise TargetError(f"diffusers:{name} needs diffusers: pip install diffusers ({error}).") from error
    known = diffusers_classes()
    if name not in known:
        raise TargetError(f"diffusers has no transformer class {name!r}.{closest(name, known)} "
                          f"Its transformers: {', '.join(known)}.")
    if name not in DIFFUSERS_FAMILIES:
        raise TargetError(f"no inputs are made for diffusers:{name} yet (made for: "
                          f"{', '.join(DIFFUSERS_FAMILIES)}). Use a file.py:factory target returning "
                          "(model, example_kwargs).")
    import diffusers

    return getattr(diffusers, name)


def _diffusers_config(cls, layers: int | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The class's default config (its ``__init__`` defaults: the released model's sizes), changed."""
    import inspect

    params = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
              if k != "self" and p.default is not inspect.Parameter.empty}
    config: dict[str, Any] = {}
    if layers is not None:
        _check_layers(layers)
        fields = [f for f in DIFFUSERS_LAYER_FIELDS if f in params]
        if not fields:
            raise TargetError(f"{cls.__name__} takes none of the layer-count arguments {DIFFUSERS_LAYER_FIELDS}; "
                              "set the right one with --set <argument>=N.")
        config.update({f: layers for f in fields})
    for key, value in overrides.items():
        if key not in params:
            raise TargetError(f"{cls.__name__} takes no argument {key!r}.{closest(key, params)} "
                              "--set only changes arguments of the class's __init__.")
        config[key] = value
    return config


def _grid(tokens: int) -> tuple[int, int]:
    """(h, w) with h * w == tokens, as square as the count allows."""
    h = max(d for d in range(1, int(tokens ** 0.5) + 1) if tokens % d == 0)
    return h, tokens // h


def _diffusers_inputs(family: str, model: nn.Module, batch: int, seq: int, device: str,
                      dtype: torch.dtype) -> dict[str, Any]:
    """Keyword inputs of ``model.forward`` for ``seq`` image tokens (one latent frame for a video model),
    ``DIFFUSERS_TEXT_TOKENS`` text tokens, each tensor made from the config's sizes; the guidance
    scale too where the model embeds one."""
    made = _family_inputs(family, model, batch, seq, device, dtype)
    if family in _GUIDED and model.config.guidance_embeds:
        made["guidance"] = torch.full((batch,), 500.0, device=device, dtype=dtype)
    return made


_GUIDED = frozenset({"flux", "flux2", "hunyuan_video", "sana", "qwen_image"})  # configs with guidance_embeds
# families whose learned positions bound the image tokens: the most a config takes
_MOST_TOKENS = {"auraflow": lambda c: c.pos_embed_max_size}


def _family_inputs(family: str, model: nn.Module, batch: int, seq: int, device: str,
                   dtype: torch.dtype) -> dict[str, Any]:
    """The inputs ``_diffusers_inputs`` makes for one family, before the guidance scale."""
    c = model.config
    h, w = _grid(seq)
    text = DIFFUSERS_TEXT_TOKENS

    def x(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, device=device, dtype=dtype)

    def ints(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, device=device, dtype=torch.long)

    def steps() -> torch.Tensor:
        return torch.full((batch,), 500.0, device=device, dtype=dtype)

    def patch(p: Any) -> tuple[int, int, int]:
        return tuple(p) if isinstance(p, (tuple, list)) else (1, p, p)

    if family == "dit":
        p = c.patch_size
        return dict(hidden_states=x(batch, c.in_channels, h * p, w * p), timestep=ints(batch),
                    class_labels=ints(batch))
    if family == "pixart":
        p = c.patch_size
        cond = dict(resolution=None, aspect_ratio=None)
        if model.use_additional_conditions:
            cond = dict(resolution=x(batch, 2), aspect_ratio=x(batch, 1))
        return dict(hidden_states=x(batch, c.in_channels, h * p, w * p),
                    encoder_hidden_states=x(batch, text, c.caption_channels or c.cross_attention_dim),
                    timestep=ints(batch), added_cond_kwargs=cond)
    if family == "sd3":
        p = c.patch_size
        return dict(hidden_states=x(batch, c.in_channels, h * p, w * p),
                    encoder_hidden_states=x(batch, text, c.joint_attention_dim),
                    pooled_projections=x(batch, c.pooled_projection_dim), timestep=steps())
    if family == "flux":
        made = dict(hidden_states=x(batch, seq, c.in_channels), encoder_hidden_states=x(batch, text, c.joint_attention_dim),
                    pooled_projections=x(batch, c.pooled_projection_dim), timestep=steps(),
                    img_ids=x(seq, 3), txt_ids=x(text, 3))
        return made
    if family == "chroma":  # Flux's inputs, without the pooled projection (its modulation is distilled)
        return dict(hidden_states=x(batch, seq, c.in_channels), encoder_hidden_states=x(batch, text, c.joint_attention_dim),
                    timestep=steps(), img_ids=x(seq, 3), txt_ids=x(text, 3))
    if family == "auraflow":
        p = c.patch_size
        return dict(hidden_states=x(batch, c.in_channels, h * p, w * p),
                    encoder_hidden_states=x(batch, text, c.joint_attention_dim), timestep=steps())
    if family == "cogview4":
        p = c.patch_size
        size = torch.tensor([[h * p * 8, w * p * 8]] * batch, device=device)
        return dict(hidden_states=x(batch, c.in_channels, h * p, w * p),
                    encoder_hidden_states=x(batch, text, c.text_embed_dim), timestep=steps(),
                    original_size=size, target_size=size, crop_coords=torch.zeros_like(size))
    if family == "flux2":
        axes = len(c.axes_dims_rope)
        made = dict(hidden_states=x(batch, seq, c.in_channels), encoder_hidden_states=x(batch, text, c.joint_attention_dim),
                    timestep=steps(), img_ids=ints(batch, seq, axes), txt_ids=ints(batch, text, axes))
        return made
    if family == "wan":
        pt, ph, pw = patch(c.patch_size)
        made = dict(hidden_states=x(batch, c.in_channels, pt, h * ph, w * pw), timestep=steps(),
                    encoder_hidden_states=x(batch, text, c.text_dim))
        if c.image_dim is not None:  # image-to-video: the CLIP image tokens
            made["encoder_hidden_states_image"] = x(batch, 257, c.image_dim)
        return made
    if family == "cogvideox":
        pt = c.patch_size_t or 1
        return dict(hidden_states=x(batch, pt, c.in_channels, h * c.patch_size, w * c.patch_size),
                    encoder_hidden_states=x(batch, c.max_text_seq_length, c.text_embed_dim), timestep=ints(batch))
    if family == "ltx":
        return dict(hidden_states=x(batch, seq, c.in_channels), encoder_hidden_states=x(batch, text, c.caption_channels),
                    timestep=ints(batch), encoder_attention_mask=torch.ones(batch, text, device=device, dtype=torch.bool),
                    num_frames=1, height=h, width=w)  # the token grid (its RoPE counts tokens)
    if family == "hunyuan_video":
        made = dict(hidden_states=x(batch, c.in_channels, c.patch_size_t, h * c.patch_size, w * c.patch_size),
                    timestep=steps(), encoder_hidden_states=x(batch, text, c.text_embed_dim),
                    encoder_attention_mask=torch.ones(batch, text, device=device, dtype=dtype),
                    pooled_projections=x(batch, c.pooled_projection_dim))
        return made
    if family == "sana":
        p = c.patch_size
        made = dict(hidden_states=x(batch, c.in_channels, h * p, w * p),
                    encoder_hidden_states=x(batch, text, c.caption_channels), timestep=steps())
        return made
    if family == "qwen_image":
        made = dict(hidden_states=x(batch, seq, c.in_channels), encoder_hidden_states=x(batch, text, c.joint_attention_dim),
                    encoder_hidden_states_mask=None, timestep=steps(), img_shapes=[(1, h, w)] * batch)
        return made
    if family == "z_image":
        p, pf = c.all_patch_size[0], c.all_f_patch_size[0]
        return dict(x=[x(c.in_channels, pf, h * p, w * p) for _ in range(batch)],
                    cap_feats=[x(text, c.cap_feat_dim) for _ in range(batch)], t=steps(),
                    patch_size=p, f_patch_size=pf)
    raise TargetError(f"no inputs are made for the diffusers family {family!r}.")


def _load_diffusers(name: str, layers: int | None, overrides: dict[str, Any], dtype: torch.dtype | None,
                    device: str, batch: int, seq: int | None) -> tuple[nn.Module, tuple, dict]:
    cls = _diffusers_class(name)
    config = _diffusers_config(cls, layers, overrides)
    try:
        with torch.device(device):
            model = cls(**config)
    except Exception as error:  # noqa: BLE001 - a bad override surfaces here
        raise TargetError(f"diffusers could not build {name}({', '.join(f'{k}={v!r}' for k, v in config.items())}): "
                          f"{type(error).__name__}: {error}. Check the --set/--layers values.") from error
    dtype = dtype or torch.float32
    # as from_pretrained(torch_dtype=dtype) loads it: the modules the class keeps in fp32 stay fp32 (Wan's
    # norms, time embedder and modulation table); nn.Module.to, since ModelMixin.to warns about exactly that
    nn.Module.to(model, dtype)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for key, param in model.named_parameters():
        if any(m in key.split(".") for m in keep):
            param.data = param.data.to(torch.float32)
    model = model.eval()
    family = DIFFUSERS_FAMILIES[name]
    most = _MOST_TOKENS[family](model.config) if family in _MOST_TOKENS else None
    tokens = DIFFUSERS_IMAGE_TOKENS if seq is None else seq
    if most is not None and tokens > most:
        if seq is not None:
            raise TargetError(f"{name} embeds at most {most} image tokens (its learned positions); pass --seq {most} "
                              f"or fewer.")
        tokens = most  # the default count, as many as the model takes
    kwargs = _diffusers_inputs(family, model, batch, tokens, device, dtype)
    kwargs["return_dict"] = False
    return model, (), kwargs


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
    """Whether ``spec`` names a model config at its real sizes (``hf:<type>``, a config.json or its
    folder, ``diffusers:<ClassName>``) rather than a factory."""
    spec = spec.strip()
    return spec.startswith(("hf:", "diffusers:")) or spec.endswith(".json") or os.path.isdir(spec)


def load_target(spec: str, *, layers: int | None = None, overrides: dict[str, Any] | None = None,
                dtype: Any = None, device: str = "cpu", batch: int = 2, seq: int | None = 8
                ) -> tuple[nn.Module, tuple, dict]:
    """``(model, args, kwargs)`` for a target; ``model(*args, **kwargs)`` runs it.

    spec:      ``hf:<model_type>`` | path to ``config.json`` (or its folder) | ``diffusers:<ClassName>`` |
               ``file.py:factory`` | ``package.module:factory``.
    layers:    set the layer count of a transformers config.
    overrides: config fields to change (hf and config.json targets) or keyword arguments of the
               factory (factory targets).
    dtype:     parameters and floating inputs in this dtype (``torch.bfloat16`` or ``"bf16"``).
    device:    ``"cpu"``, or ``"meta"`` to build without memory (shapes and dtypes only).
    batch/seq: sizes of the inputs made for the model (``seq=None``: up to 2048 tokens, fewer when
               the model's maximum sequence length is shorter); for ``diffusers:`` targets ``seq`` is the
               image-token count (``None``: ``DIFFUSERS_IMAGE_TOKENS``).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TargetError(f"a target is a non-empty string, got {spec!r}. Use hf:<model_type>, "
                          "path/to/config.json, diffusers:<ClassName>, file.py:factory or package.module:factory.")
    if batch < 1 or (seq is not None and seq < 1):
        raise TargetError(f"batch and seq must be positive, got batch={batch}, seq={seq}.")
    spec = spec.strip()
    overrides = dict(overrides or {})
    dtype = parse_dtype(dtype)
    prepare_torchvision()  # hf targets and factories alike may import transformers
    if spec.startswith("diffusers:"):
        return _load_diffusers(spec[len("diffusers:"):].strip(), layers, overrides, dtype, device, batch, seq)
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
