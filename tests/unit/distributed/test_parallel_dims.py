"""ParallelDims: the degrees resolve into meshes with the right ranks; preflight rejects a layout that cannot fill
the world size or divide the model with one message naming the fix."""

from types import SimpleNamespace

import pytest

from tests.unit.distributed._spawn import run_distributed
from torchtitan.config import ConfigError
from torchtitan.distributed.degrees import check_parallel_dims
from torchtitan.distributed.parallel_dims import ParallelDims


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
        (
            dict(world_size=2, pp=8),
            {},
            "pp(8) = 8 processes at least, but the world size is 2; pass --parallelism.pipeline_parallel_degree 2",
        ),
        (dict(world_size=6, tp=4), {}, "a multiple of dp_replicate * cp * tp * pp = 4"),
        (dict(world_size=8, tp=2, ep=3), {}, "must divide data_parallel_shard_degree * context_parallel_degree"),
        (dict(world_size=8, tp=4, etp=4, ep=4), {}, "must divide data_parallel_shard_degree (2) when"),
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


def _deepseek_v3_671b():
    return _model_args(n_heads=128, n_layers=61, moe_inter_dim=2048, moe_args=SimpleNamespace(num_experts=256))


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        # the 671B job's PP 16 x EP 8 on one node: the degrees fill multiples of 128 processes, not of 16
        (dict(world_size=8, pp=16, ep=8), "launch a multiple of 128 processes (NNODES x NGPU), or pass "
         "--parallelism.pipeline_parallel_degree 1"),
        # ... on 8 nodes: PP 16 leaves EP 4 ranks, so PP is the limit (named first); EP 4 and 128 processes fit too
        (dict(world_size=64, pp=16, ep=8), "EP borrows its ranks from FSDP, CP and TP, and pipeline_parallel_degree "
         "16 leaves it 4 of the 64 processes; pass --parallelism.pipeline_parallel_degree 8, or "
         "--parallelism.expert_parallel_degree 4, or launch a multiple of 128 processes (NNODES x NGPU)"),
        # a dp_shard given, not filled in: EP is the choice, no other degree is the limit
        (dict(world_size=8, dp_shard=4, tp=2, ep=16), "(4 * 1 * 2 = 8): EP borrows its ranks from FSDP, CP and TP; "
         "pass --parallelism.expert_parallel_degree 8"),
        (dict(world_size=12, dp_shard=4, tp=2), "= 8 but the world size is 12; data_parallel_shard_degree=-1 fills in "
         "the rest when the world size is a multiple of dp_replicate * cp * tp * pp = 2; launch 8 processes (NNODES x "
         "NGPU), or pass --parallelism.data_parallel_shard_degree 6"),
    ],
)  # fmt: skip
def test_a_layout_that_does_not_fit_names_values_that_do_and_the_degree_that_is_the_limit(kwargs, fix):
    """Each value named fits: the message offers what was tried, not a direction ("change expert_parallel_degree")."""
    with pytest.raises(ConfigError) as info:
        check_parallel_dims(dims(**kwargs), _deepseek_v3_671b())
    assert str(info.value).endswith(fix) and "\n" not in str(info.value)


def test_the_smallest_world_size_that_fits_counts_in_whole_nodes():
    from torchtitan.distributed.degrees import LayoutError

    with pytest.raises(LayoutError) as info:
        check_parallel_dims(dims(world_size=8, pp=16, ep=8), _deepseek_v3_671b())
    assert info.value.smallest_world_size() == 128 and info.value.smallest_world_size(multiple_of=8) == 128
    with pytest.raises(LayoutError) as info:  # 24 processes fill pp 3 x ep 8; in nodes of 16, 48 do
        check_parallel_dims(dims(world_size=8, pp=3, ep=8), _deepseek_v3_671b())
    assert (info.value.smallest_world_size(), info.value.smallest_world_size(multiple_of=16)) == (24, 48)
    with pytest.raises(LayoutError) as info:  # a model the degree does not divide: no world size fits
        check_parallel_dims(dims(world_size=8, ep=8), _model_args(moe_args=SimpleNamespace(num_experts=12)))
    assert info.value.smallest_world_size() is None


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
