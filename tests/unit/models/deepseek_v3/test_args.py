import json

import pytest

from torchtitan.config.job_config import JobConfig
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, benchmark_flavors, deepseekv3_flavors, get_model_args
from torchtitan.models.deepseek_v3.hf_config import hf_config_from_model_args

from .conftest import tiny_args


def test_flavors_have_published_shapes():
    expected = {"debugmodel", "debugmodel_flex", "debugmodel_tiny", "16B", "236B", "671B"}
    assert expected <= set(deepseekv3_flavors)
    assert {"16B_bench4", "16B_accept", "671B_bench8"} == set(benchmark_flavors)
    assert deepseekv3_flavors["debugmodel_flex"].attn_mask_type == "block_causal"
    v3 = deepseekv3_flavors["671B"]
    assert (v3.dim, v3.n_layers, v3.n_dense_layers, v3.n_heads, v3.q_lora_rank) == (7168, 61, 3, 128, 1536)
    m = v3.moe_args
    assert (m.num_experts, m.top_k, m.num_expert_groups, m.num_limited_groups, m.score_func) == (
        256,
        8,
        8,
        4,
        "sigmoid",
    )


@pytest.mark.parametrize(
    "flavor, total, active",
    [("671B", 671e9, 37e9), ("236B", 236e9, 21e9), ("16B", 15.7e9, 2.66e9)],
)
def test_param_counts_from_args_match_published_sizes(flavor, total, active):
    args = deepseekv3_flavors[flavor]
    assert args.nparams_total() == pytest.approx(total, rel=0.01)
    assert args.nparams_active() == pytest.approx(active, rel=0.03)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_param_counts_from_args_match_instantiated_model(q_lora_rank):
    for args in (deepseekv3_flavors["debugmodel"], tiny_args(q_lora_rank=q_lora_rank)):
        model = DeepSeekV3Model(args)
        assert args.nparams_total() == sum(p.numel() for p in model.parameters())


def test_nparams_and_flops_count_only_top_k_experts_and_mla_attention():
    args = deepseekv3_flavors["debugmodel"]
    model = DeepSeekV3Model(args)
    seq_len = 2048
    nparams, flops = args.get_nparams_and_flops(model, seq_len)
    assert nparams == args.nparams_total()
    embedding = args.vocab_size * args.dim
    attention = 6 * args.n_layers * args.n_heads * (192 + 128) * seq_len  # QK^T over 192 dims, AV over 128
    assert flops == 6 * (args.nparams_active() - embedding) + attention


def test_get_model_args_from_flavor():
    job_config = JobConfig()
    job_config.model.flavor = "debugmodel"
    job_config.training.seq_len = 8192
    job_config.debug.moe_force_load_balance = True
    args = get_model_args(job_config)
    assert args.max_seq_len == 8192 and args.moe_args.force_load_balance
    assert not deepseekv3_flavors["debugmodel"].moe_args.force_load_balance  # the preset is not mutated
    job_config.training.seq_len = 128
    assert get_model_args(job_config).max_seq_len == deepseekv3_flavors["debugmodel"].max_seq_len


def test_get_model_args_unknown_flavor_lists_flavors():
    job_config = JobConfig()
    job_config.model.flavor = "7B"
    with pytest.raises(ValueError, match=r"debugmodel.*\(benchmark shapes: \['16B_accept', '16B_bench4'"):
        get_model_args(job_config)


def test_benchmark_shapes_stand_apart_from_the_models_and_train_by_name():
    assert not set(benchmark_flavors) & set(deepseekv3_flavors)
    job_config = JobConfig()
    job_config.model.flavor = "16B_bench4"
    assert get_model_args(job_config).n_layers == 8


def test_get_model_args_from_hf_config(tmp_path):
    expected = tiny_args(q_lora_rank=24, moe=dict(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config_from_model_args(expected)))
    job_config = JobConfig()
    job_config.model.hf_config_path = str(path)
    job_config.training.seq_len = 32
    args = get_model_args(job_config)
    assert (args.dim, args.q_lora_rank, args.moe_args.score_func, args.moe_args.num_expert_groups) == (
        64,
        24,
        "sigmoid",
        4,
    )


def test_raising_max_seq_len_past_the_original_context_warns_that_yarn_turns_on(caplog):
    job_config = JobConfig()
    job_config.model.flavor = "debugmodel"  # max_seq_len = original_seq_len = 4096: YaRN off
    job_config.training.seq_len = 8192
    with caplog.at_level("WARNING"):
        get_model_args(job_config)
    assert any("turns on YaRN" in r.getMessage() and "--training.seq_len" in r.getMessage() for r in caplog.records)
    caplog.clear()
    job_config.training.seq_len = 2048
    with caplog.at_level("WARNING"):
        get_model_args(job_config)
    assert not caplog.records


def test_block_causal_switch_applies_to_any_flavor():
    job_config = JobConfig()
    job_config.model.flavor = "16B"
    assert get_model_args(job_config).attn_mask_type == "causal"
    job_config.model.attn_mask_type = "block_causal"
    assert get_model_args(job_config).attn_mask_type == "block_causal"
    job_config.model.flavor = "debugmodel_flex"
    job_config.model.attn_mask_type = "causal"
    assert get_model_args(job_config).attn_mask_type == "causal"


def test_a_final_hf_export_of_softmax_routing_whose_bias_training_moves_is_refused_before_training():
    """The export at the run's end would ignore the bias (transformers' DeepseekV2): say so before the first step."""
    job_config = JobConfig()
    job_config.model.flavor = "debugmodel"  # softmax routing, aux-loss-free balancing
    job_config.checkpoint.last_save_in_hf = True
    get_model_args(job_config)  # without --checkpoint.enable the flag is preflight's (it has no effect)
    job_config.checkpoint.enable = True
    with pytest.raises(ValueError) as err:
        get_model_args(job_config)
    assert str(err.value) == (
        "--checkpoint.last_save_in_hf: training moves the routers' selection bias (aux-loss-free balancing), but "
        "softmax routing exports as deepseek_v2, whose transformers code selects experts without the routers' "
        "selection bias (DeepSeek-V3's, which uses it, scores by sigmoid only): the export would compute other logits "
        "than the model trained. Drop the flag and export the final checkpoint without the bias, knowing that some "
        "tokens then choose other experts (scripts/convert_hf.py to-hf --drop-selection-bias), or train with sigmoid "
        "routing"
    )
    job_config.model.flavor = "debugmodel_tiny_671b"  # sigmoid routing: DeepseekV3 uses the bias
    get_model_args(job_config)
