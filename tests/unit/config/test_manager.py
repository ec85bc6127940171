import dataclasses
import subprocess
import sys

import pytest

from tests.timeouts import generous_timeout
from torchtitan.config import ConfigError, ConfigManager, HelpRequested, JobConfig, format_help, help_for
from torchtitan.config.manager import _fields, _unwrap_optional, renamed_flag, validate


def parse(*argv: str) -> JobConfig:
    return ConfigManager().parse_args(list(argv))


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


# --- precedence -----------------------------------------------------------------------------------


def test_no_args_gives_defaults():
    assert parse() == JobConfig()


def test_toml_overrides_defaults_and_cli_overrides_toml(tmp_path):
    path = write_toml(
        tmp_path,
        """
[training]
steps = 50
seq_len = 128

[optimizer]
lr = 1e-3
""",
    )
    config = parse("--job.config_file", path, "--training.steps", "7")
    assert config.training.steps == 7  # CLI beats TOML
    assert config.training.seq_len == 128  # TOML beats default
    assert config.optimizer.lr == 1e-3
    assert config.training.local_batch_size == JobConfig().training.local_batch_size  # default
    assert config.job.config_file == path


def test_cli_list_replaces_toml_list(tmp_path):
    path = write_toml(tmp_path, '[compile]\ncomponents = ["model", "loss"]\n')
    assert parse(f"--job.config_file={path}", "--compile.components", "loss").compile.components == ["loss"]


def test_config_file_position_does_not_matter(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 50\n")
    assert parse("--training.steps=3", "--job.config_file", path).training.steps == 3


def test_a_flavor_on_the_command_line_is_not_lost_under_the_files_config_json(tmp_path):
    """A job file whose config.json gives the shape would win over --model.flavor: refused, naming the fix."""
    path = write_toml(tmp_path, '[model]\nhf_config_path = "config.json"\n')
    with pytest.raises(ConfigError, match=r"--model.flavor 16B would be ignored: .* add --model.hf_config_path ''"):
        parse("--job.config_file", path, "--model.flavor", "16B")
    assert parse("--job.config_file", path, "--model.flavor", "16B", "--model.hf_config_path", "").model.flavor == "16B"
    # the config.json on the command line wins over a flavor, as documented
    assert parse("--model.flavor", "16B", "--model.hf_config_path", "c.json").model.hf_config_path == "c.json"


def test_parse_does_not_mutate_defaults_across_calls():
    parse("--compile.components=model")
    assert parse().compile.components == ["model", "loss"]


# --- CLI forms ------------------------------------------------------------------------------------


def test_space_and_equals_forms():
    assert parse("--training.steps", "12").training.steps == 12
    assert parse("--training.steps=12").training.steps == 12
    assert parse("--optimizer.lr=0.5").optimizer.lr == 0.5
    assert parse("--job.dump_folder", "a = b").job.dump_folder == "a = b"


def test_negative_number_is_a_value():
    args = ("--training.global_batch_size", "8", "--training.global_batch_size", "-1")
    assert parse(*args).training.global_batch_size == -1
    assert parse("--checkpoint.enable", "--checkpoint.load_step", "-1").checkpoint.load_step == -1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # checkpointing off: nothing would be loaded and training would start at step 1
        (["--checkpoint.load_step", "5"], "checkpoint.load_step=5 resumes from a checkpoint, but checkpointing is off"),
        (["--checkpoint.enable", "--checkpoint.load_step", "-3"], "checkpoint.load_step must be -1"),
        (["--checkpoint.enable", "--checkpoint.load_step", "0"], "checkpoint.load_step must be -1"),
        (["--activation_checkpoint.num_blocks", "-2"], "activation_checkpoint.num_blocks must be -1"),
        (["--activation_checkpoint.mode", "none", "--activation_checkpoint.num_blocks", "3"], "but the mode is none"),
        (["--activation_checkpoint.memory_budget_gib", "-1"], "memory_budget_gib must be auto or a number of GiB >= 0"),
        (["--activation_checkpoint.memory_budget_gib", "max"], "memory_budget_gib expects float | {auto}, got 'max'"),
        (
            ["--activation_checkpoint.memory_budget_gib", "60", "--activation_checkpoint.mode", "full"],
            "memory_budget_gib=60 picks each MoE block's checkpointing",
        ),
        (
            ["--activation_checkpoint.memory_budget_gib", "60", "--activation_checkpoint.num_blocks", "2"],
            "and no num_blocks",
        ),
        (["--optimizer.moments_dtype", "float16"], "optimizer.moments_dtype"),
    ],
)
def test_cross_field_and_range_errors_name_the_fix(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--checkpoint.enable"], True),
        (["--checkpoint.enable=true"], True),
        (["--checkpoint.enable=False"], False),
        (["--checkpoint.enable", "--checkpoint.no-enable"], False),
        (["--checkpoint.enable", "--checkpoint.no_enable"], False),
        (["--checkpoint.enable", "--no-checkpoint.enable"], False),
    ],
)
def test_bool_forms(argv, expected):
    assert parse(*argv).checkpoint.enable is expected


def test_bool_default_true_can_be_turned_off():
    assert parse("--parallelism.no-enable_loss_parallel").parallelism.enable_loss_parallel is False


def test_bool_switch_rejects_separate_value():
    with pytest.raises(ConfigError, match=r"--checkpoint.enable=false"):
        parse("--checkpoint.enable", "false")


def test_no_form_only_for_bools():
    with pytest.raises(ConfigError, match="only booleans"):
        parse("--training.no-steps")


def test_list_by_repeating_flag_and_by_comma_list():
    assert parse("--compile.components=model", "--compile.components=loss").compile.components == [
        "model",
        "loss",
    ]
    assert parse("--compile.components", "model,loss").compile.components == ["model", "loss"]
    assert parse("--compile.components", "model").compile.components == ["model"]
    assert parse("--compile.components=").compile.components == []


@pytest.mark.parametrize("spelling", ["none", "None"])
def test_none_for_optional_fields(spelling):
    config = parse("--debug.seed", spelling, f"--lr_scheduler.decay_ratio={spelling}")
    assert config.debug.seed is None
    assert config.lr_scheduler.decay_ratio is None
    assert parse("--debug.seed", "3").debug.seed == 3


def test_none_is_a_plain_string_for_non_optional_str():
    assert parse("--job.dump_folder", "none").job.dump_folder == "none"


def test_missing_value_is_an_error():
    with pytest.raises(ConfigError, match=r"--training.steps expects a value"):
        parse("--training.steps")
    with pytest.raises(ConfigError, match=r"--training.steps expects a value"):
        parse("--training.steps", "--training.seq_len", "4")


def test_positional_argument_is_an_error():
    with pytest.raises(ConfigError, match="unexpected argument 'job.toml'"):
        parse("job.toml")


# --- unknown keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "suggestion"),
    [
        ("--training.stepz=3", "training.steps"),  # unknown key
        ("--trainng.steps=3", "training.steps"),  # unknown section
        ("--steps=3", "training.steps"),  # missing section
        ("--optimzer.lr=1", "optimizer.lr"),
    ],
)
def test_unknown_cli_key_suggests_closest(flag, suggestion):
    with pytest.raises(ConfigError, match=f"unknown config key .*did you mean '{suggestion}'"):
        parse(flag)


def test_unknown_cli_key_without_close_match_points_to_help():
    with pytest.raises(ConfigError, match="--help"):
        parse("--zzzzzz.qqqq=1")


@pytest.mark.parametrize("name, value", [("expert_parallel_overlap", "true"), ("deepep_overlap_num_sms", "8")])
def test_removed_overlap_keys_are_unknown_keys_on_cli_and_in_toml(tmp_path, name, value):
    """The two-micro-batch EP overlap and its SM setting were removed (benchmarks/NOTES.md): passing them fails."""
    unknown = f"unknown config key 'parallelism.{name}' .*; the two-micro-batch expert-parallel overlap was removed"
    with pytest.raises(ConfigError, match=unknown):
        parse(f"--parallelism.{name}={value}")
    path = write_toml(tmp_path, f"[parallelism]\n{name} = {value}\n")
    with pytest.raises(ConfigError, match=unknown):
        parse("--job.config_file", path)


@pytest.mark.parametrize(
    "flags, new_key",
    [(["--optimizer.muon_momentum=0.9"], "muon.momentum"), (["--optimizer.muon_groups", "matrices"], "muon.groups"),
     (["--optimizer.no-muon_nesterov"], "muon.nesterov"), (["--optimizer.muon_update_rms", "0.3"], "muon.update_rms")],
)  # fmt: skip
def test_muon_keys_of_the_optimizer_section_name_their_new_section_on_cli(flags, new_key):
    with pytest.raises(ConfigError, match=rf"unknown config key .*; it is now {new_key} \(\[muon\] ") as info:
        parse("--optimizer.name=Muon", *flags)
    assert "\n" not in str(info.value)


def test_muon_keys_of_the_optimizer_section_name_their_new_section_in_toml(tmp_path):
    path = write_toml(tmp_path, '[optimizer]\nname = "Muon"\nmuon_ns_steps = 6\n')
    with pytest.raises(ConfigError, match=r"'optimizer.muon_ns_steps' \(in .*\); it is now muon.ns_steps \(.*\[muon\]"):
        parse("--job.config_file", path)
    path = write_toml(tmp_path, '[optimizer]\nname = "Muon"\n\n[muon]\nns_steps = 6\n')
    assert parse("--job.config_file", path).muon.ns_steps == 6


@pytest.mark.parametrize(
    "old, new, value",
    [
        ("parallelism.deepep_num_sms", "deepep.num_sms", "48"),
        ("parallelism.deepep_sync_free_dispatch", "deepep.sync_free_dispatch", "true"),
        ("quantize.float8_dispatch", "deepep.float8_dispatch", "true"),
    ],
)
def test_deepep_keys_moved_to_their_own_section_are_refused_in_one_line_naming_the_new_key(tmp_path, old, new, value):
    section, _, name = old.partition(".")
    moved = rf"unknown config key '{old}' .*; it is now {new} \(\[deepep\] {new[7:]} in a TOML file, --{new} on the"
    for argv in ([f"--{old}={value}"], ["--job.config_file", write_toml(tmp_path, f"[{section}]\n{name} = {value}\n")]):
        with pytest.raises(ConfigError, match=moved) as info:
            parse(*argv)
        assert "\n" not in str(info.value)
    assert renamed_flag(f"--{old}={value}") == f"--{new}={value}" and renamed_flag(f"--{old}") == f"--{new}"
    assert renamed_flag("--training.steps") == "--training.steps" and renamed_flag(value) == value


def test_the_renamed_capacity_factor_key_names_its_new_name_on_cli_and_in_toml(tmp_path):
    renamed = (
        "unknown config key 'parallelism.deepep_sync_free_capacity_factor' .*; it is now "
        "parallelism.expert_parallel_capacity_factor"
    )
    with pytest.raises(ConfigError, match=renamed):
        parse("--parallelism.deepep_sync_free_capacity_factor=1.5")
    path = write_toml(tmp_path, "[parallelism]\ndeepep_sync_free_capacity_factor = 1.5\n")
    with pytest.raises(ConfigError, match=renamed):
        parse("--job.config_file", path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[trainig]\nsteps = 3\n", r"unknown config section \[trainig\].*did you mean \[training\]"),
        ("[training]\nseq_length = 3\n", r"'training.seq_length'.*did you mean 'training.seq_len'"),
        ("steps = 3\n", r"not inside a \[section\].*'training.steps'"),
        ("[[validation]]\nenable = true\n", r"\[\[validation\]\] in .* is an array of tables; write \[validation\]"),
        ('[job]\nconfig_file = "other.toml"\n', "job.config_file cannot be set inside a config file"),
    ],
    ids=["unknown-section", "unknown-key", "key-outside-a-section", "array-of-tables", "config-file-inside"],
)
def test_a_bad_toml_file_is_one_error_with_the_fix(tmp_path, text, message):
    path = write_toml(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        parse("--job.config_file", path)


# --- types and choices ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag",
    ["--training.steps=abc", "--training.steps=2.5", "--optimizer.lr=fast", "--checkpoint.enable=maybe"],
)
def test_wrong_type_on_cli(flag):
    key = flag[2:].partition("=")[0]
    with pytest.raises(ConfigError, match=f"--{key} expects"):
        parse(flag)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('steps = "4096"', "training.steps .* expects int.*without quotes"),
        ("steps = 4096.0", "training.steps .* expects int"),
        ("steps = true", "training.steps .* expects int"),
        ("enable_cpu_offload = 1", "training.enable_cpu_offload .* expects bool"),
        ("max_norm = [1]", "training.max_norm .* expects float"),
    ],
)
def test_wrong_type_in_toml(tmp_path, line, message):
    path = write_toml(tmp_path, f"[training]\n{line}\n")
    with pytest.raises(ConfigError, match=message):
        parse("--job.config_file", path)


def test_toml_int_widens_to_float(tmp_path):
    path = write_toml(tmp_path, "[training]\nmax_norm = 2\n")
    max_norm = parse("--job.config_file", path).training.max_norm
    assert max_norm == 2.0 and isinstance(max_norm, float)


def test_toml_list_must_hold_strings(tmp_path):
    path = write_toml(tmp_path, "[compile]\ncomponents = [1]\n")
    with pytest.raises(ConfigError, match=r"compile.components .* expects list\[str\]"):
        parse("--job.config_file", path)


def test_toml_none_string_for_optional(tmp_path):
    path = write_toml(tmp_path, '[debug]\nseed = "none"\n')
    assert parse("--job.config_file", path).debug.seed is None


def test_choice_validation_on_cli_and_toml(tmp_path):
    assert parse("--optimizer.name=Adam").optimizer.name == "Adam"
    with pytest.raises(ConfigError, match="one of AdamW, Adam, Muon; got 'adamw'; did you mean 'AdamW'"):
        parse("--optimizer.name", "adamw")
    path = write_toml(tmp_path, '[lr_scheduler]\ndecay_type = "cosin"\n')
    with pytest.raises(ConfigError, match="lr_scheduler.decay_type .*did you mean 'cosine'"):
        parse("--job.config_file", path)
    path = write_toml(tmp_path, "[lr_scheduler]\ndecay_type = 1\n")
    with pytest.raises(ConfigError, match="lr_scheduler.decay_type"):
        parse("--job.config_file", path)


# --- config file errors ---------------------------------------------------------------------------


def test_missing_config_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="nope.toml"):
        parse("--job.config_file", missing)


def test_a_config_file_that_is_a_folder_or_not_utf8_says_so(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .* is a folder; give a .toml file"):
        parse("--job.config_file", str(tmp_path))
    path = tmp_path / "latin1.toml"
    path.write_bytes("[job]\ndescription = 'caf\u00e9'\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"config file .*latin1.toml' is not UTF-8 text"):
        parse("--job.config_file", str(path))


def test_invalid_toml_names_the_path(tmp_path):
    path = write_toml(tmp_path, "[training\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse("--job.config_file", path)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --- help -----------------------------------------------------------------------------------------


def test_help_lists_every_field_with_type_default_and_doc():
    text = format_help()
    config = JobConfig()
    for section in dataclasses.fields(config):
        assert f"[{section.name}]" in text
        for f in dataclasses.fields(getattr(config, section.name)):
            flag = f"--{section.name}.{f.name}  ("
            line = next(line for line in text.splitlines() if line.strip().startswith(flag))
            assert "default:" in line
            assert line.partition(")  ")[2].strip(), f"{flag} has no docstring"
    assert "--training.steps  (int, default: 10000)  Optimizer steps to train." in text
    assert "--optimizer.name  ({AdamW,Adam,Muon}, default: AdamW)" in text
    for knob in ("groups", "momentum", "nesterov", "ns_steps", "update_scale", "update_rms"):
        assert f"--muon.{knob}  (" in text
    assert "--debug.seed  (int | None, default: 0)" in text
    assert "--compile.components  (list[str], default: model,loss)" in text


def test_multiline_docstring_is_joined():
    assert "(warmup-stable-decay). None: decay over all post-warmup steps." in format_help()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_and_exits_zero(flag, capsys):
    with pytest.raises(HelpRequested) as info:
        parse("--training.steps=3", flag, "--bogus.key")
    assert info.value.code == 0
    assert "--training.steps" in capsys.readouterr().out
    assert "--training.steps" in info.value.text


def test_uncaught_help_exits_process_with_zero():
    code = "from torchtitan.config import ConfigManager; ConfigManager().parse_args(['--help'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=generous_timeout(60))
    assert result.returncode == 0
    assert "--deepep.num_sms" in result.stdout
    assert result.stderr == ""


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--training.seq_len=0"], "training.seq_len must be a positive"),
        (["--training.steps=-5"], "training.steps must be a positive"),
        (["--training.local_batch_size=0"], "training.local_batch_size must be a positive"),
        (["--metrics.log_freq=0"], "metrics.log_freq must be a positive"),
        (
            ["--training.global_batch_size=12", "--training.local_batch_size=8"],
            "multiple of .*local_batch_size",
        ),
        (["--training.global_batch_size=0"], "training.global_batch_size must be -1"),
        (["--compile.components=model,los"], r"compile.components may only contain .*\['los'\]"),
        (["--activation_checkpoint.selective_ac_option=every"], "selective_ac_option must be 'op'"),
        (["--activation_checkpoint.selective_ac_option=0"], "selective_ac_option must be 'op'"),
        (["--activation_checkpoint.selective_ac_option=\u00b2"], "selective_ac_option must be 'op'"),  # '²'.isdigit()
        (["--compile.enable", "--compile.components", ","], "compile.components is empty, so --compile.enable would"),
        (["--debug.seed", "99999999999999999999999"], r"debug.seed must be none or in \[0, 2\*\*63 - 1"),
        (["--debug.seed", "-1"], r"debug.seed must be none or in \[0, 2\*\*63 - 1"),
        (["--comm.init_timeout_seconds", "99999999999999999"], "init_timeout_seconds must be at most 2147483647"),
        (["--comm.train_timeout_seconds", "2147483648"], "train_timeout_seconds must be at most 2147483647"),
        (["--parallelism.expert_parallel_capacity_factor=0"], "capacity_factor must be none or a finite number > 0"),
        (["--parallelism.expert_parallel_capacity_factor=nan"], "capacity_factor must be none or a finite number"),
        (["--parallelism.expert_tensor_parallel_degree=0"], "expert_tensor_parallel_degree must be >= 1"),
        (["--parallelism.expert_tensor_parallel_degree=2"], "must be 1 or equal to .*tensor_parallel_degree"),
        (["--parallelism.data_parallel_shard_degree=0"], "data_parallel_shard_degree must be -1"),
        (["--lr_scheduler.decay_ratio=1.5"], r"decay_ratio must be in \[0, 1\]"),
        (["--lr_scheduler.warmup_steps=-1"], "warmup_steps must be >= 0"),
        (["--parallelism.tensor_parallel_degree=2", "--training.seq_len=33"], r"seq_len \(33\) must be divisible by"),
        (["--parallelism.tensor_parallel_degree=2", "--validation.seq_len=33"], r"validation.seq_len \(33\) must be"),
        (["--parallelism.context_parallel_degree=0"], "context_parallel_degree must be >= 1"),
        (["--parallelism.context_parallel_degree=4", "--training.seq_len=36"], r"\(36\) must be divisible by 2 x cont"),
        (["--parallelism.context_parallel_degree=2", "--parallelism.tensor_parallel_degree=2"], "not supported with"),
        (["--parallelism.context_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2"], "not supported with"),
        (["--validation.local_batch_size=0"], "validation.local_batch_size must be none or a positive"),
        (["--validation.freq=0"], "validation.freq must be a positive"),
        (["--optimizer.lr", "inf"], r"optimizer.lr must be a finite number >= 0, got inf; pass --optimizer.lr"),
        (["--optimizer.lr", "nan"], r"optimizer.lr must be a finite number >= 0, got nan"),
        (["--optimizer.beta1", "1.5"], r"optimizer.beta1 must be in \[0, 1\), got 1.5"),
        (["--optimizer.beta2", "1"], r"optimizer.beta2 must be in \[0, 1\), got 1.0"),
        (["--optimizer.eps", "-1e-8"], r"optimizer.eps must be a finite number > 0, got -1e-08"),
        (["--optimizer.weight_decay", "nan"], r"optimizer.weight_decay must be a finite number >= 0, got nan"),
        (["--training.max_norm", "nan"], r"training.max_norm must be > 0 \(inf: no clipping\), got nan"),
        (["--model.mtp_loss_weight", "-0.1"], r"model.mtp_loss_weight must be a finite number >= 0"),
        (["--lr_scheduler.min_lr_factor", "nan"], r"min_lr_factor must be in \[0, 1\], got nan"),
        (["--optimizer.name=Muon", "--muon.momentum=1"], r"muon.momentum must be in \[0, 1\)"),
        (["--optimizer.name=Muon", "--muon.ns_steps=0"], "muon.ns_steps must be a positive"),
        (["--optimizer.name=Muon", "--muon.update_scale=rms"], "muon.update_scale must be one of"),
        (["--optimizer.name=Muon", "--muon.groups=matrices,norms"], r"muon.groups must name .*\['matrices'"),
        (["--optimizer.name=Muon", "--muon.groups=experts,experts"], "muon.groups must name each of"),
        (["--optimizer.name=Muon", "--muon.groups", ","], "and at least one of them"),
        (["--optimizer.name=Muon", "--muon.update_rms=0"], "muon.update_rms must be a finite number > 0"),
        (
            ["--optimizer.name=Muon", "--muon.update_scale=original", "--muon.update_rms=0.5"],
            "muon.update_rms applies to --muon.update_scale match_rms_adamw, got original",
        ),
    ],  # which optimizer takes [muon] or bf16 moments: components/optimizer.py's table (tests/unit/components)
)
def test_validation_rejects_bad_values(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse(*flags)


@pytest.mark.parametrize(
    "flags",
    [
        ["--training.global_batch_size=16", "--training.local_batch_size=8"],
        ["--activation_checkpoint.selective_ac_option=2"],
        ["--parallelism.tensor_parallel_degree=2", "--parallelism.expert_tensor_parallel_degree=2"],
        ["--lr_scheduler.decay_ratio=0", "--lr_scheduler.warmup_steps=0"],
        ["--compile.components=loss"],
        ["--compile.components", ","],  # compile off: nothing to compile either way
        ["--debug.seed", str(2**63 - 1)],
        ["--comm.init_timeout_seconds", str(2**31 - 1)],
        ["--training.seq_len", "127"],  # only context parallelism needs an even length
        ["--parallelism.context_parallel_degree=2", "--training.seq_len=36"],
        ["--optimizer.name=Muon", "--optimizer.moments_dtype=bfloat16"],  # AdamW's part keeps bf16 moments
        ["--optimizer.name=Muon", "--muon.update_rms=0.6", "--metrics.log_update_rms"],
        ["--optimizer.name=Muon", "--muon.groups=experts,head", "--muon.update_scale=original", "--muon.momentum=0",
         "--muon.no-nesterov", "--muon.ns_steps=10"],
    ],
)  # fmt: skip
def test_validation_accepts_good_values(flags):
    parse(*flags)


def _float_keys() -> list[str]:
    return [key for key, spec in _fields().items() if _unwrap_optional(spec.type)[0] is float]


def test_the_float_options_are_found():
    # the generic check below covers what this finds: a float option added later is covered without listing it
    assert {"optimizer.lr", "optimizer.eps", "optimizer.beta2", "training.max_norm", "model.mtp_loss_weight"} <= set(
        _float_keys()
    )


@pytest.mark.parametrize("key", _float_keys())
def test_every_float_option_is_checked_in_the_float32_the_trainer_computes_it_in(key):
    # 1e45 is finite in Python and inf in float32: --optimizer.lr 1e45 passed and step 1 died in a traceback;
    # 1e-50 is 0 there (an lr of 1e-50 trained nothing, silently). A field whose range refuses either value anyway
    # says so (metrics.straggler_threshold must be > 1).
    for value in ("1e45", "1e-50"):
        with pytest.raises(ConfigError) as err:
            parse(f"--{key}", value)
        message = str(err.value)
        assert message.startswith(key) and "\n" not in message, message
        assert "float32" in message or f"got {float(value)};" in message, message


def test_a_value_float32_rounds_out_of_its_range_is_refused_naming_what_it_becomes():
    with pytest.raises(ConfigError, match=r"beta2 must be in \[0, 1\), got 0.9999999999, which is 1.0 in float32"):
        parse("--optimizer.beta2", "0.9999999999")
    parse("--optimizer.beta2", "0.9999")  # below 1 in float32 too


def test_an_int_option_past_int64_is_refused():
    with pytest.raises(ConfigError, match=rf"training.steps={2**63} does not fit in int64"):
        parse("--training.steps", str(2**63))


def test_validate_runs_on_toml_values(tmp_path):
    path = write_toml(tmp_path, "[training]\nseq_len = -1\n")
    with pytest.raises(ConfigError, match="training.seq_len"):
        parse("--job.config_file", path)


def test_validate_accepts_defaults():
    validate(JobConfig())


def test_help_shows_the_values_a_toml_file_and_flags_resolve_to(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('[training]\nsteps = 30\n[model]\nflavor = "16B"\n')
    text = help_for(["--job.config_file", str(toml), "--help", "--training.seq_len", "512"])
    lines = {line.split("  (")[0].strip(): line for line in text.splitlines() if line.startswith("  --")}
    assert "(int, default: 10000, this job: 30)" in lines["--training.steps"]
    assert "(str, default: debugmodel, this job: 16B)" in lines["--model.flavor"]
    assert "this job: 512" in lines["--training.seq_len"]
    assert "this job" not in lines["--training.local_batch_size"]  # unchanged: the default only
    assert str(toml) in text


def test_help_for_a_bad_command_line_names_the_error_and_still_lists_fields():
    text = help_for(["--help", "--bogus.key", "1"])
    assert text.startswith("error: unknown config key 'bogus.key'")
    assert "--training.steps  (int, default: 10000)" in text


def test_memory_budget_takes_auto_or_a_number_from_toml_and_cli(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('[activation_checkpoint]\nmemory_budget_gib = "auto"\n')
    assert parse("--job.config_file", str(toml)).activation_checkpoint.memory_budget_gib == "auto"
    toml.write_text("[activation_checkpoint]\nmemory_budget_gib = 70\n")
    assert parse("--job.config_file", str(toml)).activation_checkpoint.memory_budget_gib == 70.0
    assert parse("--activation_checkpoint.memory_budget_gib", "auto").activation_checkpoint.memory_budget_gib == "auto"
    assert parse("--activation_checkpoint.memory_budget_gib", "12.5").activation_checkpoint.memory_budget_gib == 12.5
    toml.write_text('[activation_checkpoint]\nmemory_budget_gib = "big"\n')
    with pytest.raises(ConfigError, match="memory_budget_gib in .* expects float \\| {auto}, got 'big'"):
        parse("--job.config_file", str(toml))
    # auto is never refused for the AC mode: it turns itself off where a budget does not apply (preflight)
    assert parse("--activation_checkpoint.memory_budget_gib", "auto", "--activation_checkpoint.mode", "full")
