import errno
import importlib.util
import json
import os
import re
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.unit.components._hf_safetensors import fail_hf_writes, load_hf_safetensors
from tests.unit.components.test_hf_checkpoint import load_initial_hf
from torchtitan.components.checkpoint_folder import FORMAT_FULL, CheckpointError, publish, write_rank_checksums
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.deepseek_v3.hf_config import hf_config_from_model_args

from .conftest import tiny_args

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "scripts", "convert_hf.py")
_spec = importlib.util.spec_from_file_location("convert_hf", _SCRIPT)
convert_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_hf)


MOE = dict(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2)
ARGS = tiny_args(q_lora_rank=24, moe=MOE)


def _tiny_state(tmp_path):
    """State dict of a tiny model and the path of its HF config.json (the shape given to the script)."""
    torch.manual_seed(0)
    model = DeepSeekV3Model(ARGS)
    model.init_weights()
    config_path = tmp_path / "tiny_config.json"
    config_path.write_text(json.dumps(hf_config_from_model_args(ARGS)))
    return model.state_dict(), str(config_path)


def test_dcp_to_hf_to_dcp_round_trip(tmp_path):
    state, config_path = _tiny_state(tmp_path)
    # a full training checkpoint nests the model under "model" next to other states
    dcp.save(
        {"model": state, "train_state": {"step": torch.tensor(3)}}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True
    )

    hf_args = ["--hf-config", config_path, "--max-shard-size", "100KB", "--dtype", "float32"]  # float32: exact
    convert_hf.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), *hf_args])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["torch_dtype"] == "float32"  # sigmoid routing
    hf = load_hf_safetensors(str(tmp_path / "hf"))
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in hf

    convert_hf.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")])  # shape from hf/config.json
    back = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load({"model": back}, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    for key, value in state.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float16"])
def test_to_hf_reads_top_level_model_only_checkpoint_and_casts(tmp_path, dtype):
    """bfloat16 unless --dtype says otherwise; the router's selection bias stays float32."""
    state, config_path = _tiny_state(tmp_path)
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    cast = ["--dtype", dtype] if dtype else []
    convert_hf.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf-config", config_path, *cast])
    hf = load_hf_safetensors(str(tmp_path / "hf"))
    expected = getattr(torch, dtype or "bfloat16")
    assert hf["model.embed_tokens.weight"].dtype == expected
    assert hf["model.layers.2.mlp.experts.3.up_proj.weight"].dtype == expected
    assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == str(expected)[6:]


def _published_checkpoint(tmp_path, args=ARGS):
    """A trainer-style checkpoint: DCP files plus the complete.json manifest (sizes, crc32) written with them."""
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    tmp = str(tmp_path / "checkpoint" / "step-3.tmp")
    dcp.save({"model": model.state_dict(), "train_state": {"step": torch.tensor(3)}}, checkpoint_id=tmp, no_dist=True)
    write_rank_checksums(tmp, rank=0)
    return Path(publish(str(tmp_path / "checkpoint"), 3, tmp, FORMAT_FULL))


def _shape_config(tmp_path, args) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config_from_model_args(args)))
    return str(path)


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("flip", r"step-3 is corrupt: __0_0\.distcp no longer match\(es\) the checksum.*convert an intact checkpoint"),
        ("truncate", r"__0_0\.distcp has \d+ bytes, the manifest says \d+ \(truncated.*Nothing was written"),
    ],
    ids=["bit-flip", "truncated"],
)
def test_to_hf_verifies_the_manifest_before_writing(tmp_path, damage, expected):
    checkpoint = _published_checkpoint(tmp_path)
    shard = checkpoint / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw) if damage == "flip" else bytes(raw[:-64]))
    with pytest.raises(CheckpointError, match=expected):
        convert_hf.main(["to-hf", str(checkpoint), str(tmp_path / "hf"), "--hf-config", _shape_config(tmp_path, ARGS)])
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "shape, expected",
    [
        (dict(dim=32), r"model\.tok_embeddings\.weight is \(128, 64\), \(128, 32\) in that shape: give the --flavor"),
        (dict(n_layers=2), r"holds \d+ model tensors this shape lacks, e.g. \['layers\.2\..*give the --flavor"),
    ],
    ids=["smaller-dim", "fewer-layers"],
)
def test_to_hf_refuses_a_shape_its_tensors_do_not_have(tmp_path, shape, expected):
    """The issue's `--flavor debugmodel_tiny` on a debugmodel checkpoint: same names, other shapes; config.json
    would describe another model than its tensors."""
    checkpoint = _published_checkpoint(tmp_path, tiny_args())
    other = _shape_config(tmp_path, tiny_args(**shape))
    with pytest.raises(ValueError, match=expected):
        convert_hf.main(["to-hf", str(checkpoint), str(tmp_path / "hf"), "--hf-config", other])
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["from-hf", "{tmp}/nonexistent", "{tmp}/out"], "error: {tmp}/nonexistent is not a folder: give a HF folder"),
        (["to-hf", "{tmp}", "{tmp}/out", "--flavor", "debugmodel_tiny"], "error: {tmp} is not a DCP checkpoint (no "),
        (["to-hf", "{tmp}", "{tmp}/out"], "error: to-hf needs --flavor or --hf-config"),
        (
            ["to-hf", "{tmp}", "{tmp}/out", "--flavor", "debugmodel_tiny", "--mtp-layers", "-1"],
            "error: --mtp-layers -1: pass 0 or more",
        ),
    ],
    ids=["from-hf-missing-folder", "to-hf-without-metadata", "to-hf-without-shape", "negative-mtp-layers"],
)
def test_bad_input_is_one_error_line_without_traceback(tmp_path, monkeypatch, argv, expected):
    """Run as a script: exit code 1 and one `error:` line (SystemExit's message, which Python prints to stderr)."""
    monkeypatch.setattr(sys, "argv", [_SCRIPT, *(arg.format(tmp=tmp_path) for arg in argv)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(_SCRIPT, run_name="__main__")
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message  # a str code exits with status 1
    assert message.startswith(expected.format(tmp=tmp_path)), message


@pytest.mark.parametrize("direction", ["to-hf", "from-hf"])
@pytest.mark.parametrize("how", ["read-only", "file-in-the-way"])
def test_an_output_folder_that_cannot_be_made_is_one_error_line_naming_it(tmp_path, monkeypatch, direction, how):
    """It was an errno line, or a traceback (a shard written into a read-only folder, from-hf's DCP save)."""
    if direction == "to-hf":
        argv = [str(_published_checkpoint(tmp_path)), "--hf-config", _shape_config(tmp_path, ARGS)]
    else:
        argv = [str(_hf_folder(tmp_path))]
    parent = tmp_path / "parent"
    if how == "read-only":
        parent.mkdir()

        def mkdtemp(dir):  # root writes anywhere: chmod cannot show it
            raise PermissionError(13, "Permission denied", dir)

        monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    else:
        parent.write_text("")
    monkeypatch.setattr(sys, "argv", [_SCRIPT, direction, argv[0], str(parent / "out"), *argv[1:]])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(_SCRIPT, run_name="__main__")
    reason = "Permission denied" if how == "read-only" else "Not a directory"
    assert exit_info.value.code == (
        f"error: cannot write {parent / 'out'}: {parent} takes no new folder ({reason}); give an output folder you "
        "can write"
    )
    assert not (parent / "out").exists()


def _hf_folder(tmp_path, args=ARGS) -> Path:
    """An HF export (safetensors + config.json) of a tiny model."""
    state, config_path = _tiny_state(tmp_path)
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    convert_hf.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf-config", config_path])
    return tmp_path / "hf"


def test_from_hf_refuses_an_existing_checkpoint_folder_and_leaves_it_as_it_was(tmp_path):
    """Converting into a training checkpoint's folder used to overwrite its shards in place (it could not resume)."""
    checkpoint = _published_checkpoint(tmp_path)
    before = {path.name: path.read_bytes() for path in checkpoint.iterdir()}
    hf = _hf_folder(tmp_path)
    with pytest.raises(ValueError, match=r"step-3 exists and is not an empty folder: nothing was written; give a new"):
        convert_hf.main(["from-hf", str(hf), str(checkpoint)])
    assert {path.name: path.read_bytes() for path in checkpoint.iterdir()} == before
    (tmp_path / "empty").mkdir()
    convert_hf.main(["from-hf", str(hf), str(tmp_path / "empty")])
    assert (tmp_path / "empty" / ".metadata").is_file()  # an empty folder counts as new


def test_from_hf_refuses_a_model_shape_other_than_the_folders(tmp_path):
    """`--hf-config` (or `--flavor`) of another shape than the folder's tensors: one error naming a tensor, no DCP
    of the wrong shapes."""
    hf = _hf_folder(tmp_path)
    other = _shape_config(tmp_path, tiny_args(q_lora_rank=24, dim=32, moe=MOE))
    with pytest.raises(
        ValueError, match=r"hf: \S+\.weight is \(128, 64\), \(128, 32\) in the model shape given: give the --flavor"
    ):
        convert_hf.main(["from-hf", str(hf), str(tmp_path / "out"), "--hf-config", other])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "mtp_layers, expected",
    [
        (0, r"hf: transformer layers past the 2 \(and 0 MTP\) of the model shape given: model\.layers\.2\.\* to "),
        (1, r"hf: model\.layers\.2\.\* is a transformer layer, not an MTP module: the checkpoint is a deeper model "),
    ],
    ids=["without-mtp", "with-mtp"],
)
def test_from_hf_refuses_a_shape_of_fewer_layers_than_the_folders(tmp_path, mtp_layers, expected):
    """Its last layers were left out silently (or, with MTP, taken for an MTP module and called corrupt)."""
    hf = _hf_folder(tmp_path)
    other = _shape_config(tmp_path, tiny_args(q_lora_rank=24, n_layers=2, mtp_layers=mtp_layers, moe=MOE))
    with pytest.raises(ValueError, match=expected):
        convert_hf.main(["from-hf", str(hf), str(tmp_path / "out"), "--hf-config", other])
    assert not (tmp_path / "out").exists()


def test_to_hf_refuses_non_finite_weights_without_a_manifest(tmp_path):
    """A DCP folder as from-hf writes it (no manifest to check) holding a NaN weight: refused, nothing written."""
    state, config_path = _tiny_state(tmp_path)
    state["layers.1.attention.wo.weight"][0, 0] = float("nan")
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attention\.wo\.weight holds inf or NaN values; nothing was"):
        convert_hf.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf-config", config_path])
    assert not (tmp_path / "hf").exists()


def test_to_hf_with_a_config_naming_mtp_layers_the_checkpoint_lacks_exports_what_it_holds(tmp_path):
    # the config.json the run started from names an MTP layer (transformers' default), the trained model had none
    state, config_path = _tiny_state(tmp_path)
    config = json.loads(Path(config_path).read_text())
    config["num_nextn_predict_layers"] = 1
    Path(config_path).write_text(json.dumps(config))
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    convert_hf.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf-config", config_path])
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["num_nextn_predict_layers"] == 0
    assert len(load_hf_safetensors(str(tmp_path / "hf"))) > 0


def test_from_hf_of_a_dcp_checkpoint_says_what_it_is(tmp_path):
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / ".metadata").write_bytes(b"x")
    with pytest.raises(
        ValueError, match=r"step-2 is a DCP checkpoint, not a Hugging Face folder: export it with to-hf"
    ):
        convert_hf.main(["from-hf", str(tmp_path / "step-2"), str(tmp_path / "out")])


def _damage_shards(hf: Path, damage: str, monkeypatch) -> None:
    index = hf / "model.safetensors.index.json"
    second = sorted(hf.glob("model-00002-of-*.safetensors"))[0]
    if damage == "missing":
        second.unlink()
    elif damage == "truncated":
        second.write_bytes(second.read_bytes()[:100])
    elif damage == "denied":  # root reads anything: chmod 000 cannot show it
        from torchtitan.components import hf_checkpoint

        real = hf_checkpoint.safe_open

        def safe_open(path, **kwargs):
            if path == str(second):
                raise PermissionError(13, "Permission denied", path)
            return real(path, **kwargs)

        monkeypatch.setattr(hf_checkpoint, "safe_open", safe_open)
    elif damage == "not-json":
        index.write_text("{bad")
    else:
        index.write_text(json.dumps({"metadata": {}}))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (
            "missing",
            r"{index} names 1 shard\(s\) missing from the folder, e.g. {shard}: the folder is incomplete \(an "
            r"interrupted export or download\); rerun scripts/convert_hf\.py to-hf into a new folder, or fetch the",
        ),
        ("truncated", r"cannot read shard {hf}/{shard} \(listed in {index}\) \(.*\): truncated\? fetch or convert"),
        ("denied", r"cannot read shard {hf}/{shard} \(listed in {index}\) \(.*Permission denied.*\): fix its perm"),
        ("not-json", r"{index} is not a safetensors index \(JSONDecodeError\(.*\)\): fetch the folder again"),
        ("no-weight-map", r"{index} is not a safetensors index \(KeyError\('weight_map'\)\): fetch the folder again"),
    ],
    ids=["missing-shard", "truncated-shard", "unreadable-shard", "index-not-json", "index-without-weight-map"],
)
def test_a_damaged_hf_folder_is_one_error_line_naming_the_shard_and_the_index(tmp_path, monkeypatch, damage, expected):
    """A shard the index names that is missing or unreadable, or an index that is not one: from-hf says which file,
    in one `error:` line, and writes nothing."""
    state, config_path = _tiny_state(tmp_path)
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    hf = tmp_path / "hf"
    convert_hf.main(["to-hf", str(tmp_path / "ckpt"), str(hf), "--hf-config", config_path, "--max-shard-size", "50KB"])
    shard = sorted(hf.glob("model-00002-of-*.safetensors"))[0].name
    _damage_shards(hf, damage, monkeypatch)
    monkeypatch.setattr(sys, "argv", [_SCRIPT, "from-hf", str(hf), str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(_SCRIPT, run_name="__main__")
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message
    index = re.escape(str(hf / "model.safetensors.index.json"))
    assert re.match("error: " + expected.format(hf=re.escape(str(hf)), index=index, shard=shard), message), message
    assert not (tmp_path / "out").exists()


def _run_script(monkeypatch, *argv) -> str:
    """convert_hf.py run as a script: its one `error:` line (SystemExit's message)."""
    monkeypatch.setattr(sys, "argv", [_SCRIPT, *map(str, argv)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(_SCRIPT, run_name="__main__")
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message, message
    return message


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


@pytest.mark.parametrize("where", ["shard", "index"])
def test_to_hf_into_a_full_disk_is_one_line_naming_the_folder_and_the_space_it_needs(tmp_path, monkeypatch, where):
    """It was a SafetensorError's traceback; now nothing is left of the export and the checkpoint is as it was."""
    checkpoint = _published_checkpoint(tmp_path)
    before = _files(checkpoint)
    fail_hf_writes(monkeypatch, errno.ENOSPC, where)
    out = tmp_path / "hf"
    message = _run_script(monkeypatch, "to-hf", checkpoint, out, "--hf-config", _shape_config(tmp_path, ARGS))
    assert re.fullmatch(
        rf"error: exporting {re.escape(str(checkpoint))} failed, nothing was written \({re.escape(str(checkpoint))} is "
        rf"untouched\): No space left on device in {re.escape(str(out))}: the export needs \d+\.\d KiB, [\d.]+ [KMG]iB "
        r"are free there; free the space, or give another output folder",
        message,
    ), message
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "config.json"]  # no output, no .incomplete-* folder
    assert _files(checkpoint) == before


def test_to_hf_into_a_folder_it_cannot_write_is_one_line_naming_it(tmp_path, monkeypatch):
    """A write refused (permission, a read-only disk) after the output folder could be made."""
    checkpoint = _published_checkpoint(tmp_path)
    fail_hf_writes(monkeypatch, errno.EACCES, "shard")
    out = tmp_path / "hf"
    message = _run_script(monkeypatch, "to-hf", checkpoint, out, "--hf-config", _shape_config(tmp_path, ARGS))
    assert message == (
        f"error: exporting {checkpoint} failed, nothing was written ({checkpoint} is untouched): {out} cannot be "
        "written (Permission denied); make it writable, or give another output folder"
    )
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "config.json"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder: the test above fakes the refusal")
def test_to_hf_into_a_read_only_folder_is_one_line_naming_it(tmp_path, monkeypatch):
    checkpoint = _published_checkpoint(tmp_path)
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        message = _run_script(
            monkeypatch, "to-hf", checkpoint, parent / "hf", "--hf-config", _shape_config(tmp_path, ARGS)
        )
    finally:
        parent.chmod(0o755)
    assert message == (
        f"error: cannot write {parent / 'hf'}: {parent} takes no new folder (Permission denied); give an output "
        "folder you can write"
    )
    assert os.listdir(parent) == []


class _Killed(BaseException):
    """kill -9 mid-export: nothing of the process runs after it (no cleanup)."""


def _killed_export(tmp_path, monkeypatch) -> Path:
    """to-hf killed after writing its first shard (of several); returns the folder it was writing into."""
    from torchtitan.components import hf_safetensors

    real_save, written = hf_safetensors._save_file, []

    def save_then_die(tensors, path):
        if written:
            raise _Killed
        real_save(tensors, path)
        written.append(path)

    with monkeypatch.context() as patch:
        patch.setattr(hf_safetensors, "_save_file", save_then_die)
        patch.setattr(convert_hf.shutil, "rmtree", lambda *args, **kwargs: None)
        with pytest.raises(_Killed):
            argv = ["--hf-config", _shape_config(tmp_path, ARGS), "--max-shard-size", "50KB"]
            convert_hf.main(["to-hf", str(_published_checkpoint(tmp_path)), str(tmp_path / "hf"), *argv])
    (incomplete,) = tmp_path.glob("hf.incomplete-*")
    return incomplete


def test_a_killed_to_hf_leaves_no_output_folder_and_its_partial_one_is_called_incomplete(tmp_path, monkeypatch):
    """The trainer called what a killed export left "another model than --model.flavor builds"."""
    incomplete = _killed_export(tmp_path, monkeypatch)
    assert not (tmp_path / "hf").exists()
    assert [path.name for path in incomplete.iterdir()] == ["model-00001-of-00008.safetensors"]
    line = (
        f"{incomplete} holds 1 shard(s) (model-00001-of-00008.safetensors, ...) but not their "
        "model.safetensors.index.json, which is written after every shard: the folder is incomplete (an interrupted "
        "export or download); rerun scripts/convert_hf.py to-hf into a new folder, or fetch the folder again"
    )
    assert _run_script(
        monkeypatch, "from-hf", incomplete, tmp_path / "out", "--hf-config", tmp_path / "config.json"
    ) == (f"error: {line}")
    with pytest.raises(CheckpointError) as err:
        load_initial_hf([DeepSeekV3Model(ARGS)], ARGS, incomplete, tmp_path / "run")
    assert str(err.value) == f"checkpoint.initial_load_path {incomplete}: {line}; or point it elsewhere"


def _mix_shards(hf: Path, how: str) -> tuple[str, str]:
    """A shard that no longer holds what the index lists in it ("absent": one tensor gone) or that holds a tensor the
    index does not list ("unlisted"); returns (that shard, the tensor)."""
    from safetensors.torch import load_file, save_file

    shard = sorted(hf.glob("model-00002-of-*.safetensors"))[0]
    tensors = load_file(str(shard))
    key = sorted(tensors)[0]
    if how == "absent":
        del tensors[key]
    else:
        key = "model.layers.1.self_attn.o_proj.weight_copy"
        tensors[key] = torch.zeros(1)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return str(shard), key


@pytest.mark.parametrize("how", ["absent", "unlisted"])
@pytest.mark.parametrize("reader", ["trainer", "from-hf"])
def test_shards_that_do_not_hold_what_the_index_lists_are_an_incomplete_folder(tmp_path, monkeypatch, how, reader):
    """A shard rewritten after the index (an interrupted export or download, or parts of two exports): the tensors
    missing were "another model", an unlisted one went unread."""
    hf = _hf_folder(tmp_path)
    shutil.rmtree(hf)
    argv = ["--hf-config", str(tmp_path / "tiny_config.json"), "--max-shard-size", "50KB"]
    convert_hf.main(["to-hf", str(tmp_path / "ckpt"), str(hf), *argv])
    shard, key = _mix_shards(hf, how)
    index = hf / "model.safetensors.index.json"
    fix = (
        "the folder is incomplete or mixed (an interrupted export or download); rerun scripts/convert_hf.py to-hf into "
        "a new folder, or fetch the folder again"
    )
    if how == "absent":
        line = f"{index} lists 1 tensor(s) in {shard} that it does not hold, e.g. {key}: {fix}"
    else:
        line = f"{shard} holds 1 tensor(s) that {index} does not list, e.g. {key}: {fix}"
    if reader == "from-hf":
        assert _run_script(monkeypatch, "from-hf", hf, tmp_path / "out") == f"error: {line}"
        assert not (tmp_path / "out").exists()
    else:
        with pytest.raises(CheckpointError) as err:
            load_initial_hf([DeepSeekV3Model(ARGS)], ARGS, hf, tmp_path / "run")
        assert str(err.value) == f"checkpoint.initial_load_path {hf}: {line}; or point it elsewhere"


def test_to_hf_of_softmax_routing_with_a_selection_bias_is_one_line_or_drops_the_bias_when_asked(tmp_path, monkeypatch):
    """transformers' DeepseekV2, softmax routing's type, ignores the bias: the export was not the model trained."""
    args = tiny_args()  # softmax routing
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    state = model.state_dict()
    state["layers.1.moe.expert_bias"][2] = 0.01  # as training's aux-loss-free balancing leaves it
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    shape = ["--hf-config", _shape_config(tmp_path, args)]
    message = _run_script(monkeypatch, "to-hf", tmp_path / "ckpt", tmp_path / "hf", *shape)
    assert message.startswith(
        "error: layers.1.moe.expert_bias is not zero (training balanced the experts with it), but softmax routing "
        "exports as deepseek_v2, whose transformers code selects experts without the routers' selection bias"
    ), message
    assert not (tmp_path / "hf").exists()
    convert_hf.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), *shape, "--drop-selection-bias"])
    assert not any(key.endswith("e_score_correction_bias") for key in load_hf_safetensors(str(tmp_path / "hf")))
    with pytest.raises(ValueError, match=r"^--drop-selection-bias is for to-hf: from-hf reads the folder's selection"):
        convert_hf.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back"), "--drop-selection-bias"])
