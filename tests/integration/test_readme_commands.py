"""Every command in README.md and docs/*.md works as written when a user runs them in order in one clone, and so
does every command of benchmarks/RESULTS.md.

The commands run in order in a sandbox laid out like a clone's root (links to run_train.sh, train_configs/, scripts/,
torchtitan/), so `outputs/` is the sandbox's. What runs for real: the README's first CPU training command that
checkpoints (2 steps instead of its 30: `STEPS_RUN`; later commands' `step-30` become `step-2`; the README states the
loss of those 2 steps), the `--help` texts, every HF conversion, the shipped chat corpus and the README's sampling
command; python entry points run in this process (no torch import each), the training through the suite's fork
server after run_train.sh's checks.
Training commands that do not run are checked the way run_train.sh checks them before it starts any process
(`preflight.check_job`, world size NGPU x NNODES) against the sandbox as the commands before them left it: in the dump
folder the command names, else its config's, so a command that starts beside the checkpoints of an earlier one fails.
A command that would save checkpoints, run or not, claims its dump folder: a later command other than itself (its
resume) in that folder fails, as it would resume or refuse those checkpoints. Commands in a block whose first line is
`# GPU only` are checked as on a GPU machine (an 80 GB H100) with DeepEP installed. A block whose first line is `# needs
a download` names files a user downloads (a release's weights, a tokenizer, a corpus): its training commands pass the
checks of the world size and the model shape (`preflight.check_layout`), its other commands name repository files
that exist. `python -m torchtitan.plan` runs for real. Other commands must name files that exist. A command of a kind
this file does not know fails the test: teach it here. RESULTS.md's commands (inline, each as its row ran on GPUs) are
checked as `# GPU only` commands, in a sandbox of their own.
"""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts import chat_corpus, convert_hf, generate, tokenize_corpus
from tests.integration.conftest import run_trainer
from torchtitan import preflight, train
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.config import ConfigManager
from torchtitan.distributed.deepep import buffer as deepep_buffer
from torchtitan.plan import __main__ as plan

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
RESULTS_PAGE = REPO_ROOT / "benchmarks" / "RESULTS.md"
CLONE_ENTRIES = ("run_train.sh", "train_configs", "scripts", "torchtitan", "pyproject.toml")
DEFAULT_CONFIG = "./train_configs/deepseek_v3_debugmodel.toml"
TEST_COMMAND = "python -m pytest tests -q"
STEPS_WRITTEN, STEPS_RUN = 30, 2
GPU_ONLY = "# GPU only"
NEEDS_DOWNLOAD = "# needs a download"
GPU_SEEN = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=int(79.2 * 2**30))  # what CUDA reports


@dataclass
class Command:
    page: str
    text: str
    env: dict[str, str]
    argv: list[str]
    gpu_only: bool
    needs_download: bool


def commands(page: Path) -> list[Command]:
    """The commands of a page's ```bash blocks: continuation lines joined, comments dropped, `a && b` split."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        gpu_only = block.lstrip().startswith(GPU_ONLY)
        needs_download = block.lstrip().startswith(NEEDS_DOWNLOAD)
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            for text in filter(None, (part.strip() for part in line.split(" && "))):
                words = shlex.split(text)
                env = {}
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                    name, value = words.pop(0).split("=", 1)
                    env[name] = value
                found.append(
                    Command(page.relative_to(REPO_ROOT).as_posix(), text, env, words, gpu_only, needs_download)
                )
    return found


ALL_COMMANDS = [command for page in PAGES for command in commands(page)]


def test_the_pages_hold_commands_and_the_readme_marks_its_gpu_ones():
    readme = [command for command in ALL_COMMANDS if command.page == "README.md"]
    assert any(command.argv[0] == "./run_train.sh" and not command.gpu_only for command in readme)
    assert any(command.gpu_only for command in readme)


def test_the_readme_test_command_is_the_one_ci_runs():
    ci_lines = [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    assert TEST_COMMAND in ci_lines
    assert any(command.text == TEST_COMMAND for command in ALL_COMMANDS if command.page == "README.md")


def test_pip_installs_name_extras_the_package_has():
    extras = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for command in ALL_COMMANDS:
        if command.argv[:2] == ["pip", "install"]:
            for word in command.argv[2:]:
                if word.startswith("."):
                    named = set(re.findall(r"\[([^]]*)\]", word)[0].split(",")) if "[" in word else set()
                    assert named <= extras, f"{command.page}: `{command.text}` names an extra pyproject.toml lacks"


@pytest.fixture
def sandbox(tmp_path, monkeypatch) -> Path:
    """A folder laid out like a fresh clone's root, the working directory of the test."""
    for entry in CLONE_ENTRIES:
        (tmp_path / entry).symlink_to(REPO_ROOT / entry)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_command_runs_or_passes_its_checks(sandbox, monkeypatch, capsys):
    trained, ran = False, set()
    claimed: dict[Path, str] = {}  # dump folder -> the command whose run saves checkpoints there
    for command in ALL_COMMANDS:
        argv = [
            word.replace(f"step-{STEPS_WRITTEN}", f"step-{STEPS_RUN}") if trained else word for word in command.argv
        ]
        where = f"{command.page}: `{command.text}`"
        program = argv[0]
        if program in ("pip", "nvidia-cuda-mps-control") or command.text == TEST_COMMAND:
            continue  # installs (tested above), the GPU's MPS daemon, the suite itself
        if command.needs_download:
            check_downloaded(command, argv, sandbox, where, claimed)
        elif is_training(argv):
            train_args = training_args(argv)
            if "--help" in train_args and program == "./run_train.sh":
                run_shell(argv, command.env, sandbox, where)
            elif "--help" in train_args:
                assert train.main(train_args) == 0, where
                assert "--training.steps" in capsys.readouterr().out, where
            elif not trained and first_checkpointing_run(command, train_args):
                job = check_training(command, train_args, sandbox, monkeypatch, claimed)
                # what run_train.sh starts after its checks, on one rank; its launcher has tests of its own
                config = ["--job.config_file", str(sandbox / command.env.get("CONFIG_FILE", DEFAULT_CONFIG))]
                dump_folder = sandbox / job.config.job.dump_folder
                run_trainer(dump_folder, [*config, *train_args, "--training.steps", str(STEPS_RUN)])
                assert (dump_folder / "checkpoint" / f"step-{STEPS_RUN}").is_dir(), where
                check_stated_losses(command, train_args, dump_folder)
                trained = True
            else:
                check_training(command, train_args, sandbox, monkeypatch, claimed)
        elif argv[:3] == ["python", "-m", "torchtitan.plan"]:
            assert plan.main(argv[3:]) == 0, where
            assert "predicted:" in capsys.readouterr().out, where
        elif argv[:2] == ["python", "scripts/convert_hf.py"]:
            if command.text not in ran:
                convert_hf.main(argv[2:])
        elif argv[:2] == ["python", "scripts/tokenize_corpus.py"]:
            assert tokenize_corpus.main(argv[2:]) == 0, where
        elif argv[:2] == ["python", "scripts/chat_corpus.py"]:
            assert chat_corpus.main(argv[2:]) == 0, where
        elif argv[:2] == ["python", "scripts/generate.py"] and command.page == "README.md":
            assert generate.main(argv[2:]) == 0, where
            assert argv[argv.index("--prompt") + 1] in capsys.readouterr().out, where
        elif program == "tensorboard":
            assert importlib.util.find_spec("tensorboard") is not None, where
        elif program == "sbatch":
            check_slurm_job(command, argv, sandbox, monkeypatch, claimed)
        elif program in ("python", "torchrun"):
            check_paths(argv, sandbox, where)
        else:
            pytest.fail(f"{where}: a command this test does not know; teach tests/integration/test_readme_commands.py")
        ran.add(command.text)
    assert trained, "the README has no CPU training command with --checkpoint.enable to run"


def test_the_results_page_commands_pass_their_checks(sandbox, monkeypatch):
    """benchmarks/RESULTS.md's commands, as a user would rerun a row on a GPU machine today (renamed flags refused)."""
    found = results_commands(RESULTS_PAGE)
    assert any(is_training(command.argv) for command in found), "RESULTS.md lists no training command"
    claimed: dict[Path, str] = {}
    for command in found:
        if is_training(command.argv):
            check_training(command, training_args(command.argv), sandbox, monkeypatch, claimed)
        elif command.argv[0] == "python":
            check_paths(command.argv, sandbox, f"{command.page}: `{command.text}`")
        else:
            pytest.fail(f"{command.page}: `{command.text}`: a command this test does not know; teach it here")


def results_commands(page: Path) -> list[Command]:
    """The inline commands (`...`) of a generated page: those that start a program, after any VAR=value."""
    found = []
    for text in re.findall(r"`([^`\n]+)`", page.read_text()):
        words = shlex.split(text)
        env = {}
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if words and (words[0] in ("./run_train.sh", "python", "torchrun") or words[0].endswith("/python")):
            found.append(Command(page.relative_to(REPO_ROOT).as_posix(), text, env, words, True, False))
    return found


def is_training(argv: list[str]) -> bool:
    return argv[0] == "./run_train.sh" or argv[:3] == ["python", "-m", "torchtitan.train"]


def training_args(argv: list[str]) -> list[str]:
    return argv[1:] if argv[0] == "./run_train.sh" else argv[3:]


def check_stated_losses(command: Command, train_args: list[str], dump_folder: Path) -> None:
    """The README states the loss of the steps run, as its first training command logs them. Steps 1 and 2 of the
    2-step run are those of the written 30-step run when step 1 has the same lr in both (step 2's loss follows from
    step 1's update; the lr schedule's length changes only later steps)."""
    config = command.env.get("CONFIG_FILE", DEFAULT_CONFIG)
    job_config = ConfigManager().parse_args(["--job.config_file", config, *train_args])
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=job_config.optimizer.lr)
    written_lr = build_lr_schedulers([optimizer], job_config).get_last_lr()  # the lr of step 1
    records = {record["step"]: record for record in map(json.loads, (dump_folder / "metrics.jsonl").open())}
    assert records[1]["lr"] == pytest.approx(written_lr), "step 1 of the test's run is not the README's"
    readme = (REPO_ROOT / "README.md").read_text()
    for step in range(1, STEPS_RUN + 1):
        stated = f"{records[step]['loss']:.4f} at step {step}"  # as the step line prints it
        assert stated in readme, f"README.md should state the loss its quick start logs: {stated}"


def first_checkpointing_run(command: Command, train_args: list[str]) -> bool:
    return command.page == "README.md" and not command.gpu_only and "--checkpoint.enable" in train_args


def run_shell(argv: list[str], command_env: dict[str, str], cwd: Path, where: str) -> None:
    env = {**os.environ, **command_env, "PYTHON": sys.executable, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def check_training(
    command: Command, train_args: list[str], sandbox: Path, monkeypatch, claimed: dict[Path, str]
) -> preflight.CheckedJob:
    """What run_train.sh checks before torchrun starts: `preflight.check_job` with the job's world size, in the
    sandbox as the earlier commands left it. GPU-only commands as on a GPU machine with DeepEP installed."""
    world_size = int(command.env.get("NGPU", "1")) * int(command.env.get("NNODES", "1"))
    config = command.env.get("CONFIG_FILE", DEFAULT_CONFIG)
    argv = ["--job.config_file", config, *train_args]
    with monkeypatch.context() as patch:
        for name, value in command.env.items():
            patch.setenv(name, value)
        if command.gpu_only:
            patch.setattr(torch.cuda, "is_available", lambda: True)
            patch.setattr(torch.cuda, "device_count", lambda: 1)
            patch.setattr(torch.cuda, "get_device_properties", lambda device: GPU_SEEN)
            patch.setattr(deepep_buffer, "import_deep_ep", lambda: None)
        try:
            job = preflight.check_job(argv, world_size)
        except Exception as err:  # any error: the command fails as written
            pytest.fail(f"{command.page}: `{command.text}` fails its checks: {err}")
    claim_dump_folder(command, job.config, sandbox, claimed)
    return job


def check_slurm_job(command: Command, argv: list[str], sandbox: Path, monkeypatch, claimed: dict[Path, str]) -> None:
    """`sbatch [flags] scripts/slurm/train.sbatch [trainer flags]`: the script exists, and its trainer flags pass the
    checks of run_train.sh on `--nodes` nodes (NNODES, as the script sets it)."""
    where = f"{command.page}: `{command.text}`"
    script = next(i for i, word in enumerate(argv) if word.endswith(".sbatch"))
    check_paths(argv[: script + 1], sandbox, where)
    nodes = argv[argv.index("--nodes") + 1] if "--nodes" in argv[:script] else "1"
    train_args = argv[script + 1 :]
    env = {**command.env, "NNODES": nodes}
    job = Command(command.page, command.text, env, ["./run_train.sh", *train_args], command.gpu_only, False)
    check_training(job, train_args, sandbox, monkeypatch, claimed)


def claim_dump_folder(command: Command, job_config, sandbox: Path, claimed: dict[Path, str]) -> None:
    """A command whose run saves checkpoints claims its dump folder; another command there would resume them (another
    job's state) or, without --checkpoint.enable, be refused beside them."""
    folder = (sandbox / job_config.job.dump_folder).resolve()
    owner = claimed.get(folder)
    if owner is not None and owner != command.text:
        pytest.fail(
            f"{command.page}: `{command.text}` runs in {job_config.job.dump_folder}, where `{owner}` saves its "
            "checkpoints: give it a --job.dump_folder of its own"
        )
    if job_config.checkpoint.enable:
        claimed[folder] = command.text


def check_downloaded(command: Command, argv: list[str], sandbox: Path, where: str, claimed: dict[Path, str]) -> None:
    """A command on downloaded files: a training command's flags, layout and model shape are checked at its world size
    (the files themselves are the user's), and its dump folder claimed as `check_training` does; any other command
    names repository files that exist."""
    if argv[0] in ("./run_train.sh", "torchrun"):
        train_args = argv[1:] if argv[0] == "./run_train.sh" else argv[argv.index("torchtitan.train") + 1 :]
        config = command.env.get("CONFIG_FILE", DEFAULT_CONFIG)
        world_size = int(command.env.get("NGPU", "1")) * int(command.env.get("NNODES", "1"))
        try:
            job_config = ConfigManager().parse_args(["--job.config_file", config, *train_args])
            job_config.checkpoint.initial_load_path = None  # a download, read at launch (its MTP layers, its keys)
            preflight.check_layout(job_config, world_size)
        except Exception as err:  # any error: the command fails as written
            pytest.fail(f"{where} fails its checks: {err}")
        claim_dump_folder(command, job_config, sandbox, claimed)
    else:
        check_paths(argv, sandbox, where)


def check_paths(argv: list[str], sandbox: Path, where: str) -> None:
    """Scripts, test folders and outputs a command names exist (in the clone, or written by an earlier command)."""
    for word in argv[1:]:
        if re.match(r"(scripts|tests|outputs|train_configs|torchtitan)/", word):
            assert (sandbox / word).exists() or (REPO_ROOT / word).exists(), f"{where}: {word} does not exist"
