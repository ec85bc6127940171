"""The model spec the trainer and preflight look up by `model.name`, and the args contract every model meets."""

import pytest
import torch

from tests.unit.distributed._model_parity import job_config
from torchtitan.config import ConfigError
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.spec import MODELS, ModelArgs, get_model_spec


def test_deepseek_v3_spec_builds_the_model_of_the_jobs_args_and_its_adapter():
    spec = get_model_spec("deepseek_v3")
    cfg = job_config()
    cfg.model.flavor = "debugmodel"
    args = spec.model_args(cfg)
    with torch.device("meta"):
        model = spec.build(args)
    assert isinstance(model, DeepSeekV3Model) and len(model.layers) == args.n_layers
    adapter = spec.state_dict_adapter(args)
    hf_keys = adapter.to_hf({name: torch.empty(0) for name in model.state_dict()})
    assert "model.embed_tokens.weight" in hf_keys


def test_an_unknown_model_name_lists_the_known_ones():
    assert sorted(MODELS) == ["deepseek_v3", "qwen3_moe"]
    with pytest.raises(ConfigError, match=r"model.name='llama'.*\['deepseek_v3', 'qwen3_moe'\]"):
        get_model_spec("llama")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_models_args_give_what_the_trainer_and_preflight_read(name):
    args = get_model_spec(name).model_args(job_config())
    assert isinstance(args, ModelArgs)
    with torch.device("meta"):
        model = get_model_spec(name).build(args)
    nparams, flops_per_token = args.get_nparams_and_flops(model, 16)
    assert nparams == sum(p.numel() for p in model.parameters()) and flops_per_token > 0
