"""What every model's Hugging Face config.json reader (`ModelSpec.hf_config_args`, a model's `hf_config.py`) shares:
opening the file, with its one-line errors naming the flag and the path, and the checks and fields whose meaning
is the same in every family's config. The model's `hf_config.py` keeps the fields that are its own.
"""

import json
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

Args = TypeVar("Args")

Fixed = tuple[str, Any, tuple[Any, ...], str]
"""A field with one value a model computes: (field, the value when absent, the values computed, what that is)."""

FIXED_IN_EVERY_MODEL: tuple[Fixed, ...] = (
    ("hidden_act", "silu", ("silu",), "silu"),
    ("attention_bias", False, (False,), "no bias in attention projections"),
    ("tie_word_embeddings", False, (False,), "separate embedding and output head"),
    ("attention_dropout", 0.0, (0, 0.0, None), "no dropout"),
)
"""What the shared trunk and blocks (`models/moe/`) compute, whatever the family: SwiGLU, bias-free attention,
an output head of its own, no dropout."""

_FIELDS_OF_EVERY_FAMILY = frozenset(
    {field for field, *_ in FIXED_IN_EVERY_MODEL}
    # read by every family's reader (the RoPE fields by `rope_fields`, eos_token_id by `eos_id`)
    | {"model_type", "rms_norm_eps", "norm_topk_prob", "max_position_embeddings", "eos_token_id"}
    | {"rope_theta", "rope_scaling", "rope_parameters"}
    # metadata, inference and the init: no part of the model's math (each reader logs the last two)
    | {"architectures", "_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}
    | {"bos_token_id", "pad_token_id", "output_router_logits", "initializer_range", "quantization_config"}
)


def load_hf_config(
    path: str, flag: str, parse: Callable[[dict[str, Any]], Args], family: str
) -> tuple[dict[str, Any], Args]:
    """The config.json at `path` (given by `flag`) and the model args `parse` gives; a missing or malformed file, or
    one that is not a `family` config the model computes, is one error naming both."""
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} {path}: not valid JSON ({err}); fix the file") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {path} does not exist; give a config.json") from None
    except IsADirectoryError:
        raise ValueError(f"{flag} {path} is a folder; give its config.json") from None
    if not isinstance(config, dict):
        raise ValueError(f"{flag} {path}: not a JSON object; give a Hugging Face config.json")
    try:
        return config, parse(config)
    except KeyError as err:
        raise ValueError(f"{flag} {path} has no {err.args[0]!r}: not a {family} config.json") from None
    except ValueError as err:
        raise ValueError(f"{flag} {path}: {err}; fix the file") from None


def check_positive_ints(config: dict[str, Any], keys: Iterable[str]) -> None:
    """Each of `keys` a positive whole number (a size the model is built from); KeyError for one that is absent."""
    for key in keys:
        value = config[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r} must be a positive whole number")


def check_grouped_gemm_widths(config: dict[str, Any]) -> None:
    """The widths the routed experts' grouped GEMMs read in rows: multiples of 8 (16 bytes in bf16)."""
    for key in ("hidden_size", "moe_intermediate_size"):
        if config[key] % 8:
            raise ValueError(f"{key}={config[key]} must be a multiple of 8 (16-byte rows for the grouped GEMMs)")


def check_fixed(config: dict[str, Any], fixed: Iterable[Fixed]) -> None:
    """Each field of `fixed` that holds a value the model does not compute: one ValueError naming it and ours."""
    for key, absent, computed, what in fixed:
        if config.get(key, absent) not in computed:
            raise ValueError(f"{key}={config[key]!r} is not supported (this model computes {what})")


def rope_fields(config: dict[str, Any]) -> tuple[dict[str, Any], str, float]:
    """(the RoPE scaling fields, their type, rope_theta): from rope_scaling, or transformers 5's rope_parameters,
    which also holds rope_theta."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return rope, rope_type, float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def eos_id(config: dict[str, Any]) -> int:
    """The token that ends a document: eos_token_id, the first of a list of them (0 when absent)."""
    eos = config.get("eos_token_id", 0)
    return eos[0] if isinstance(eos, list) else (eos or 0)


def unknown_fields(config: dict[str, Any], family_fields: Iterable[str]) -> list[str]:
    """The fields, sorted, that neither every family's config nor `family_fields` (the family's own) define: the
    reader names them in one warning and ignores them, as transformers does."""
    return sorted(set(config) - _FIELDS_OF_EVERY_FAMILY - set(family_fields))
