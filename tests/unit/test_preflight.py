"""Preflight rejects, in one line each, what the job cannot run: validation batches, W&B without its package, a
checkpoint or cache folder that is a file, an unknown pipeline schedule, a tokenizer it cannot use."""

import importlib.util
import json
import logging
import os

import pytest
import torch

from torchtitan.config import ConfigError
from torchtitan.preflight import check_job, main

DEBUG_TOML = ["--job.config_file", "train_configs/deepseek_v3_debugmodel.toml"]
VALIDATION = ["--validation.enable"]


@pytest.mark.parametrize(
    "args, world_size, message",
    [
        (["--validation.seq_len", "5000"], 1, "validation.seq_len <= the model's max_seq_len 4096"),
        (["--parallelism.pipeline_parallel_degree", "2", "--validation.local_batch_size", "4"], 2,
         "validation.local_batch_size a multiple of the pipeline's 8 micro-batches"),
        (["--validation.dataset_path", "missing.jsonl"], 1, "--validation.dataset_path='missing.jsonl' does not exist"),
    ],
    ids=["seq-len-too-long", "pp-micro-batches", "missing-corpus"],
)  # fmt: skip
def test_validation_batches_the_job_cannot_run_are_rejected(tmp_path, args, world_size, message):
    with pytest.raises((ConfigError, FileNotFoundError), match=message):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), *VALIDATION, *args], world_size=world_size)


def test_wandb_without_its_package_names_the_install(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--metrics.enable_wandb"], world_size=1)


def test_a_checkpoint_folder_that_is_a_file_is_one_error(tmp_path):
    (tmp_path / "ck").write_text("not a folder")
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--checkpoint.folder", "ck"]
    with pytest.raises(ConfigError, match="the checkpoint folder .*ck' is a file, not a folder"):
        check_job(args, world_size=1)
    check_job(args[:-3], world_size=1)  # checkpointing off: the file is nobody's business


def fake_checkpoint(folder, step):
    """A complete-looking step-N (its manifest is all preflight looks at)."""
    (folder / f"step-{step}").mkdir(parents=True)
    (folder / f"step-{step}" / "complete.json").write_text(json.dumps({"step": step, "format": "full", "files": {}}))


def test_checkpoints_of_an_earlier_run_with_checkpointing_off_is_one_line_whose_hints_run(tmp_path, capsys):
    """Without --checkpoint.enable the run would start at step 1 beside them and cut their metrics.jsonl. The line
    names a new dump folder first (after the README's resume example every later command stopped here), and a
    --checkpoint.enable that resumes to train something (alone, at the same training.steps, it had nothing to)."""
    dump_folder = tmp_path / "outputs"
    fake_checkpoint(dump_folder / "checkpoint", 2)
    fake_checkpoint(dump_folder / "checkpoint", 4)
    (dump_folder / "metrics.jsonl").write_text('{"step": 1}\n' * 4)
    (tmp_path / "outputs-2").mkdir()  # taken: not a new folder
    args = [*DEBUG_TOML, "--job.dump_folder", str(dump_folder), "--training.steps", "4"]
    assert main(["--world-size", "1", *args]) == 2
    assert capsys.readouterr().err == (
        f"error: the dump folder '{dump_folder}' holds checkpoints of an earlier run (up to step 4, in "
        f"{dump_folder / 'checkpoint'}) and checkpointing is off: to start this run apart, pass --job.dump_folder "
        f"{tmp_path / 'outputs-3'} (a new folder); to continue that run, the flags it was saved with plus "
        "--checkpoint.enable --training.steps 8\n"
    )
    assert (dump_folder / "metrics.jsonl").read_text() == '{"step": 1}\n' * 4
    check_job([*args, "--job.dump_folder", str(tmp_path / "outputs-3")], world_size=1)
    check_job([*args, "--checkpoint.enable", "--training.steps", "8"], world_size=1)
    check_job([*args, "--checkpoint.folder", "elsewhere"], world_size=1)  # checkpoint.folder is where they are found
    with pytest.raises(ConfigError, match=r"plus --checkpoint.enable$"):  # steps past the last checkpoint's: enough
        check_job([*args, "--training.steps", "5"], world_size=1)


@pytest.mark.parametrize("flag", ["--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only"])
def test_a_final_save_format_without_checkpointing_is_one_error(tmp_path, flag):
    """Otherwise the run ends with exit 0 and nothing saved."""
    with pytest.raises(ConfigError, match=rf"^{flag} shapes the final checkpoint, .*; add --checkpoint.enable$"):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), flag], world_size=1)


@pytest.mark.parametrize("model_only", [False, True])
def test_a_final_hf_export_with_pipeline_parallelism_is_one_error_naming_the_offline_conversion(tmp_path, model_only):
    """The export gathers the model on rank 0, which holds only its own pipeline stages: the trainer refused it only
    once the model was built, in a traceback. The line names the to-hf command for the last checkpoint (where it will
    be saved)."""
    dump = tmp_path / "run"
    args = [*DEBUG_TOML, "--job.dump_folder", str(dump), "--model.flavor", "debugmodel_tiny_671b",
            "--parallelism.pipeline_parallel_degree", "2", "--training.steps", "7", "--checkpoint.enable",
            "--checkpoint.last_save_in_hf"]  # fmt: skip
    last = dump / "checkpoint" / ("exports/step-7" if model_only else "step-7")
    with pytest.raises(ConfigError) as info:
        check_job([*args, *(["--checkpoint.last_save_model_only"] if model_only else [])], world_size=2)
    assert str(info.value) == (
        "--checkpoint.last_save_in_hf is not supported with pipeline parallelism (pipeline_parallel_degree 2): the "
        "export gathers the model on rank 0, which holds only its own stages; drop the flag and convert the last "
        f"checkpoint after the run: python scripts/convert_hf.py to-hf {last} <hf folder> --flavor debugmodel_tiny_671b"
    )
    check_job(args[:-1], world_size=2)  # without the flag the job passes
    check_job([*args[:6], *args[8:]], world_size=2)  # and without pipelining


def test_a_full_initial_state_from_an_hf_folder_is_one_error(tmp_path):
    """An HF folder holds weights only: asking for its optimizer state would silently load the model only."""
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path", str(tmp_path),
            "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_model_only=false"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"holds model weights only, .*; drop --checkpoint.initial_load_model_only"):
        check_job(args, world_size=1)


@pytest.mark.parametrize("name", ["step-2", "step-4.tmp"])
def test_a_file_where_a_checkpoint_would_be_saved_is_one_error(tmp_path, name):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / name).write_text("stray")
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--checkpoint.interval", "2"]
    with pytest.raises(ConfigError, match=rf"checkpoint/{name}' is not a folder, .*; move it out of the checkpoint"):
        check_job(args, world_size=1)


def test_a_checkpoint_folder_linking_to_nothing_or_without_access_is_one_error(tmp_path, monkeypatch):
    (tmp_path / "checkpoint").symlink_to(tmp_path / "gone")
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--checkpoint.enable"]
    with pytest.raises(ConfigError, match=r"checkpoint' is a link to nothing \(.*gone\); fix the link or remove it"):
        check_job(args, world_size=1)
    (tmp_path / "checkpoint").unlink()
    (tmp_path / "checkpoint").mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root reads anything: chmod 000 cannot show it
    with pytest.raises(ConfigError, match=r"checkpoint' cannot be read and written \(permissions\); fix them"):
        check_job(args, world_size=1)


def test_a_dump_folder_linking_to_nothing_says_so(tmp_path):
    (tmp_path / "dump").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match=r"dump_folder '.*dump' is a link to nothing \(.*gone\); choose another"):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path / "dump")], world_size=1)


def test_an_initial_checkpoint_given_as_the_folder_of_its_steps_names_them(tmp_path):
    for name in ("step-10", "step-20"):
        (tmp_path / "checkpoint" / name).mkdir(parents=True)
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path / "dump"), "--checkpoint.initial_load_path"]
    with pytest.raises(ConfigError, match=r"checkpoint' is a checkpoint folder holding step-10, step-20: pass one"):
        check_job([*args, str(tmp_path / "checkpoint")], world_size=1)


def test_an_initial_checkpoint_that_is_no_dcp_folder_is_one_error_before_launch(tmp_path):
    # both failed only in the trainer, after the model was built
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path / "dump"), "--checkpoint.initial_load_path"]
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "__0_0.distcp").write_bytes(b"data without its index")
    with pytest.raises(ConfigError, match=r"copy is a DCP checkpoint \(its __0_0.distcp\) missing its .metadata, "):
        check_job([*args, str(copy)], world_size=1)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"hf' is not a DCP checkpoint folder .*add --checkpoint.initial_load_in_hf"):
        check_job([*args, str(tmp_path / "hf")], world_size=1)


def test_a_cache_folder_that_is_a_file_is_one_error(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"\$TORCHTITAN_CACHE_DIR=.*cache' is a file, not a folder"):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path / "dump")], world_size=1)


@pytest.mark.parametrize(
    "args, message",
    [
        # the debug model's 6 layers + embedding + head at 3 a stage: 3 stages for 2 ranks
        (["--parallelism.pipeline_parallel_layers_per_stage", "3"], "gives 3 stages .* not divisible by"),
        (["--parallelism.pipeline_parallel_layers_per_stage", "2", "--parallelism.pipeline_parallel_schedule",
          "1F1B"], "runs one stage per rank but pipeline_parallel_layers_per_stage gives 2"),
    ],
)  # fmt: skip
def test_pipeline_stages_that_do_not_fit_fail_before_the_model_is_built(tmp_path, args, message):
    with pytest.raises(ValueError, match=message):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--parallelism.pipeline_parallel_degree", "2",
                   *args], world_size=2)  # fmt: skip


def test_an_unknown_pipeline_schedule_lists_the_known_ones(tmp_path):
    args = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Bogus"]
    with pytest.raises(ConfigError, match="pipeline_parallel_schedule='Bogus': Unknown schedule name .*1F1B"):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), *args], world_size=2)


def test_a_memory_budget_without_a_gpu_is_one_error(tmp_path):
    args = [
        *DEBUG_TOML,
        "--job.dump_folder",
        str(tmp_path),
        "--activation_checkpoint.memory_budget_gib",
        "60",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ]
    with pytest.raises(ConfigError, match="memory_budget_gib measures the GPU's memory in step 1; no GPU here"):
        check_job(args, world_size=1)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_an_auto_memory_budget_is_off_without_a_gpu_or_per_op_sac(tmp_path, caplog, mode):
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--activation_checkpoint.memory_budget_gib", "auto"]
    with caplog.at_level(logging.INFO, logger="torchtitan.preflight"):
        job_config = check_job([*args, "--activation_checkpoint.mode", mode], world_size=1).config
    assert job_config.activation_checkpoint.memory_budget_gib == 0.0
    why = (
        "no GPU here"
        if mode == "selective"
        else "it needs per-op SAC on every block, no pipeline parallelism and no CUDA graphs"
    )
    assert [r.getMessage() for r in caplog.records] == [f"activation_checkpoint.memory_budget_gib=auto: off ({why})"]


@pytest.mark.parametrize(
    "gpu, args, world_size, message",
    [
        (False, [], 1, "compile.cuda_graphs captures the step on a GPU; none is visible: drop --compile.cuda_graphs"),
        (True, ["--parallelism.expert_parallel_degree", "2"], 2,
         "compile.cuda_graphs captures the step of one GPU, and this job runs 2 processes (FSDP's hooks and the "
         "exchanges of EP, TP, CP and PP are driven by the host between kernels): run one process (NGPU=1) or drop "
         "--compile.cuda_graphs"),
        (True, ["--activation_checkpoint.memory_budget_gib", "60", "--activation_checkpoint.mode", "selective",
                "--activation_checkpoint.selective_ac_option", "op"], 1,
         "compile.cuda_graphs captures step 3, the first to run the recompute that activation_checkpoint."
         "memory_budget_gib chose after steps 1 and 2, which capture cannot compile: pass "
         "--activation_checkpoint.memory_budget_gib 0 or drop --compile.cuda_graphs"),
    ],
    ids=["no-gpu", "several-processes", "memory-budget"],
)  # fmt: skip
def test_cuda_graphs_refuse_what_they_cannot_capture_in_one_line(tmp_path, monkeypatch, capsys, gpu, args, world_size,
                                                                 message):  # fmt: skip
    """What the launcher prints before any process starts; every rank runs the same check (CPU: graphs are CUDA's)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    job = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--compile.cuda_graphs", *args]
    assert main(["--world-size", str(world_size), *job]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_cuda_graphs_on_one_gpu_pass_preflight(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    job_config = check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--compile.cuda_graphs"], 1).config
    assert job_config.compile.cuda_graphs
    # an auto budget steps aside (the 16B job's default): graphs capture one fixed recompute
    auto = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.memory_budget_gib", "auto"]
    job_config = check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--compile.cuda_graphs", *auto], 1).config
    assert job_config.activation_checkpoint.memory_budget_gib == 0.0


def test_tokenizer_problems_are_one_error_each(tmp_path):
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path / "dump")]
    (tmp_path / "garbage.json").write_text("not json")
    with pytest.raises(ValueError, match=r"garbage.json is not a `tokenizers` tokenizer.json \(expected "):
        check_job([*args, "--model.tokenizer_path", str(tmp_path / "garbage.json")], world_size=1)
    with pytest.raises(FileNotFoundError, match="tokenizer file not found: --model.tokenizer_path='missing.json'"):
        check_job([*args, "--model.tokenizer_path", "missing.json"], world_size=1)


def test_a_tokenizer_larger_than_the_vocabulary_names_both_sizes():
    # an id past the embedding's rows was an IndexError deep in the first forward
    from types import SimpleNamespace

    from torchtitan.config import JobConfig
    from torchtitan.preflight import check_tokenizer

    with pytest.raises(ConfigError, match=r"has 2048 tokens but the model's vocabulary is 1000 \(--model.flavor debug"):
        check_tokenizer(JobConfig(), SimpleNamespace(vocab_size=1000))
    job_config = JobConfig()
    job_config.model.hf_config_path = "hf/config.json"  # the shape's source, not the flavor (which it ignores)
    with pytest.raises(ConfigError, match=r"vocabulary is 1000 \(--model.hf_config_path hf/config.json\); pass a"):
        check_tokenizer(job_config, SimpleNamespace(vocab_size=1000))
    check_tokenizer(JobConfig(), SimpleNamespace(vocab_size=2048))


@pytest.mark.parametrize(
    "text, message",
    [("{bad", r"bad.json: not valid JSON \(Expecting"), ('{"model_type": "deepseek_v3"}', "has no 'vocab_size'")],
    ids=["malformed", "not-deepseek"],
)
def test_an_hf_config_that_is_not_a_deepseek_config_json_is_one_error(tmp_path, text, message):
    (tmp_path / "bad.json").write_text(text)
    args = [
        *DEBUG_TOML,
        "--job.dump_folder",
        str(tmp_path / "dump"),
        "--model.hf_config_path",
        str(tmp_path / "bad.json"),
    ]
    with pytest.raises(ValueError, match=message):
        check_job(args, world_size=1)


def test_paths_that_are_not_what_they_should_be_are_one_error_each(tmp_path):
    (tmp_path / "file").write_text("a file")
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path / "dump")]
    with pytest.raises(ConfigError, match="initial_load_path .*missing' is not a folder \\(it does not exist\\)"):
        check_job([*args, "--checkpoint.initial_load_path", str(tmp_path / "missing")], world_size=1)
    with pytest.raises(ConfigError, match="job.dump_folder .*file' is a file, not a folder"):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path / "file")], world_size=1)
    with pytest.raises(FileNotFoundError, match="hf_config_path .*missing.json does not exist"):
        check_job([*args, "--model.hf_config_path", str(tmp_path / "missing.json")], world_size=1)
    with pytest.raises(ValueError, match="hf_config_path .* is a folder; give its config.json"):
        check_job([*args, "--model.hf_config_path", str(tmp_path)], world_size=1)


def test_the_lock_check_before_launch_is_for_one_host_only(tmp_path, capsys):
    # A live run holds the dump folder: one host's launcher stops before starting anything. Several hosts' launchers
    # check at the same moment and would find each other's check holding the lock (1 launch in 10 on two cores), so
    # there only the run's global rank 0 takes it.
    from torchtitan.components.run_lock import acquire_dump_folder
    from torchtitan.preflight import main

    held = acquire_dump_folder(str(tmp_path))
    try:
        args = ["--world-size", "2", *DEBUG_TOML, "--job.dump_folder", str(tmp_path)]
        assert main(args) == 2
        assert "another training run" in capsys.readouterr().err
        assert main([*args, "--nnodes", "2"]) == 0
    finally:
        held.close()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": "abc"}, r"hidden_size='abc' must be a positive whole number"),
        ({"num_hidden_layers": -2}, r"num_hidden_layers=-2 must be a positive whole number"),
        ({"num_experts_per_tok": 20}, r"num_experts_per_tok=20 must be at most n_routed_experts=\d+"),
        ({"first_k_dense_replace": 10}, r"first_k_dense_replace=10 must be at most num_hidden_layers=6"),
        ({"n_group": 3}, r"n_group=3 must divide n_routed_experts=8, and topk_group=\d+ be at most n_group"),
        ({"n_group": 2, "topk_group": 4}, r"n_group=2 must divide .*topk_group=4 be at most n_group"),
        ({"moe_intermediate_size": 100}, r"moe_intermediate_size=100 must be a multiple of 8 \(16-byte rows .*\)"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported \(this model computes silu\)"),
        (
            {"scoring_func": "bogus"},
            r"scoring_func='bogus' is not supported \(this model computes sigmoid or softmax\)",
        ),
        ({"topk_method": "bogus_method"}, r"topk_method='bogus_method' is not supported \(.*\)"),
    ],
    ids=[
        "string-size",
        "negative-layers",
        "top-k-above-experts",
        "dense-beyond-layers",
        "groups-not-dividing",
        "top-groups-above-groups",
        "unaligned-moe-dim",
        "gelu",
        "scoring",
        "topk-method",
    ],
)
def test_an_hf_config_with_impossible_sizes_is_one_error_naming_the_file(tmp_path, change, message):
    from torchtitan.models.deepseek_v3 import all_flavors
    from torchtitan.models.deepseek_v3.hf_config import hf_config_from_model_args

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**hf_config_from_model_args(all_flavors()["debugmodel"]), **change}))
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path / "dump"), "--model.hf_config_path", str(path)]
    with pytest.raises(ValueError, match=rf"--model.hf_config_path {path}: {message}; fix the file"):
        check_job(args, world_size=1)


@pytest.mark.parametrize(
    "args, world_size, message",
    [
        (["--compile.enable", "--compile.backend", "foo"], 1, r"compile.backend='foo' is not a torch.compile backend"),
        (["--parallelism.pipeline_parallel_schedule", "Foo"], 1, r"pipeline_parallel_schedule='Foo'"),
        (["--training.enable_cpu_offload"], 1, r"enable_cpu_offload offloads FSDP's shards.*drop the flag"),
    ],
    ids=["compile-backend", "schedule-without-pp", "cpu-offload-without-fsdp"],
)
def test_settings_that_would_fail_late_or_do_nothing_are_one_error(tmp_path, args, world_size, message):
    with pytest.raises(ConfigError, match=message):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), *args], world_size=world_size)
    if "--training.enable_cpu_offload" in args:  # with FSDP it is accepted
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), *args], world_size=2)


@pytest.mark.parametrize(
    "path, kind, args, message",
    [
        ("metrics.jsonl", "folder", [], r"the metrics file .*jsonl' is a folder, not a file; .*no-enable_jsonl"),
        ("tb", "file", ["--metrics.enable_tensorboard"],
         r"the TensorBoard folder .*tb' is a file, not a folder; .*--metrics.save_tb_folder"),
        ("profile_traces", "file", ["--profiling.enable_profiling"],
         r"the profiler trace folder .*profile_traces' is a file, not a folder; .*--profiling.save_traces_folder"),
        ("memory_snapshot", "file", ["--profiling.enable_memory_snapshot"],
         r"the memory snapshot folder .*memory_snapshot' is a file, not a folder; .*--job.dump_folder"),
    ],
    ids=["jsonl-folder", "tensorboard-file", "traces-file", "snapshot-file"],
)  # fmt: skip
def test_an_output_path_of_the_wrong_kind_is_one_error(tmp_path, path, kind, args, message):
    # they were an IsADirectoryError / FileExistsError traceback, and a segfault for the profiler's traces
    (tmp_path / path).mkdir() if kind == "folder" else (tmp_path / path).write_text("in the way")
    with pytest.raises(ConfigError, match=message):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), *args], world_size=1)


def test_more_mtp_modules_than_tokens_is_one_error(tmp_path):
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--model.mtp_layers", "3"]
    with pytest.raises(ConfigError, match=r"training.seq_len \(2\) must be larger than .* \(3, --model.mtp_layers\)"):
        check_job([*args, "--training.seq_len", "2"], world_size=1)
    check_job([*args, "--training.seq_len", "4"], world_size=1)


def test_wandb_mode_and_project_name_are_checked(tmp_path, monkeypatch):
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--metrics.enable_wandb"]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else find_spec(name, *a)
    )
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ConfigError, match="WANDB_MODE='bogus' is not a W&B mode; set WANDB_MODE to one of online, off"):
        check_job(args, world_size=1)
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(ConfigError, match=r"--metrics.wandb_project 'a/b:c' contains / :; W&B project names cannot"):
        check_job([*args, "--metrics.wandb_project", "a/b:c"], world_size=1)
    check_job(args, world_size=1)


def test_profiling_past_the_last_step_warns_in_one_line(tmp_path, caplog):
    logging.disable(logging.NOTSET)  # the plan and plan_check, run in-process by earlier tests, turn them off
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--profiling.enable_profiling", "--training.steps", "1"]
    check_job(args, world_size=1)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "profile_freq" in r.getMessage()]
    assert warnings == [
        "profiling.profile_freq=10 records step 10, but training.steps is 1: no step will be profiled; pass "
        "--training.steps 10"
    ]
    caplog.clear()
    check_job([*args[:-1], "10"], world_size=1)
    assert not [r for r in caplog.records if "profile_freq" in r.getMessage()]


def test_more_checkpointed_blocks_than_the_model_has_is_one_error(tmp_path):
    # it checkpointed every block silently, as -1 does: a number meant for another model
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--model.flavor", "debugmodel_tiny",
            "--activation_checkpoint.mode", "full"]  # fmt: skip
    with pytest.raises(
        ConfigError,
        match=r"num_blocks=100, but the model \(--model.flavor debugmodel_tiny\) has 5 blocks \(4 layers \+ 1 MTP "
        r"modules\); pass at most 5, or -1 for every block",
    ):
        check_job([*args, "--model.mtp_layers", "1", "--activation_checkpoint.num_blocks", "100"], world_size=1)
    check_job([*args, "--model.mtp_layers", "1", "--activation_checkpoint.num_blocks", "5"], world_size=1)


@pytest.mark.parametrize("backend", ["deepep", "symm_mem", "standard"])
def test_an_exchange_backend_without_expert_parallelism_says_it_runs_as_the_standard_one(tmp_path, caplog, backend):
    # symm_mem at EP 1 trained with nothing to exchange and said nothing
    logging.disable(logging.NOTSET)  # the plan and plan_check, run in-process by earlier tests, turn them off
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--parallelism.expert_parallel_comm_backend", backend]
    check_job(args, world_size=1)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "token exchange" in r.getMessage()]
    if backend == "standard":  # the default: nothing chosen that goes unused
        assert lines == []
        return
    assert lines == [
        f"parallelism.expert_parallel_comm_backend={backend} with expert_parallel_degree 1: there is no token "
        "exchange, so the MoE layers run the local dispatcher, as with the standard backend; set "
        f"--parallelism.expert_parallel_degree > 1 to use {backend}"
    ]


def test_flags_this_job_never_reads_are_named_in_one_warning(tmp_path, caplog):
    # --checkpoint.keep_latest_k without --checkpoint.enable (and the like) did nothing, silently
    logging.disable(logging.NOTSET)  # the plan and plan_check, run in-process by earlier tests, turn them off
    args = [*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--checkpoint.keep_latest_k", "2",
            "--validation.freq", "5", "--model.mtp_loss_weight", "0.3"]  # fmt: skip
    check_job(args, world_size=1)
    (line,) = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert line == (
        "these flags have no effect in this job: --checkpoint.keep_latest_k (without --checkpoint.enable); "
        "--validation.freq (without --validation.enable); --model.mtp_loss_weight (without --model.mtp_layers > 0)"
    )
    caplog.clear()
    check_job([*args, "--checkpoint.enable", "--validation.enable", "--model.mtp_layers", "1"], world_size=1)
    check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path)], world_size=1)  # its TOML presets checkpoint.interval
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]
