"""ParallelDims: the degrees resolve into meshes with the right ranks; preflight rejects a layout that cannot fill
the world size or divide the model with one message naming the fix."""

from types import SimpleNamespace

import pytest

from tests.unit.distributed._spawn import run_distributed
from torchtitan.config import ConfigError
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.preflight import check_parallel_dims


def dims(world_size=8, dp_replicate=1, dp_shard=-1, tp=1, pp=1, ep=1, etp=1, cp=1) -> ParallelDims:
    return ParallelDims(
        dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep, etp=etp, world_size=world_size, cp=cp
    )


def _model_args(**overrides):
    args = dict(n_heads=16, n_layers=6, moe_inter_dim=256, moe_args=SimpleNamespace(num_experts=8))
    args.update(overrides)
    return SimpleNamespace(**args)


def test_dp_shard_minus_one_takes_the_rest():
    assert dims(world_size=16, dp_replicate=2, tp=2, pp=2).dp_shard == 2


def test_ep_may_borrow_tp_ranks_when_etp_is_1():
    parallel = dims(world_size=8, tp=2, ep=4)
    check_parallel_dims(parallel, _model_args())
    assert parallel.dp_shard == 4 and parallel.dp_shard_mod_ep == 2 and parallel.moe_tokens_sequence_sharded


@pytest.mark.parametrize(
    "kwargs, model_overrides, fragment",
    [
        (dict(world_size=8, dp_shard=3), {}, "but the world size is 8"),
        (dict(world_size=2, pp=8), {}, "pp(8) = 8 processes at least, but the world size is 2; lower those degrees"),
        (dict(world_size=6, tp=4), {}, "a multiple of dp_replicate * cp * tp * pp = 4"),
        (dict(world_size=8, tp=2, ep=3), {}, "must divide data_parallel_shard_degree * context_parallel_degree"),
        (dict(world_size=8, tp=4, etp=4, ep=4), {}, "must divide data_parallel_shard_degree (2)"),
        (dict(ep=8), dict(moe_args=SimpleNamespace(num_experts=12)), "num_experts (12)"),
        (dict(tp=2, etp=2), dict(moe_inter_dim=255), "moe_inter_dim (255)"),
        (dict(tp=8), dict(n_heads=12), "n_heads (12)"),
        (dict(pp=8), dict(n_layers=6), "n_layers (6)"),
    ],
)
def test_preflight_rejects_layouts_that_do_not_fill_the_world_or_divide_the_model(kwargs, model_overrides, fragment):
    with pytest.raises(ConfigError) as info:
        check_parallel_dims(dims(**kwargs), _model_args(**model_overrides))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def _mesh_layout(rank: int, world_size: int) -> None:
    # 8 ranks would be slow on 2 cores; 4 ranks cover borrowing (tp2 ep2) and ETP (tp2 ep2 etp2 needs dp_shard 2: 8)
    parallel = dims(world_size=4, tp=2, ep=2)
    parallel.build_mesh("cpu")
    mine = {name: parallel.get_mesh(name).mesh.tolist() for name in ("dp", "tp", "ep", "dp_shard_mod_ep")}
    # layout (dp_shard=2, tp=2): rank = 2 * dp_shard_index + tp_index; EP is innermost over dp_shard x tp
    expected = {
        0: dict(dp=[0, 2], tp=[0, 1], ep=[0, 1], dp_shard_mod_ep=[0, 2]),
        1: dict(dp=[1, 3], tp=[0, 1], ep=[0, 1], dp_shard_mod_ep=[1, 3]),
        2: dict(dp=[0, 2], tp=[2, 3], ep=[2, 3], dp_shard_mod_ep=[0, 2]),
        3: dict(dp=[1, 3], tp=[2, 3], ep=[2, 3], dp_shard_mod_ep=[1, 3]),
    }[rank]
    for name, value in expected.items():
        assert mine[name] == value, (rank, name, mine[name], value)
    assert parallel.get_mesh("dp_cp") is parallel.get_mesh("dp")
    assert parallel.get_mesh("dp_tp").size() == 4  # expert-bias counts reduce over dp x tp when EP borrows tp
    assert parallel.get_optional_mesh("pp") is None and parallel.loss_parallel_enabled
    with pytest.raises(KeyError, match="valid names"):
        parallel.get_mesh("cp")

    # CP=2 inside dp_shard=2: the cp ranks load the same data (dp), FSDP, EP and the loss span dp x cp
    context = dims(world_size=4, cp=2, ep=4)
    context.build_mesh("cpu")
    mine = {name: context.get_mesh(name).mesh.tolist() for name in ("dp", "cp", "dp_shard_cp", "dp_cp", "ep")}
    expected = dict(dp=[rank % 2, rank % 2 + 2], cp=[rank // 2 * 2, rank // 2 * 2 + 1])
    assert mine == {**expected, "dp_shard_cp": [0, 1, 2, 3], "dp_cp": [0, 1, 2, 3], "ep": [0, 1, 2, 3]}, (rank, mine)
    assert context.dp_shard_mod_ep == 1 and context.dp_size == 2

    etp = dims(world_size=4, tp=2, ep=2, etp=2, dp_shard=2)
    etp.build_mesh("cpu")
    assert etp.get_mesh(["ep", "etp"]).mesh.tolist() == [[0, 1], [2, 3]]
    assert etp.get_mesh("ep").size() == 2 and etp.dp_shard_mod_ep == 1


def test_mesh_layout_on_4_gloo_ranks():
    run_distributed(_mesh_layout, 4)
