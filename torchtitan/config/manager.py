"""Build a `JobConfig` from defaults, a TOML file and CLI flags (CLI > TOML > defaults), and print `--help`.

Hand-rolled rather than argparse for one error per bad key naming the closest valid key, the same type rules for TOML
and CLI values, and help text from `job_config.py`'s field docstrings (adding a field there exposes it).
"""

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import sys
import textwrap
import tomllib
import types
from collections.abc import Iterable
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from torchtitan.config.job_config import PARAMETER_GROUPS, JobConfig
from torchtitan.config.numeric_limits import as_used, limit_problem

_HELP_FLAGS = ("-h", "--help")
_NONE_STRINGS = ("none", "None")


class ConfigError(ValueError):
    """A bad config value or key; the message names the key and the fix. `main` prints it and exits 2."""


class ResumeMismatchError(ValueError):
    """A saved state that this run refuses because its settings differ (the data stream, the layout): the
    checkpoint is healthy, so the fix is the settings, never deleting it. The message names them."""


class HelpRequested(SystemExit):
    """Raised by `parse_args` after printing `--help`; a SystemExit(0) so an uncaught one exits cleanly."""

    def __init__(self, text: str) -> None:
        super().__init__(0)
        self.text = text


class ConfigManager:
    """Parses argv into a validated `JobConfig`."""

    def parse_args(self, argv: list[str] | None = None) -> JobConfig:
        """Defaults, then `--job.config_file` TOML, then CLI flags; then `validate`. Raises ConfigError for bad keys,
        types and values; for `-h` / `--help` prints help and raises HelpRequested (exit code 0)."""
        argv = sys.argv[1:] if argv is None else list(argv)
        if any(arg in _HELP_FLAGS for arg in argv):
            text = help_for(argv)
            print(text)
            raise HelpRequested(text)

        config = _resolve(_parse_cli(argv))
        validate(config)
        return config


def _resolve(overrides: dict[str, Any]) -> JobConfig:
    """Defaults, then the TOML file named by `job.config_file` (if any), then the CLI `overrides`."""
    config = JobConfig()
    config_file = overrides.get("job.config_file")
    if config_file is not None:
        _apply(config, _load_toml(config_file))
        # the file's config.json gives the shape and would silently win over a flavor the command line asks for
        _require(
            not config.model.hf_config_path or "model.flavor" not in overrides or "model.hf_config_path" in overrides,
            f"--model.flavor {overrides.get('model.flavor')} would be ignored: {config_file} sets "
            f"model.hf_config_path={config.model.hf_config_path!r}, which gives the model's shape; add "
            "--model.hf_config_path '' to train the flavor",
        )
    _apply(config, overrides)
    return config


def command_line_keys(argv: list[str]) -> set[str]:
    """The keys a command line sets itself (`section.field`), apart from its TOML file's; call after `parse_args`
    accepted it."""
    return set(_parse_cli(argv)) - {"job.config_file"}


def format_help(job: JobConfig | None = None, source: str = "") -> str:
    """Every field as `--section.field  (type, default: X)  doc`, grouped by section; with `job` (what a command
    line resolves to), fields that differ from the default also show `this job: Y`."""
    lines = [
        "usage: python -m torchtitan.train [--job.config_file PATH] [--section.field VALUE ...]",
        "",
        "Precedence: CLI flags > TOML file (--job.config_file) > defaults.",
        "Values: --a.b VALUE or --a.b=VALUE. Booleans: --a.flag, --a.no-flag, --a.flag=false.",
        "Lists: repeat the flag or pass a comma list. Fields typed `X | None`: pass `none` for None.",
    ]
    if job is not None:
        lines.append(f"'this job': the value from {source}, shown where it differs from the default.")
    section = None
    for spec in _fields().values():
        if spec.section != section:
            section = spec.section
            lines += ["", f"[{section}]"]
        shown = f"default: {_show(spec.default)}"
        if job is not None:
            value = getattr(getattr(job, spec.section), spec.name)
            if value != spec.default:
                shown += f", this job: {_show(value)}"
        lines.append(f"  --{spec.key}  ({_type_name(spec.type)}, {shown})  {spec.doc}")
    return "\n".join(lines)


def help_for(argv: list[str]) -> str:
    """`format_help` for a command line, with the values its TOML file and flags resolve to (before validation); one
    that does not parse gets the plain help with the error on top."""
    args = [arg for arg in argv if arg not in _HELP_FLAGS]
    if not args:
        return format_help()
    try:
        overrides = _parse_cli(args)
        job = _resolve(overrides)
    except ConfigError as err:
        return f"error: {err}\n\n{format_help()}"
    flags = "flags" if set(overrides) - {"job.config_file"} else ""
    source = " + ".join(filter(None, [overrides.get("job.config_file"), flags]))
    return format_help(job, source)


def validate(job_config: JobConfig) -> None:
    """Reject values that are wrong for any world size, naming the key and the fix. Checks that need the world size
    or the model live in preflight, which runs after this."""
    _check_numbers(job_config)
    _check_batch_and_layout(job_config)
    _check_muon(job_config.muon)
    _check_features(job_config)
    _check_watchdog_timeouts(job_config)


def _check_numbers(job_config: JobConfig) -> None:
    """Counts positive, degrees at least 1, ranges, and every number within what the dtype that uses it holds."""
    for key in _POSITIVE_KEYS:
        value = _value(job_config, key)
        _require(value > 0, f"{key} must be a positive integer, got {value}; pass --{key} N with N >= 1")
    for key in _DEGREE_KEYS:
        value = _value(job_config, key)
        _require(value >= 1, f"{key} must be >= 1, got {value}; pass --{key} 1 to disable it")
    for key, ok, requirement in _RANGES:
        value = _value(job_config, key)
        _require(ok(value), f"{key} must be {requirement}, got {value}; pass --{key} with such a value")
        stored = as_used(value)  # e.g. a beta2 of 0.9999999999 is 1.0 in float32
        _require(
            ok(stored),
            f"{key} must be {requirement}, got {value}, which is {stored} in float32, the dtype the trainer computes "
            f"it in; pass --{key} with such a value",
        )
    for spec in _fields().values():  # every number as the dtype that uses it holds it (numeric_limits.py)
        value = _value(job_config, spec.key)
        problem = limit_problem(value)
        _require(problem is None, f"{spec.key}={value!r} {problem}; pass --{spec.key} within that range")


def _check_batch_and_layout(job_config: JobConfig) -> None:
    """Batch sizes and sequence lengths against the degrees that split them (`_check_numbers` made them >= 1)."""
    training, par = job_config.training, job_config.parallelism
    gbs, lbs, tp = training.global_batch_size, training.local_batch_size, par.tensor_parallel_degree
    _require(
        gbs == -1 or (gbs > 0 and gbs % lbs == 0),
        f"training.global_batch_size must be -1 or a positive multiple of training.local_batch_size ({lbs}), "
        f"got {gbs}; pass --training.global_batch_size -1 or a multiple of {lbs}",
    )
    cp = par.context_parallel_degree
    for key in ("training.seq_len", "validation.seq_len"):
        seq_len = _value(job_config, key) or training.seq_len
        _require(
            seq_len % tp == 0,
            f"{key} ({seq_len}) must be divisible by tensor_parallel_degree ({tp}) for sequence "
            f"parallelism; change --{key} or --parallelism.tensor_parallel_degree",
        )
        _require(
            cp == 1 or seq_len % (2 * cp) == 0,
            f"{key} ({seq_len}) must be divisible by 2 x context_parallel_degree ({2 * cp}): each rank holds two "
            f"chunks of every sequence; change --{key} or --parallelism.context_parallel_degree",
        )
    for other in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        _require(
            cp == 1 or getattr(par, other) == 1,
            f"parallelism.context_parallel_degree ({cp}) is not supported with {other} > 1 yet; set one of them to 1",
        )
    _require(
        par.expert_tensor_parallel_degree in (1, tp),
        "parallelism.expert_tensor_parallel_degree must be 1 or equal to parallelism.tensor_parallel_degree "
        f"({tp}), got {par.expert_tensor_parallel_degree}",
    )
    # the token exchange's settings (the backends' own, the capacity factor): `models/moe/exchange.py` (preflight)


def _check_features(job_config: JobConfig) -> None:
    """Checkpointing, compile and activation checkpointing: options that would silently do nothing or the wrong
    thing."""
    checkpoint = job_config.checkpoint
    _require(
        checkpoint.load_step == -1 or checkpoint.enable,
        f"checkpoint.load_step={checkpoint.load_step} resumes from a checkpoint, but checkpointing is off (nothing "
        "would be loaded: training would start at step 1); add --checkpoint.enable or drop --checkpoint.load_step",
    )

    unknown = sorted(set(job_config.compile.components) - {"model", "loss"})
    _require(
        not unknown,
        f"compile.components may only contain 'model' and 'loss', got {unknown}; "
        "pass e.g. --compile.components model,loss",
    )
    _require(
        job_config.compile.components or not job_config.compile.enable,
        "compile.components is empty, so --compile.enable would compile nothing; pass --compile.components with "
        "model and/or loss (e.g. model,loss)",
    )
    ac = job_config.activation_checkpoint
    _require(
        ac.num_blocks == -1 or ac.mode != "none",
        f"activation_checkpoint.num_blocks={ac.num_blocks} limits which blocks are checkpointed, but the mode is "
        "none; pass --activation_checkpoint.mode selective (or full), or drop --activation_checkpoint.num_blocks",
    )
    budget = ac.memory_budget_gib  # `auto` turns itself off where it does not apply (preflight)
    _require(
        budget in (0, "auto") or memory_budget_applies(job_config),
        f"activation_checkpoint.memory_budget_gib={_show(budget)} picks each MoE block's checkpointing "
        "(per-op SAC, none or whole-block recompute): it needs --activation_checkpoint.mode selective, "
        "selective_ac_option op and no num_blocks, and no pipeline parallelism yet; drop the budget or those flags",
    )
    option = ac.selective_ac_option
    _require(
        option == "op" or (option.isascii() and option.isdigit() and int(option) > 0),
        f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got {option!r}; "
        "pass --activation_checkpoint.selective_ac_option op (or e.g. 2)",
    )


_MUON_GROUPS = tuple(group for group in PARAMETER_GROUPS if group != "norms_and_biases")  # norms take AdamW


def _check_muon(muon: Any) -> None:
    """Muon's section on its own: its groups, and update_rms only where it applies. Which optimizer may take the
    section, and which may keep bf16 moments, the optimizers' table says (components/optimizer.py's
    `check_optimizer`, run by preflight)."""
    unknown = [group for group in muon.groups if group not in _MUON_GROUPS]
    _require(
        bool(muon.groups) and not unknown and len(set(muon.groups)) == len(muon.groups),
        f"muon.groups must name each of {', '.join(_MUON_GROUPS)} at most once and at least one of them, "
        f"got {muon.groups}; pass e.g. --muon.groups matrices,experts",
    )
    _require(
        muon.update_scale == "match_rms_adamw" or muon.update_rms == type(muon)().update_rms,
        f"muon.update_rms applies to --muon.update_scale match_rms_adamw, got {muon.update_scale}; drop one of them",
    )


def memory_budget_applies(job_config: JobConfig) -> bool:
    """Where activation_checkpoint.memory_budget_gib can choose each MoE block's level: per-op SAC on every block,
    without pipeline parallelism."""
    ac = job_config.activation_checkpoint
    per_op_sac = ac.mode == "selective" and ac.selective_ac_option == "op" and ac.num_blocks == -1
    return per_op_sac and job_config.parallelism.pipeline_parallel_degree == 1


def _check_watchdog_timeouts(job_config: JobConfig) -> None:
    """The hang watchdog must fire before the process groups' own timeout, which stops a hung collective without
    naming the rank it waits for."""
    ft, comm = job_config.fault_tolerance, job_config.comm
    if ft.hang_timeout_seconds == 0:
        return
    for watchdog, group in (
        ("hang_timeout_seconds", "train_timeout_seconds"),
        ("first_step_timeout_seconds", "init_timeout_seconds"),
    ):
        watchdog_value, group_value = getattr(ft, watchdog), getattr(comm, group)
        _require(
            watchdog_value < group_value,
            f"fault_tolerance.{watchdog} ({watchdog_value}) must be shorter than comm.{group} ({group_value}): the "
            "process groups' own timeout would stop a hung collective first, without naming the rank it waits for; "
            f"lower --fault_tolerance.{watchdog} or raise --comm.{group} (--fault_tolerance.hang_timeout_seconds 0 "
            "turns the watchdog off)",
        )


_POSITIVE_KEYS = (
    "training.seq_len training.steps training.local_batch_size training.gc_freq metrics.log_freq checkpoint.interval "
    "profiling.profile_freq comm.init_timeout_seconds comm.train_timeout_seconds validation.freq validation.steps "
    "parallelism.fsdp_blocks_per_unit muon.ns_steps fault_tolerance.first_step_timeout_seconds "
    "fault_tolerance.save_timeout_seconds metrics.straggler_warn_after debug.sleep_at_step lora.rank"
).split()
_DEGREE_KEYS = (
    "parallelism.data_parallel_replicate_degree parallelism.tensor_parallel_degree parallelism.context_parallel_degree "
    "parallelism.pipeline_parallel_degree parallelism.pipeline_parallel_microbatch_size "
    "parallelism.expert_parallel_degree parallelism.expert_tensor_parallel_degree"
).split()
_MAX_SEED = 2**63 - 1  # torch.manual_seed takes a 64-bit seed
_MAX_TIMEOUT = 2**31 - 1  # a C int of seconds; far below timedelta's limit
# (key, whether its value is valid, what a valid value is)
_RANGES = (
    ("validation.local_batch_size", lambda v: v is None or v > 0, "none or a positive integer"),
    ("validation.seq_len", lambda v: v is None or v > 0, "none or a positive integer"),
    ("training.max_norm", lambda v: v > 0 and not math.isnan(v), "> 0 (inf: no clipping)"),
    ("parallelism.data_parallel_shard_degree", lambda v: v == -1 or v >= 1, "-1 (use the remaining ranks) or >= 1"),
    ("parallelism.pipeline_parallel_layers_per_stage", lambda v: v is None or v >= 1, "None or >= 1"),
    ("lr_scheduler.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("lr_scheduler.decay_ratio", lambda v: v is None or 0.0 <= v <= 1.0, "in [0, 1] or none"),
    ("lr_scheduler.min_lr_factor", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    ("model.mtp_loss_weight", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("optimizer.lr", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("optimizer.beta1", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("optimizer.beta2", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("optimizer.eps", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    ("optimizer.weight_decay", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("muon.momentum", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("muon.update_rms", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    ("lora.alpha", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    ("checkpoint.keep_latest_k", lambda v: v >= 0, ">= 0 (0 keeps all)"),
    ("checkpoint.load_step", lambda v: v == -1 or v >= 1, "-1 (the latest checkpoint) or a step >= 1"),
    ("activation_checkpoint.num_blocks", lambda v: v >= -1, "-1 (every block) or a number of blocks >= 0"),
    (
        "activation_checkpoint.memory_budget_gib",
        lambda v: v == "auto" or (math.isfinite(v) and v >= 0),
        "auto or a number of GiB >= 0 (0: off)",
    ),
    (
        "parallelism.expert_parallel_capacity_factor",
        lambda v: v is None or (math.isfinite(v) and v > 0),
        "none or a finite number > 0",
    ),
    ("debug.seed", lambda v: v is None or 0 <= v <= _MAX_SEED, f"none or in [0, 2**63 - 1 = {_MAX_SEED}]"),
    ("comm.init_timeout_seconds", lambda v: v <= _MAX_TIMEOUT, f"at most {_MAX_TIMEOUT} seconds (about 68 years)"),
    ("comm.train_timeout_seconds", lambda v: v <= _MAX_TIMEOUT, f"at most {_MAX_TIMEOUT} seconds (about 68 years)"),
    ("fault_tolerance.hang_timeout_seconds", lambda v: v >= 0, ">= 0 (0: the watchdog off)"),
    ("metrics.straggler_interval", lambda v: v >= 0, ">= 0 (0: no straggler check)"),
    ("metrics.straggler_threshold", lambda v: math.isfinite(v) and v > 1, "a finite number > 1"),
    ("debug.sleep_seconds", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (0: off)"),
    ("debug.sleep_rank", lambda v: v >= 0, "a global rank >= 0"),
    ("debug.sigterm_at_step", lambda v: v >= 0, ">= 0 (0: off)"),
    ("debug.sigterm_rank", lambda v: v >= -1, "-1 (every rank) or a global rank >= 0"),
)


def _value(job_config: JobConfig, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(job_config, section), name)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# ----------------------------------------------------------------------------------------------------
# Field table: every leaf field of JobConfig as "section.field", with its type, default and docstring.


@dataclasses.dataclass(frozen=True)
class _Field:
    section: str
    name: str
    type: Any
    default: Any
    doc: str

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


@functools.cache
def _fields() -> dict[str, _Field]:
    table = {}
    section_types = get_type_hints(JobConfig)
    for section in dataclasses.fields(JobConfig):
        cls = section_types[section.name]
        field_types = get_type_hints(cls)
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            spec = _Field(section.name, f.name, field_types[f.name], default, docs.get(f.name, ""))
            table[spec.key] = spec
    return table


def _field_docs(cls: type) -> dict[str, str]:
    """The string literal right under each annotated field (the convention `job_config.py` follows)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        doc = following.value if isinstance(following, ast.Expr) else None
        is_doc = isinstance(doc, ast.Constant) and isinstance(doc.value, str)
        if is_doc and isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            docs[node.target.id] = " ".join(doc.value.split())
    return docs


def _lookup(key: str, where: str) -> _Field:
    spec = _fields().get(key)
    if spec is None:
        raise ConfigError(f"unknown config key {key!r} ({where}); {_suggestion(key)}")
    return spec


RENAMED_KEYS = {
    "parallelism.deepep_sync_free_capacity_factor": "parallelism.expert_parallel_capacity_factor",
    "parallelism.deepep_num_sms": "deepep.num_sms",
    "parallelism.deepep_sync_free_dispatch": "deepep.sync_free_dispatch",
    "quantize.float8_dispatch": "deepep.float8_dispatch",
    **{
        f"optimizer.muon_{name}": f"muon.{name}"
        for name in ("groups", "momentum", "nesterov", "ns_steps", "update_scale", "update_rms")
    },
}
"""Old key -> its name now: the old one is refused, naming the new one (`renamed_flag` spells an old command's flag
as today's)."""


def renamed_flag(word: str) -> str:
    """One word of a command line, with a renamed key's flag by its name today (`--old.key=v` -> `--new.key=v`): how
    scripts show or replay the commands of old results (scripts/bench/results_table.py, scripts/plan_check.py)."""
    flag, equals, value = word.partition("=")
    new = RENAMED_KEYS.get(flag.removeprefix("--")) if flag.startswith("--") else None
    return f"--{new}{equals}{value}" if new else word


def _renamed(new: str) -> str:
    section, _, name = new.partition(".")
    return f"it is now {new} ([{section}] {name} in a TOML file, --{new} on the command line); rename the key"


_REMOVED_KEYS = {
    **{old: _renamed(new) for old, new in RENAMED_KEYS.items()},
    **dict.fromkeys(
        ("parallelism.expert_parallel_overlap", "parallelism.deepep_overlap_num_sms"),
        "the two-micro-batch expert-parallel overlap was removed: it lost to the plain step on every machine measured "
        "(benchmarks/NOTES.md); drop the key",
    ),
}


def _suggestion(key: str) -> str:
    """Why a removed key is gone (asked for as itself or as a switch's `no-` form), else the closest full key; falls
    back to matching only the field name (`--steps` -> `training.steps`)."""
    section, _, name = key.rpartition(".")
    switch = f"{section}.{name[3:]}" if name.startswith(("no-", "no_")) else key.removeprefix("no-")
    for removed in (key, switch):
        if removed in _REMOVED_KEYS:
            return _REMOVED_KEYS[removed]
    match = _closest(key, _fields())
    if match is None:
        by_name = {spec.name: spec.key for spec in reversed(_fields().values())}  # the first section's wins
        name_match = _closest(name, by_name)
        match = by_name[name_match] if name_match else None
    return f"did you mean {match!r}?" if match else "run with --help to list valid keys"


def _closest(word: str, candidates: Iterable[str]) -> str | None:
    """Case-insensitive difflib match, returned in the candidate's own spelling."""
    by_lower = {c.lower(): c for c in candidates}
    matches = difflib.get_close_matches(word.lower(), by_lower, n=1)
    return by_lower[matches[0]] if matches else None


# ----------------------------------------------------------------------------------------------------
# Sources: CLI flags and TOML file, both turned into {"section.field": typed value}.


def _parse_cli(argv: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.field VALUE")
        name, has_value, text = arg[2:].partition("=")

        negated = _negated_bool_key(name, arg)
        if negated is not None:
            if has_value:
                raise ConfigError(f"{arg!r} takes no value; use --{negated}=true or --{negated}=false")
            overrides[negated] = False
            continue

        spec = _lookup(name, arg)
        if not has_value:
            if spec.type is bool:
                if i < len(argv) and not argv[i].startswith("--"):
                    raise ConfigError(
                        f"--{spec.key} is a switch and takes no separate value (got {argv[i]!r}); "
                        f"write --{spec.key}=false or --{spec.section}.no-{spec.name}"
                    )
                overrides[spec.key] = True
                continue
            if i >= len(argv) or argv[i].startswith("--"):
                raise ConfigError(f"--{spec.key} expects a value ({_type_name(spec.type)})")
            text = argv[i]
            i += 1
        value = _from_cli(spec, text)
        if get_origin(spec.type) is list:
            # Repeating a list flag appends; together the CLI values replace the TOML / default list.
            overrides.setdefault(spec.key, []).extend(value)
        else:
            overrides[spec.key] = value
    return overrides


def _negated_bool_key(name: str, arg: str) -> str | None:
    """`--no-a.flag`, `--a.no-flag` or `--a.no_flag` -> "a.flag"; None when `name` is no negation."""
    section, _, field_name = name.rpartition(".")
    candidates = []
    if name.startswith("no-"):
        candidates.append(name[3:])
    if field_name.startswith(("no-", "no_")):
        candidates.append(f"{section}.{field_name[3:]}")
    for key in candidates:
        spec = _fields().get(key)
        if spec is not None:
            if spec.type is not bool:
                raise ConfigError(f"{arg!r}: only booleans have a --no- form; {key} is {_type_name(spec.type)}")
            return key
    return None


def _from_cli(spec: _Field, text: str) -> Any:
    """Convert a CLI string to the field's type."""
    where = f"--{spec.key}"
    inner, optional = _unwrap_optional(spec.type)
    if optional and text in _NONE_STRINGS:
        return None
    if (words := _number_or_words(inner)) is not None:
        if text in words:
            return text
        inner = float
    if inner is bool:
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
    elif inner in (int, float):
        try:
            return inner(text)
        except ValueError:
            pass
    elif inner is str:
        return text
    elif get_origin(inner) is Literal:
        return _choose(get_args(inner), text, where)
    elif get_origin(inner) is list:
        return [item.strip() for item in text.split(",") if item.strip()]
    raise ConfigError(f"{where} expects {_type_name(spec.type)}, got {text!r}")


def _load_toml(path: str) -> dict[str, Any]:
    """Read and type-check a TOML file; every key must be `[section] field = value` of a known field."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path!r} (from --job.config_file)") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path!r} is a folder; give a .toml file (--job.config_file)") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path!r}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path!r} is not valid TOML: {err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path!r} is not UTF-8 text; save it as UTF-8 TOML") from None

    sections = {spec.section for spec in _fields().values()}
    values = {}
    for section, table in data.items():
        if isinstance(table, list) and section in sections:
            raise ConfigError(
                f"[[{section}]] in {path} is an array of tables; write [{section}] (one section, single brackets)"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"top-level key {section!r} in {path} is not inside a [section]; {_suggestion(section)}")
        if section not in sections:
            match = _closest(section, sections)
            hint = f"did you mean [{match}]?" if match else f"valid sections: {', '.join(sorted(sections))}"
            raise ConfigError(f"unknown config section [{section}] in {path}; {hint}")
        for name, value in table.items():
            if f"{section}.{name}" == "job.config_file":
                raise ConfigError(
                    f"job.config_file cannot be set inside a config file ({path}); drop it there and pass the file "
                    "with --job.config_file (CONFIG_FILE for run_train.sh)"
                )
            spec = _lookup(f"{section}.{name}", f"in {path}")
            values[spec.key] = _from_toml(spec, value, path)
    return values


def _from_toml(spec: _Field, value: Any, path: str) -> Any:
    """Check a TOML value against the field's type; ints widen to float, nothing else converts."""
    where = f"{spec.key} in {path}"
    inner, optional = _unwrap_optional(spec.type)
    if optional and value in _NONE_STRINGS:  # TOML has no null; the CLI's `none` spelling works here too
        return None
    if (words := _number_or_words(inner)) is not None:
        if value in words:
            return value
        inner = float
    if inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif inner is str:
        ok = isinstance(value, str)
    elif get_origin(inner) is Literal:
        if isinstance(value, str):
            return _choose(get_args(inner), value, where)
        ok = False
    elif get_origin(inner) is list:
        ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
        value = list(value) if ok else value
    else:
        ok = False
    if not ok:
        hint = "; write it without quotes" if isinstance(value, str) and inner in (int, float, bool) else ""
        raise ConfigError(f"{where} expects {_type_name(spec.type)}, got {value!r} ({type(value).__name__}){hint}")
    return value


def _choose(choices: tuple[str, ...], text: str, where: str) -> str:
    if text in choices:
        return text
    match = _closest(text, choices)
    hint = f"; did you mean {match!r}?" if match else ""
    raise ConfigError(f"{where} must be one of {', '.join(choices)}; got {text!r}{hint}")


def _apply(config: JobConfig, values: dict[str, Any]) -> None:
    for key, value in values.items():
        section, _, name = key.partition(".")
        setattr(getattr(config, section), name, value)


# ----------------------------------------------------------------------------------------------------
# Type helpers.


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    if get_origin(tp) in (Union, types.UnionType):
        args = get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return rest[0], True
    return tp, False


def _number_or_words(tp: Any) -> tuple[str, ...] | None:
    """`float | Literal["auto", ...]` -> ("auto", ...): a number or one of those words; None for any other type."""
    if get_origin(tp) not in (Union, types.UnionType):
        return None
    args = get_args(tp)
    words = [a for a in args if get_origin(a) is Literal]
    if len(args) != 2 or float not in args or len(words) != 1:
        return None
    return get_args(words[0])


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if (words := _number_or_words(inner)) is not None:
        name = "float | {" + ",".join(words) + "}"
    elif get_origin(inner) is Literal:
        name = "{" + ",".join(map(str, get_args(inner))) + "}"
    elif get_origin(inner) is list:
        name = f"list[{get_args(inner)[0].__name__}]"
    else:
        name = inner.__name__
    return f"{name} | None" if optional else name


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)
