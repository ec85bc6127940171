"""Parallelism degrees, their validation, and the device meshes built from them.

Rank layout (outermost to innermost): pp, dp_replicate, dp_shard, tp. Every named mesh is an
`_unflatten` of the one-dimensional world mesh, so meshes from different layouts share a root and
FSDP2 can combine them with TP/EP DTensor meshes:

    dense  (pp, dp_replicate, dp_shard, tp)              attention, dense FFN, router, shared experts
    batch  (pp, dp, tp)                                  dp = dp_replicate * dp_shard: data loading, loss
    sparse (pp, dp_replicate, dp_shard_mod_ep, ep)       routed experts, etp == 1: EP borrows dp_shard and tp
    sparse (pp, dp_replicate, dp_shard_mod_ep, ep, etp)  routed experts, etp == tp: EP borrows dp_shard only

Context parallelism is not implemented: there is no cp degree, and "dp_cp" / "dp_shard_cp" are the
"dp" / "dp_shard" meshes (the names the trainer and torchtitan use for "batch ranks" and "FSDP ranks").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims", "ParallelDimsError"]


class ParallelDimsError(ValueError):
    """An impossible combination of parallelism degrees; the message names the fix."""


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
    enable_loss_parallel: bool = True
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _world_mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, parallelism_config: Any, world_size: int) -> ParallelDims:
        """Build from `JobConfig.parallelism`; raises `ParallelDimsError` on an invalid combination."""
        return cls(
            dp_replicate=parallelism_config.data_parallel_replicate_degree,
            dp_shard=parallelism_config.data_parallel_shard_degree,
            tp=parallelism_config.tensor_parallel_degree,
            pp=parallelism_config.pipeline_parallel_degree,
            ep=parallelism_config.expert_parallel_degree,
            etp=parallelism_config.expert_tensor_parallel_degree,
            world_size=world_size,
            enable_loss_parallel=parallelism_config.enable_loss_parallel,
        )

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        # All checks are pure arithmetic so a bad config fails on every rank before any collective.
        degrees = {
            "data_parallel_replicate_degree": self.dp_replicate,
            "tensor_parallel_degree": self.tp,
            "pipeline_parallel_degree": self.pp,
            "expert_parallel_degree": self.ep,
            "expert_tensor_parallel_degree": self.etp,
        }
        for name, degree in degrees.items():
            if degree < 1:
                raise ParallelDimsError(f"parallelism.{name} is {degree}; set it to an integer >= 1.")
        if self.world_size < 1:
            raise ParallelDimsError(f"world size is {self.world_size}; launch at least one process.")
        if self.dp_shard == -1:
            others = self.dp_replicate * self.tp * self.pp
            if self.world_size % others != 0:
                raise ParallelDimsError(
                    f"world size {self.world_size} is not divisible by dp_replicate({self.dp_replicate}) * "
                    f"tp({self.tp}) * pp({self.pp}) = {others}, so data_parallel_shard_degree=-1 has no "
                    "value; change the degrees or the number of processes."
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ParallelDimsError(
                f"parallelism.data_parallel_shard_degree is {self.dp_shard}; set it to -1 (the rest of the "
                "world size) or an integer >= 1."
            )
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp
        if product != self.world_size:
            raise ParallelDimsError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * tp({self.tp}) * "
                f"pp({self.pp}) = {product} but the world size is {self.world_size}; make the product equal "
                "the number of processes (data_parallel_shard_degree=-1 fills in the rest)."
            )
        if self.etp not in (1, self.tp):
            raise ParallelDimsError(
                f"parallelism.expert_tensor_parallel_degree is {self.etp}; it must be 1 or equal "
                f"tensor_parallel_degree ({self.tp})."
            )
        if self.etp == self.tp and self.tp > 1:
            # Experts are TP-sharded over the tp ranks, so EP can only borrow data-parallel ranks.
            if self.dp_shard % self.ep != 0:
                raise ParallelDimsError(
                    f"expert_parallel_degree ({self.ep}) must divide data_parallel_shard_degree "
                    f"({self.dp_shard}) when expert_tensor_parallel_degree == tensor_parallel_degree; "
                    "lower ep, raise dp_shard, or set expert_tensor_parallel_degree=1 to let EP borrow TP ranks."
                )
        elif (self.dp_shard * self.tp) % self.ep != 0:
            raise ParallelDimsError(
                f"expert_parallel_degree ({self.ep}) must divide data_parallel_shard_degree * "
                f"tensor_parallel_degree ({self.dp_shard} * {self.tp} = {self.dp_shard * self.tp}): EP borrows "
                "its ranks from FSDP and TP; change expert_parallel_degree."
            )

    def validate_for_model(self, model_args: Any, seq_len: int | None = None) -> None:
        """Checks that need the model: expert count, head count, layer count, and sequence length."""
        num_experts = model_args.moe_args.num_experts
        if self.ep > 1 and num_experts % self.ep != 0:
            raise ParallelDimsError(
                f"moe num_experts ({num_experts}) is not divisible by expert_parallel_degree ({self.ep}); "
                "choose an expert_parallel_degree that divides it."
            )
        if self.etp > 1 and model_args.moe_inter_dim % self.etp != 0:
            raise ParallelDimsError(
                f"moe_inter_dim ({model_args.moe_inter_dim}) is not divisible by "
                f"expert_tensor_parallel_degree ({self.etp}); set expert_tensor_parallel_degree=1."
            )
        if self.tp > 1 and model_args.n_heads % self.tp != 0:
            raise ParallelDimsError(
                f"n_heads ({model_args.n_heads}) is not divisible by tensor_parallel_degree ({self.tp}); "
                "choose a tensor_parallel_degree that divides it."
            )
        if self.pp > 1 and model_args.n_layers < self.pp:
            raise ParallelDimsError(
                f"n_layers ({model_args.n_layers}) is smaller than pipeline_parallel_degree ({self.pp}); "
                "every stage needs at least one layer, lower pipeline_parallel_degree."
            )
        if seq_len is not None and seq_len % self.seq_len_divisor != 0:
            raise ParallelDimsError(
                f"training.seq_len ({seq_len}) must be divisible by tensor_parallel_degree ({self.tp}) "
                "for sequence parallelism; change seq_len or tensor_parallel_degree."
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh and every named submesh. Collective: call on all ranks."""
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        dense = world._unflatten(
            0, (self.pp, self.dp_replicate, self.dp_shard, self.tp), ("pp", "dp_replicate", "dp_shard", "tp")
        )
        batch = world._unflatten(0, (self.pp, self.dp_replicate * self.dp_shard, self.tp), ("pp", "dp", "tp"))
        meshes = {
            "pp": dense["pp"],
            "dp_replicate": dense["dp_replicate"],
            "dp_shard": dense["dp_shard"],
            "tp": dense["tp"],
            "dp": batch["dp"],
            ("dp_replicate", "dp_shard"): dense["dp_replicate", "dp_shard"],
            ("dp_shard", "tp"): dense["dp_shard", "tp"],
        }
        if self.etp > 1:
            sparse = world._unflatten(
                0,
                (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.etp),
                ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "etp"),
            )
            meshes["etp"] = sparse["etp"]
            meshes[("ep", "etp")] = sparse["ep", "etp"]
        else:
            sparse = world._unflatten(
                0,
                (self.pp, self.dp_replicate, self.dp_shard * self.tp // self.ep, self.ep),
                ("pp", "dp_replicate", "dp_shard_mod_ep", "ep"),
            )
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
            "tp": self.tp,
            "ep": self.ep,
            "dp_shard_mod_ep": self.dp_shard_mod_ep,
        }
        for name, size in expected.items():
            assert self._meshes[(name,)].size() == size, (name, self._meshes[(name,)].size(), size)
        return world

    def get_mesh(self, names: str | list[str] | tuple[str, ...]) -> DeviceMesh:
        """A submesh by name ("dp", "dp_shard", "tp", "pp", "ep", "etp", "dp_cp", "dp_shard_mod_ep", ...)
        or by a list of names ("dp_replicate", "dp_shard") for multi-dimensional meshes."""
        if self._world_mesh is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must run before get_mesh().")
        key = tuple(_ALIASES.get(n, n) for n in ([names] if isinstance(names, str) else names))
        if key not in self._meshes:
            valid = sorted(k[0] for k in self._meshes if len(k) == 1) + sorted(_ALIASES)
            raise KeyError(f"no mesh named {names!r}; valid names: {valid} (and their listed combinations)")
        return self._meshes[key]

    def get_optional_mesh(self, names: str | list[str] | tuple[str, ...]) -> DeviceMesh | None:
        """Like `get_mesh`, but None when the mesh is missing or has a single rank."""
        if self._world_mesh is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must run before get_optional_mesh().")
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
        return self.dp_shard * self.tp // self.ep

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

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

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp * self.pp

    @property
    def seq_len_divisor(self) -> int:
        """Sequence parallel splits the sequence over tp ranks."""
        return self.tp
