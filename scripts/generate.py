"""Sample text from a checkpoint on one device: a DCP checkpoint of ours (a training checkpoint, a model-only export,
or scripts/convert_hf.py's output) or a Hugging Face folder (safetensors + config.json; DeepSeek's FP8 releases are
dequantized tensor by tensor as they are read into the model).

    # HF folder: the model shape from its config.json, and its tokenizer.json when it has one
    python scripts/generate.py path/to/hf_folder --prompt "The capital of France is" --max-new-tokens 32

    # our checkpoint: the shape from --flavor or --hf-config (a DCP checkpoint does not record it)
    python scripts/generate.py outputs/checkpoint/step-1000 --flavor debugmodel --prompt "Once upon a time" \\
        --temperature 0.8 --top-k 50

    # another model of models/spec.py's MODELS (deepseek_v3 unless given), as --model.name names it in training
    python scripts/generate.py path/to/Qwen3-30B-A3B --model qwen3_moe --prompt "The capital of France is"

Greedy decoding (--temperature 0, the default), or sampling from softmax(logits / temperature) over the --top-k most
likely tokens. No KV cache: each new token runs the whole sequence through the trainer's own model again, so what
is sampled is exactly what the model computes; the quadratic cost is fine for short samples. Decoding stops at the
tokenizer's end-of-text token or after --max-new-tokens. The tokenizer: --tokenizer, else the checkpoint folder's
tokenizer.json, else the shipped one; its BOS starts the prompt.
"""

import argparse
import contextlib
import copy
import dataclasses
import math
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from tokenizers import Tokenizer
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from torchtitan.components.checkpoint_folder import (  # noqa: E402
    CheckpointError,
    checkpoint_metadata,
    dcp_error_text,
    missing_metadata,
    model_key_prefix,
    model_mismatch,
    verify_checkpoint_files,
)
from torchtitan.components.hf_checkpoint import HFCheckpoint  # noqa: E402
from torchtitan.datasets.tokenizer import BOS_TOKEN, EOS_TOKEN, resolve_tokenizer_path  # noqa: E402
from torchtitan.models.spec import MODELS, ModelArgs, ModelSpec, get_model_spec  # noqa: E402
from torchtitan.tools.cli import OneLineArgumentParser  # noqa: E402

SHIPPED_TOKENIZER = "torchtitan/assets/tokenizer/tokenizer.json"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="DCP checkpoint folder, or Hugging Face folder (safetensors + config.json)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, help="sample among the k most likely tokens only (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODELS), default="deepseek_v3", help="the model (as --model.name)")
    parser.add_argument("--flavor", help="model shape preset (the model's flavors, as --model.flavor)")
    parser.add_argument("--hf-config", help="HF config.json giving the model shape (default: the HF folder's)")
    parser.add_argument("--tokenizer", help="`tokenizers` JSON (default: the folder's tokenizer.json, else ours)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="autocast dtype (default: bf16 on CUDA)")
    opts = parser.parse_args(argv)
    try:
        print(opts.prompt + sample_text(opts))
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def sample_text(opts: argparse.Namespace) -> str:
    """The text the checkpoint continues opts.prompt with."""
    if opts.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {opts.max_new_tokens}: pass 1 or more")
    if opts.top_k is not None and opts.top_k < 1:
        raise ValueError(f"--top-k {opts.top_k}: pass 1 or more (or leave it out to sample among all tokens)")
    if not (math.isfinite(opts.temperature) and opts.temperature >= 0):
        raise ValueError(f"--temperature {opts.temperature}: use a finite temperature >= 0 (0: greedy)")
    if opts.top_k is not None and opts.temperature == 0:
        raise ValueError(f"--top-k {opts.top_k} samples, but --temperature 0 is greedy: pass --temperature > 0 too")
    if not 0 <= opts.seed < 2**64:
        raise ValueError(f"--seed {opts.seed}: pass a whole number from 0 to 2**64 - 1")
    try:
        device = torch.device(opts.device)
    except RuntimeError as err:
        raise ValueError(f"--device {opts.device}: {err}; pass cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no usable GPU; pass --device cpu")
    spec = get_model_spec(opts.model)
    hf_config, args = _model_shape(spec, opts.checkpoint, opts.hf_config, opts.flavor)
    shape = f"--hf-config {opts.hf_config}" if opts.hf_config else f"--flavor {opts.flavor}" if opts.flavor else None
    args = inference_args(args)
    tokenizer, bos_id, eos_id = load_tokenizer(opts.tokenizer, opts.checkpoint, hf_config)
    if tokenizer.get_vocab_size() > args.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model only {args.vocab_size}; pass the "
            "model's tokenizer with --tokenizer"
        )
    prompt = ([bos_id] if bos_id is not None else []) + tokenizer.encode(opts.prompt, add_special_tokens=False).ids
    if not prompt:
        raise ValueError("the prompt is empty (and the tokenizer has no BOS token): pass a --prompt")
    model = load_model(spec, opts.checkpoint, args, device, shape or os.path.join(opts.checkpoint, "config.json"))
    # the weights stay fp32; bf16 computes under autocast, as the trainer's mixed precision does
    bf16 = (opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")) == "bfloat16"
    generator = torch.Generator(device=device).manual_seed(opts.seed)
    with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        new_tokens = generate(
            model, prompt, opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k, eos_id=eos_id,
            generator=generator,
        )  # fmt: skip
    return tokenizer.decode(new_tokens, skip_special_tokens=True)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The token ids that follow `prompt`: at most max_new_tokens, ending early with eos_id once it is chosen.

    No KV cache: every step runs the whole sequence so far and takes the last position's logits.
    """
    max_seq_len = model.freqs_cis.shape[0]
    if len(prompt) + max_new_tokens > max_seq_len:
        raise ValueError(
            f"the prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceed the model's max_seq_len "
            f"({max_seq_len}); shorten the prompt or --max-new-tokens"
        )
    tokens = torch.tensor([prompt], device=model.freqs_cis.device)  # (1, seqlen)
    for _ in range(max_new_tokens):
        logits = model(tokens)[0, -1].float()  # (vocab,)
        next_token = sample(logits, temperature, top_k, generator)
        tokens = torch.cat([tokens, next_token.view(1, 1)], dim=1)
        if next_token.item() == eos_id:
            break
    return tokens[0, len(prompt) :].tolist()


def sample(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One token id from logits (vocab,): the argmax at temperature 0, else a draw from softmax(logits / temperature)
    restricted to the top_k largest logits."""
    if temperature == 0:
        return logits.argmax()
    if top_k is not None and top_k < logits.numel():
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]


def inference_args(args: ModelArgs) -> ModelArgs:
    """The model shape, for inference: causal attention, no MTP modules (sampling uses the main head), and the routed
    experts' per-expert loop in the compute dtype (the grouped GEMMs compute in bf16 whatever the dtype)."""
    moe_args = dataclasses.replace(args.moe_args, use_grouped_mm=False)
    return dataclasses.replace(args, attn_mask_type="causal", mtp_layers=0, moe_args=moe_args)


def load_model(
    spec: ModelSpec, path: str, args: ModelArgs, device: torch.device, shape: str = "the model shape given"
) -> torch.nn.Module:
    """The model of `args` (given by `shape`: --flavor F, --hf-config P) on `device` (fp32 weights) with the weights
    of the DCP or HF checkpoint at `path`, once the checkpoint's tensors are that model's."""
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device=device)
    adapter = spec.state_dict_adapter(args)
    with torch.no_grad():
        model.init_weights(buffer_device=device)  # its buffers (RoPE's table); the weights are the checkpoint's
    state = model.state_dict()  # its tensors are the model's: loading into them loads the model
    if _is_dcp(path):
        verify_checkpoint_files(path, "sample from another checkpoint")
        entries = checkpoint_metadata(path, "sample from another checkpoint")
        prefix = model_key_prefix(entries)
        tensors = {key: entry for key, entry in entries.items() if isinstance(entry, TensorStorageMetadata)}
        held = {key.removeprefix(prefix): entry.size for key, entry in tensors.items() if key.startswith(prefix)}
        _check_same_model(path, shape, state, held, adapter.optional_prefixes)
        with warnings.catch_warnings():  # "torch.distributed is disabled ... a single process": yes, on purpose
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load({"model": state} if prefix else state, checkpoint_id=path, no_dist=True)
            except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
                raise CheckpointError(
                    f"cannot read {path} ({dcp_error_text(err)}); sample from another checkpoint"
                ) from None
    else:  # read tensor by tensor into the model (FP8 weights dequantized): the checkpoint is never held whole
        checkpoint = HFCheckpoint(path)
        try:
            sources = adapter.hf_sources(checkpoint.keys())
        except ValueError as err:  # names what differs from the model's shape
            raise ValueError(f"{path} holds another model than {shape} builds: {err}; {_SHAPE_FIX}") from None
        _check_same_model(path, shape, state, checkpoint.shapes(state, sources), adapter.optional_prefixes)
        checkpoint.read_into(state, sources)
    return model.eval()


def load_tokenizer(path: str | None, checkpoint: str, hf_config: dict | None) -> tuple[Tokenizer, int | None, ...]:
    """(tokenizer, BOS id, EOS id): `path`, else the checkpoint folder's tokenizer.json, else the shipped tokenizer.
    BOS / EOS are our special tokens when the tokenizer has them, else the HF config's bos_token_id / eos_token_id."""
    if path is None:
        in_folder = os.path.join(checkpoint, "tokenizer.json")
        path = in_folder if os.path.isfile(in_folder) else str(resolve_tokenizer_path(SHIPPED_TOKENIZER))
    if not os.path.isfile(path):
        what = "a folder" if os.path.isdir(path) else "no such file"
        raise FileNotFoundError(f"--tokenizer {path}: {what}; pass a `tokenizers` tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as err:  # tokenizers raises a bare Exception for unreadable JSON
        raise ValueError(f"--tokenizer {path} is not a `tokenizers` tokenizer.json ({err})") from None
    special = []
    for token, config_key in ((BOS_TOKEN, "bos_token_id"), (EOS_TOKEN, "eos_token_id")):
        token_id = tokenizer.token_to_id(token)
        if token_id is None and hf_config is not None:
            token_id = hf_config.get(config_key)
            token_id = token_id[0] if isinstance(token_id, list) else token_id
        special.append(token_id)
    return tokenizer, special[0], special[1]


def _model_shape(
    spec: ModelSpec, checkpoint: str, hf_config_path: str | None, flavor: str | None
) -> tuple[dict | None, ModelArgs]:
    """(the HF config.json giving the model shape, its args): --hf-config, else an HF folder's own; for --flavor
    (None, the flavor's args)."""
    given = hf_config_path
    if not os.path.isdir(checkpoint):
        raise ValueError(f"{checkpoint} is not a folder: pass a DCP checkpoint or a Hugging Face folder")
    if missing := missing_metadata(checkpoint):  # else taken for an HF folder without safetensors
        raise CheckpointError(f"{missing}; copy the whole checkpoint again, or sample from another one")
    if hf_config_path is None and flavor is None:
        if _is_dcp(checkpoint):
            raise ValueError(f"{checkpoint} is a DCP checkpoint, which does not record the model shape: pass --flavor "
                             "or --hf-config")  # fmt: skip
        hf_config_path = os.path.join(checkpoint, "config.json")
        if not os.path.isfile(hf_config_path):
            raise ValueError(f"{checkpoint} holds neither a DCP checkpoint (.metadata) nor a Hugging Face config.json; "
                             "pass a checkpoint folder")  # fmt: skip
    if hf_config_path is None:
        if flavor not in (flavors := spec.flavors()):
            raise ValueError(f"--flavor {flavor} is no {spec.name} flavor: pass one of {sorted(flavors)}")
        return None, copy.deepcopy(flavors[flavor])
    return spec.hf_config_args(hf_config_path, "--hf-config" if hf_config_path == given else "config.json")


def _is_dcp(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


_SHAPE_FIX = "pass the --flavor or --hf-config of the model it holds"


def _check_same_model(
    path: str, shape: str, state: dict[str, torch.Tensor], held: dict[str, Any], optional_prefixes: tuple[str, ...]
) -> None:
    """The checkpoint's tensors (`held`: our name -> size) are the model's (`state`) that `shape` builds, or one error
    naming `shape`. Optional modules (DeepSeek-V3's MTP, `optional_prefixes`) are not built here (sampling uses the
    main head): the checkpoint's are not read."""
    other = f"{path} holds another model than {shape} builds"
    if mismatch := model_mismatch({name: value.shape for name, value in state.items()}, held):
        raise ValueError(f"{other}: {mismatch}; {_SHAPE_FIX}")
    if extra := sorted(name for name in held if name not in state and not name.startswith(optional_prefixes)):
        raise ValueError(f"{other}: it has {len(extra)} tensors more, e.g. {extra[:3]}; {_SHAPE_FIX}")


if __name__ == "__main__":
    sys.exit(main())
