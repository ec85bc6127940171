"""Parallelism degrees, their validation, and the device meshes built from them.

Rank layout (outermost to innermost): pp, dp_replicate, dp_shard, cp, tp. Every named mesh is an `_unflatten` of
the one-dimensional world mesh, so all meshes share a root and FSDP2 can combine them with TP/EP DTensor meshes:

    dense  (pp, dp_replicate, dp_shard, cp, tp)              attention, dense FFN, router, shared experts
    batch  (pp, dp, cp, tp)                                  dp = dp_replicate * dp_shard: data loading
    fsdp   (pp, dp_replicate, dp_shard_cp, tp)               FSDP shards over dp_shard x cp
    sparse (pp, dp_replicate, dp_shard_mod_ep, ep)           routed experts, etp == 1: EP borrows dp_shard, cp, tp
    sparse (pp, dp_replicate, dp_shard_mod_ep, ep, etp)      routed experts, etp == tp: EP borrows dp_shard only

CP ranks load the same samples (batch mesh "dp"), while FSDP, EP and the loss's reduction treat them like data-
parallel ranks ("dp_shard_cp", "dp_cp"; with cp == 1 these are "dp_shard" / "dp").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims"]

# Names accepted by `get_mesh`, beyond the ones built directly.
_ALIASES = {"dp_cp": "dp", "dp_shard_cp": "dp_shard", "fsdp": "dp_shard", "efsdp": "dp_shard_mod_ep"}


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    etp: int
    world_size: int
    cp: int = 1
    enable_loss_parallel: bool = True
    dp_shard_filled: bool = field(default=False, init=False)
    """Whether dp_shard was -1 (the rest of the world size), not given."""
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _world_mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, parallelism_config: Any, world_size: int) -> ParallelDims:
        """Build from `JobConfig.parallelism`; `data_parallel_shard_degree` -1 takes the rest of the world size."""
        return cls(
            dp_replicate=parallelism_config.data_parallel_replicate_degree,
            dp_shard=parallelism_config.data_parallel_shard_degree,
            tp=parallelism_config.tensor_parallel_degree,
            pp=parallelism_config.pipeline_parallel_degree,
            ep=parallelism_config.expert_parallel_degree,
            etp=parallelism_config.expert_tensor_parallel_degree,
            world_size=world_size,
            cp=parallelism_config.context_parallel_degree,
            enable_loss_parallel=parallelism_config.enable_loss_parallel,
        )

    def __post_init__(self) -> None:
        # preflight.check_parallel_dims explains a layout that does not fill the world size; build_mesh fails on one.
        self.dp_shard_filled = self.dp_shard == -1
        if self.dp_shard_filled:
            self.dp_shard = self.world_size // (self.dp_replicate * self.cp * self.tp * self.pp)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh and every named submesh. Collective: call on all ranks."""
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        dense = world._unflatten(
            0,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
        batch = world._unflatten(0, (self.pp, self.dp_size, self.cp, self.tp), ("pp", "dp", "cp", "tp"))
        meshes = {
            "pp": dense["pp"],
            "dp_replicate": dense["dp_replicate"],
            "dp_shard": dense["dp_shard"],
            "tp": dense["tp"],
            "dp": batch["dp"],
            ("dp_replicate", "dp_shard"): dense["dp_replicate", "dp_shard"],
            ("dp_shard", "tp"): dense["dp_shard", "tp"],
        }
        if self.cp > 1:
            fsdp = world._unflatten(
                0,
                (self.pp, self.dp_replicate, self.dp_shard * self.cp, self.tp),
                ("pp", "dp_replicate", "dp_shard_cp", "tp"),
            )
            meshes["cp"] = dense["cp"]
            meshes["dp_shard_cp"] = fsdp["dp_shard_cp"]
            meshes[("dp_replicate", "dp_shard_cp")] = fsdp["dp_replicate", "dp_shard_cp"]
            loss = world._unflatten(0, (self.pp, self.dp_size * self.cp, self.tp), ("pp", "dp_cp", "tp"))
            meshes["dp_cp"] = loss["dp_cp"]
        sparse_sizes = (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.ep)
        sparse_names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep")
        if self.etp > 1:
            sparse = world._unflatten(0, (*sparse_sizes, self.etp), (*sparse_names, "etp"))
            meshes["etp"] = sparse["etp"]
            meshes[("ep", "etp")] = sparse["ep", "etp"]
        else:
            sparse = world._unflatten(0, sparse_sizes, sparse_names)
        meshes["ep"] = sparse["ep"]
        meshes["dp_shard_mod_ep"] = sparse["dp_shard_mod_ep"]
        meshes[("dp_replicate", "dp_shard_mod_ep")] = sparse["dp_replicate", "dp_shard_mod_ep"]
        if self.moe_tokens_sequence_sharded:
            # MoE layers see different tokens on each tp rank; expert-load counts reduce over dp x tp.
            meshes["dp_tp"] = world._unflatten(0, (self.pp, self.world_size // self.pp), ("pp", "dp_tp"))["dp_tp"]
        self._meshes = {(k,) if isinstance(k, str) else k: v for k, v in meshes.items()}
        self._world_mesh = world
        expected = {
            "pp": self.pp,
            "dp": self.dp_replicate * self.dp_shard,
            "dp_shard": self.dp_shard,
            "dp_shard_cp": self.dp_shard * self.cp,
            "dp_cp": self.dp_size * self.cp,
            "tp": self.tp,
            "ep": self.ep,
            "dp_shard_mod_ep": self.dp_shard_mod_ep,
        }
        for name, size in expected.items():
            assert self.get_mesh(name).size() == size, (name, self.get_mesh(name).size(), size)
        return world

    def get_mesh(self, names: str | list[str] | tuple[str, ...]) -> DeviceMesh:
        """A submesh by name ("dp", "dp_shard", "tp", "pp", "ep", "etp", "dp_cp", "dp_shard_mod_ep", ...)
        or by a list of names ("dp_replicate", "dp_shard") for multi-dimensional meshes."""
        if self._world_mesh is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must run before get_mesh().")
        names = [names] if isinstance(names, str) else names
        key = tuple(n if (n,) in self._meshes else _ALIASES.get(n, n) for n in names)
        if key not in self._meshes:
            valid = sorted(k[0] for k in self._meshes if len(k) == 1) + sorted(_ALIASES)
            raise KeyError(f"no mesh named {names!r}; valid names: {valid} (and their listed combinations)")
        return self._meshes[key]

    def get_optional_mesh(self, names: str | list[str] | tuple[str, ...]) -> DeviceMesh | None:
        """Like `get_mesh`, but None when the mesh is missing or has a single rank."""
        try:
            mesh = self.get_mesh(names)
        except KeyError:
            return None
        return mesh if mesh.size() > 1 else None

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._world_mesh is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must run before world_mesh is used.")
        return self._world_mesh

    @property
    def dp_shard_mod_ep(self) -> int:
        """Ranks that FSDP-shard the routed experts (the EP ranks are taken out)."""
        if self.etp > 1:
            return self.dp_shard // self.ep
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model: dense weights shard over dp_shard x cp, experts over what EP leaves."""
        return self.dp_enabled or self.cp_enabled or self.ep_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp > 1 and self.enable_loss_parallel

    @property
    def moe_tokens_sequence_sharded(self) -> bool:
        """EP borrows TP ranks (etp == 1): each tp rank routes and dispatches its own sequence shard."""
        return self.ep > 1 and self.tp > 1 and self.etp == 1

    @property
    def dp_size(self) -> int:
        """Batch ranks (data loader shards)."""
        return self.dp_replicate * self.dp_shard
