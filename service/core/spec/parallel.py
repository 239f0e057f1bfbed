"""How a job spans GPUs: the strategy (torch DDP, FSDP1, FSDP2, DeepSpeed ZeRO) and each
strategy's settings by the names its library uses."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from service.core.errors import InvalidSpecError
from service.core.fields import job_field
from service.core.limits import MAX_BUCKET_CAP_MB, MAX_GPUS, MAX_ZERO_ELEMENTS


class Strategy(StrEnum):
    """How the job spans GPUs: torch DDP, FSDP1 (FullyShardedDataParallel), FSDP2
    (`fully_shard`), or DeepSpeed ZeRO stage 1, 2 or 3."""

    DDP = "ddp"
    FSDP = "fsdp"
    FSDP2 = "fsdp2"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"


SHARDING_STRATEGIES = (Strategy.FSDP, Strategy.FSDP2, Strategy.ZERO3)
ZERO_STAGES = {Strategy.ZERO1: 1, Strategy.ZERO2: 2, Strategy.ZERO3: 3}


class Offload(StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"
    OPTIMIZER_AND_PARAMS = "optimizer_and_params"


class FsdpSharding(StrEnum):
    """FSDP1's sharding strategies, by torch.distributed.fsdp.ShardingStrategy's names (as
    accelerate's `fsdp_sharding_strategy` takes them)."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    HYBRID_SHARD = "HYBRID_SHARD"
    NO_SHARD = "NO_SHARD"


class FsdpBackwardPrefetch(StrEnum):
    """FSDP1's backward prefetch (torch.distributed.fsdp.BackwardPrefetch); NO_PREFETCH is
    accelerate's name for None."""

    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"
    NO_PREFETCH = "NO_PREFETCH"


# torch/nn/parallel/distributed.py DistributedDataParallel.__init__: bucket_cap_mb=None means
# 25 MiB (`_DEFAULT_BUCKET_CAP_MB`).
DDP_BUCKET_CAP_MB = 25
# GPUs per node when the request does not say: the common 8-GPU server.
DEFAULT_GPUS_PER_NODE = 8
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py DeepSpeedZeroConfig): allgather and
# reduce buckets of 5e8 elements, stage 3's prefetch bucket 5e7 elements, at most 1e9 live
# gathered parameters, parameters under 1e5 elements kept whole on every rank.
ZERO_ALLGATHER_BUCKET_SIZE = 500_000_000
ZERO_REDUCE_BUCKET_SIZE = 500_000_000
ZERO3_PREFETCH_BUCKET_SIZE = 50_000_000
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000
ZERO3_PARAM_PERSISTENCE_THRESHOLD = 100_000


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelSpec:
    """How the job spans GPUs, with each strategy's settings by the names its library uses
    (torch DDP's and FSDP's arguments, accelerate's FSDP plugin, DeepSpeed's `zero_optimization`
    keys) and their defaults. Settings of other strategies than `strategy` are ignored."""

    gpus: int = job_field(1, doc="GPUs (ranks) the job spans.", ge=1, le=MAX_GPUS)
    strategy: Strategy = job_field(
        Strategy.DDP, doc="ddp, fsdp (FSDP1), fsdp2 (fully_shard), or DeepSpeed zero1/zero2/zero3."
    )
    offload: Offload = job_field(Offload.NONE, doc="What is offloaded to the host.")
    # None: min(gpus, DEFAULT_GPUS_PER_NODE)
    gpus_per_node: int | None = job_field(
        None, doc=f"GPUs per node; null: min(gpus, {DEFAULT_GPUS_PER_NODE}).", ge=1, le=MAX_GPUS
    )
    # DDP (torch.nn.parallel.DistributedDataParallel)
    bucket_cap_mb: int = job_field(
        DDP_BUCKET_CAP_MB,
        doc="DDP's bucket cap (MB).",
        mirrors="DistributedDataParallel.bucket_cap_mb",
        ge=1,
        le=MAX_BUCKET_CAP_MB,
    )
    gradient_as_bucket_view: bool = job_field(
        False,
        doc="DDP: gradients are views into the buckets.",
        mirrors="DistributedDataParallel.gradient_as_bucket_view",
    )
    # FSDP1 (torch's FullyShardedDataParallel defaults; HF Trainer passes backward_prefetch
    # NO_PREFETCH unless its fsdp_config sets one: transformers/training_args.py)
    sharding_strategy: FsdpSharding = job_field(
        FsdpSharding.FULL_SHARD,
        doc="FSDP1's sharding strategy.",
        mirrors="FullyShardedDataParallel.sharding_strategy",
    )
    use_orig_params: bool = job_field(
        True, doc="FSDP1's use_orig_params.", mirrors="FullyShardedDataParallel.use_orig_params"
    )
    limit_all_gathers: bool = job_field(
        True, doc="FSDP1's limit_all_gathers.", mirrors="FullyShardedDataParallel.limit_all_gathers"
    )
    forward_prefetch: bool = job_field(
        False, doc="FSDP1's forward_prefetch.", mirrors="FullyShardedDataParallel.forward_prefetch"
    )
    backward_prefetch: FsdpBackwardPrefetch = job_field(
        FsdpBackwardPrefetch.BACKWARD_PRE,
        doc="FSDP1's backward_prefetch.",
        mirrors="FullyShardedDataParallel.backward_prefetch",
    )
    # FSDP2 (torch.distributed.fsdp.fully_shard)
    reshard_after_forward: bool = job_field(
        True, doc="FSDP2's reshard_after_forward.", mirrors="fully_shard(reshard_after_forward=...)"
    )
    # DeepSpeed ZeRO (`zero_optimization`); None: "auto" as HF's DeepSpeed integration fills it
    # from the model (transformers/integrations/deepspeed.py).
    reduce_bucket_size: int | None = job_field(
        None,
        doc="ZeRO's reduce_bucket_size (elements); null: 'auto' (hidden_size²).",
        mirrors="zero_optimization.reduce_bucket_size",
        ge=1,
        le=MAX_ZERO_ELEMENTS,
    )
    allgather_bucket_size: int = job_field(
        ZERO_ALLGATHER_BUCKET_SIZE,
        doc="ZeRO-1/2's allgather_bucket_size (elements).",
        mirrors="zero_optimization.allgather_bucket_size",
        ge=1,
        le=MAX_ZERO_ELEMENTS,
    )
    stage3_prefetch_bucket_size: int | None = job_field(
        None,
        doc="ZeRO-3's prefetch bucket (elements); null: 'auto' (0.9 hidden_size²).",
        mirrors="zero_optimization.stage3_prefetch_bucket_size",
        ge=1,
        le=MAX_ZERO_ELEMENTS,
    )
    stage3_max_live_parameters: int = job_field(
        ZERO3_MAX_LIVE_PARAMETERS,
        doc="ZeRO-3's stage3_max_live_parameters (elements).",
        mirrors="zero_optimization.stage3_max_live_parameters",
        ge=1,
        le=MAX_ZERO_ELEMENTS,
    )
    stage3_param_persistence_threshold: int | None = job_field(
        None,
        doc="ZeRO-3's persistence threshold (elements); null: 'auto' (10 hidden_size).",
        mirrors="zero_optimization.stage3_param_persistence_threshold",
        ge=0,
        le=MAX_ZERO_ELEMENTS,
    )
    contiguous_gradients: bool = job_field(
        True, doc="ZeRO's contiguous_gradients.", mirrors="zero_optimization.contiguous_gradients"
    )
    # None: DeepSpeed's default for the stage
    overlap_comm: bool | None = job_field(
        None,
        doc="ZeRO's overlap_comm; null: DeepSpeed's default for the stage.",
        mirrors="zero_optimization.overlap_comm",
    )

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise InvalidSpecError("parallel.gpus", "must be at least 1")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise InvalidSpecError("parallel.gpus_per_node", "must be at least 1")
        if self.bucket_cap_mb < 1:
            raise InvalidSpecError("parallel.bucket_cap_mb", "must be at least 1")
        for name in (
            "reduce_bucket_size",
            "allgather_bucket_size",
            "stage3_prefetch_bucket_size",
            "stage3_max_live_parameters",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidSpecError(f"parallel.{name}", "must be at least 1")
        threshold = self.stage3_param_persistence_threshold
        if threshold is not None and threshold < 0:
            raise InvalidSpecError(
                "parallel.stage3_param_persistence_threshold", "must be 0 or more"
            )
        if self.offload is not Offload.NONE and self.strategy is Strategy.DDP:
            raise InvalidSpecError(
                "parallel.offload", "DDP cannot offload; offloading needs ZeRO or FSDP"
            )
        if self.offload is Offload.OPTIMIZER_AND_PARAMS and self.strategy not in (
            SHARDING_STRATEGIES
        ):
            raise InvalidSpecError(
                "parallel.offload", "parameter offload needs ZeRO-3, FSDP or FSDP2"
            )
        if self.offload is Offload.OPTIMIZER and self.strategy in (Strategy.FSDP, Strategy.FSDP2):
            raise InvalidSpecError(
                "parallel.offload",
                "FSDP offloads parameters with their gradients and optimizer state "
                "(CPUOffload / CPUOffloadPolicy): use 'optimizer_and_params'",
            )
        if self.sharding_strategy is FsdpSharding.HYBRID_SHARD and self.strategy is Strategy.FSDP:
            per_node = self.node_size
            if self.gpus % per_node:
                raise InvalidSpecError(
                    "parallel.gpus_per_node",
                    f"HYBRID_SHARD shards within a node: {self.gpus} GPUs are not whole nodes "
                    f"of {per_node}",
                )

    @property
    def node_size(self) -> int:
        """GPUs per node the job uses (at most `gpus`)."""
        per_node = self.gpus_per_node or DEFAULT_GPUS_PER_NODE
        return min(self.gpus, per_node)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.node_size)
