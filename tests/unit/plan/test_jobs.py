"""The real-size jobs pass preflight at the world sizes they are sized for and the plan prints them (the 16B and
Qwen3-30B-A3B on one node of 8 H100s or H200s; the 671B and Kimi K2 on 16 nodes of 8 H200s, with 671.0B and 1026.4B
parameters); a job that ran out of memory on GPUs is planned not to fit, with a change that fits."""

import pytest

from torchtitan.plan.__main__ import main
from torchtitan.preflight import check_job

JOBS = {
    "train_configs/deepseek_v3_16b.toml": 8,  # NGPU=8
    "train_configs/deepseek_v3_671b.toml": 128,  # NNODES=16 NGPU=8
    "train_configs/kimi_k2.toml": 128,  # NNODES=16 NGPU=8
}


@pytest.mark.parametrize("config, world_size", JOBS.items())
def test_each_real_size_job_passes_preflight_at_its_world_size(config, world_size, tmp_path):
    """As run_train.sh runs it; on this CPU host the 16B job's auto memory budget is off and deepep's install is not
    looked for (both need a GPU)."""
    job = check_job(["--job.config_file", config, "--job.dump_folder", str(tmp_path)], world_size)
    assert job.config.parallelism.expert_parallel_degree == 8
    if "671b" in config:
        assert (job.config.model.flavor, job.model_args.mtp_layers) == ("671B", 1)
    if "kimi" in config:
        assert (job.model_args.moe_args.num_experts, job.model_args.n_heads, job.model_args.mtp_layers) == (384, 64, 0)


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_plan_prints_the_16b_job_on_one_node(gpu, capsys):
    assert main(["--job.config_file", "train_configs/deepseek_v3_16b.toml", "--gpu", gpu]) == 0
    out = capsys.readouterr().out
    assert "on 1 node(s) x 8" in out and "15.7B parameters" in out
    assert "PP 1 x FSDP 8 x EP 8 (deepep)" in out
    assert ": fits" in out and "tokens/s/GPU" in out


def test_the_plan_prints_the_671b_job_on_its_cluster(capsys):
    argv = ["--job.config_file", "train_configs/deepseek_v3_671b.toml", "--nnodes", "16", "--gpu", "h200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "= 128 GPUs" in out
    assert "671.0B parameters, 37.6B active per token" in out  # as published, without the MTP module
    assert "PP 16 x FSDP 8 x EP 8 (deepep)" in out and "the EP group inside one node" in out
    assert ": fits" in out


def test_the_plan_prints_the_kimi_k2_job_on_its_cluster(capsys):
    argv = ["--job.config_file", "train_configs/kimi_k2.toml", "--nnodes", "16", "--gpu", "h200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1026.4B parameters, 32.9B active per token" in out
    assert "PP 16 x FSDP 8 x EP 8 (deepep)" in out and "48 of 384 experts per GPU" in out
    assert ": fits" in out


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_plan_prints_the_qwen3_30b_a3b_job_on_one_node(gpu, capsys, tmp_path):
    """The second model's job: the plan asks the model's args for its attention's activations (GQA, not MLA)."""
    config = ["--job.config_file", "train_configs/qwen3_30b_a3b.toml"]
    job = check_job([*config, "--job.dump_folder", str(tmp_path)], 8)
    assert (job.config.parallelism.expert_parallel_degree, job.model_args.n_kv_heads) == (4, 4)
    assert main([*config, "--gpu", gpu]) == 0
    out = capsys.readouterr().out
    assert "on 1 node(s) x 8" in out and "30.5B parameters, 3.4B active per token" in out
    assert "PP 1 x FSDP 8 x EP 4 (deepep)" in out and "32 of 128 experts per GPU" in out
    assert ": fits" in out and "tokens/s/GPU" in out


def test_a_job_that_ran_out_of_memory_is_planned_not_to_fit_with_a_change_that_fits(capsys):
    """The whole 16B at FSDP4 x EP4 under per-op SAC everywhere died in step 1 on 4 H100s
    (e2e_16b_ep4_sac_everywhere_oom_2251419.json)."""
    argv = ["--job.config_file", "train_configs/deepseek_v3_16b.toml", "--gpus-per-node", "4", "--gpu", "h100",
            "--parallelism.expert_parallel_degree", "4", "--activation_checkpoint.memory_budget_gib", "0"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out
    fixes = out.split("changes that fit, fastest first (the first is the cheapest):\n")[1].splitlines()
    assert "GiB per GPU" in fixes[0] and fixes[1].strip().startswith("--")


@pytest.mark.parametrize(
    "nnodes, fix",
    [
        ([], "launch a multiple of 128 processes (NNODES x NGPU), or pass --parallelism.pipeline_parallel_degree 1"),
        (["--nnodes", "8"], "pipeline_parallel_degree 16 leaves it 4 of the 64 processes; pass --parallelism."
         "pipeline_parallel_degree 8, or --parallelism.expert_parallel_degree 4, or launch a multiple of 128 processes "
         "(NNODES x NGPU)"),
    ],
    ids=["one-node", "eight-nodes"],
)  # fmt: skip
def test_the_671b_job_on_too_few_nodes_is_refused_as_the_trainer_refuses_it_naming_the_nodes_it_needs(
    nnodes, fix, tmp_path, capsys
):
    """PP 16 x EP 8 fills multiples of 128 GPUs: the plan says what run_train.sh would say on that many GPUs (the
    values it names fit), then the nodes to plan it on."""
    from torchtitan.preflight import main as preflight

    config = ["--job.config_file", "train_configs/deepseek_v3_671b.toml"]
    world_size = 8 * int(nnodes[1]) if nnodes else 8
    assert preflight(["--world-size", str(world_size), *config, "--job.dump_folder", str(tmp_path)]) == 2
    trainer = capsys.readouterr().err.strip()
    assert trainer.endswith(fix)
    assert main([*config, *nnodes, "--gpu", "h200"]) == 2
    assert capsys.readouterr().err == f"{trainer}; plan it with --nnodes 16\n"


def test_the_plan_refuses_cuda_graphs_on_several_gpus_as_the_trainer_does(tmp_path, monkeypatch, capsys):
    """The trainer's check of the layout runs in the plan too (its GPU check is the machine's: not the plan's)."""
    import torch

    from torchtitan.preflight import main as preflight

    job = ["--job.config_file", "train_configs/deepseek_v3_16b.toml", "--compile.cuda_graphs"]
    assert main([*job, "--gpu", "h100"]) == 2
    planned = capsys.readouterr().err
    assert planned.startswith("error: compile.cuda_graphs captures the step of one GPU, and this job runs 8 processes")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert preflight(["--world-size", "8", *job, "--job.dump_folder", str(tmp_path)]) == 2
    assert capsys.readouterr().err == planned
    one_gpu = ["--gpus-per-node", "1", "--parallelism.expert_parallel_degree", "1"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the plan's machine has no GPU: no matter
    assert main([*job, *one_gpu, "--gpu", "h100"]) == 0


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory) -> list[str]:
    """The fine-tuning jobs' data as shipped (scripts/chat_corpus.py), as overrides of their paths."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("chat_corpus")
    subprocess.run([sys.executable, "scripts/chat_corpus.py", str(out)], check=True, capture_output=True)
    return [
        "--training.dataset_path", str(out / "chats.jsonl"),
        "--model.tokenizer_path", str(out / "tokenizer" / "tokenizer.json"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "config, world_size, trained",
    [("train_configs/deepseek_v2_lite_lora.toml", 1, "lora"), ("train_configs/deepseek_v3_16b_sft.toml", 8, "all")],
)
def test_the_fine_tuning_jobs_pass_preflight_and_fit_the_gpus_they_are_sized_for(
    config, world_size, trained, chat_corpus, tmp_path, capsys
):
    """LoRA of the 16B on one GPU, its full SFT on one node: chat data, the V2-Lite shape, and a plan that fits."""
    job = check_job(["--job.config_file", config, *chat_corpus, "--job.dump_folder", str(tmp_path)], world_size)
    assert job.config.training.dataset_format == "chat" and job.model_args.attn_mask_type == "block_causal"
    assert job.config.lora.enable == (trained == "lora")
    gpus = ["--gpus-per-node", str(world_size)]
    assert main(["--job.config_file", config, *chat_corpus, *gpus, "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert ": fits" in out and f"x {world_size} H100" in out
    if trained == "lora":  # only the adapters (about 1% of the weights) carry optimizer state
        weights, moments = (float(out.split(name)[1].split("GiB")[0]) for name in ("weights", "optimizer moments"))
        assert moments < 0.1 * weights, out
