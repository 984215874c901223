"""From a `conf/launcher/*.yaml` entry to running processes and an `accelerate.Accelerator`.

How a distill job becomes N processes: the CLI calls `relaunch_command(launcher, argv)`; when it
returns a command (more than one process wanted and we are not already a launched child) the CLI
runs it, and each child builds its Accelerator with `make_accelerator`. We launch with `torchrun`
and build every accelerate plugin in code, so the same launcher entry works on CPU, one GPU and
multi-node without an accelerate config file. `accelerate_config` renders the equivalent file for
people who prefer `accelerate launch` (scripts/accelerate_configs/ holds those renders).

Traps this module exists for (all checked on this CPU-only machine, accelerate 1.15, torch 2.13):
* `accelerate launch --cpu --num_processes 2` silently runs ONE process (world_size 1);
  `accelerate launch --multi_gpu --cpu` is refused. `torchrun --nproc_per_node 2` (or `accelerate
  launch --multi_gpu` without `--cpu`) gives 2 ranks with gloo.
* DeepSpeed on CPU must find a gloo process group already initialised (we init it before accelerate).
* gloo can abort at interpreter exit with a live process group, or with a collective still running on
  any group (DeepSpeed's ZeRO keeps async all-gathers on its own clone of the world group; a gloo worker that
  finishes one during interpreter teardown frees tensors under a GIL it can no longer take: "terminate called
  without an active exception"). `shutdown_distributed()` settles every group, then destroys them.
* accelerate turns FSDP on only for an accelerator device: on CPU it silently runs DDP instead. torch's
  FSDP2 (`fully_shard`) itself runs on CPU with gloo, so `_enable_cpu_fsdp` selects it by hand.
* FSDP1 under accelerate needs the optimizer built after the model is wrapped (the trainer builds it
  before); FSDP2's prepare re-points the optimizer at the sharded parameters, so we use FSDP2.
* ZeRO-3 holds each parameter on one rank only: export gathers them (`get_state_dict`) only when the
  config sets `stage3_gather_16bit_weights_on_model_save`, which `_deepspeed_plugin` does.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from draftsmith.kernels.precision import AUTO, resolve_bf16
from draftsmith.serve_eval.engine.threads import available_cores

STRATEGIES = ("none", "ddp", "fsdp", "deepspeed")
MIXED_PRECISION = ("no", "bf16", "fp16", "auto")   # auto: bf16 where it is fast (kernels.precision)
# FSDP2 keeps one knob of FSDP1's sharding strategies: reshard parameters after forward or keep them.
FSDP_RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


@dataclass
class LauncherConfig:
    """Schema of `conf/launcher/*.yaml`: how many processes, and how they share the model."""

    name: str = "local"
    strategy: str = "none"  # none | ddp | fsdp | deepspeed
    num_processes: int = 1  # per machine
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str = "127.0.0.1"
    main_process_port: int = 29500
    cpu: bool | None = None  # None: CPU exactly when CUDA is unavailable
    find_unused_parameters: bool = False  # DDP: set when an objective leaves parameters without grads
    # DeepSpeed
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    # FSDP
    fsdp_sharding_strategy: str = "FULL_SHARD"  # FULL_SHARD | SHARD_GRAD_OP (FSDP2 reshard_after_forward)
    fsdp_auto_wrap_policy: str = "SIZE_BASED_WRAP"  # SIZE_BASED_WRAP | TRANSFORMER_BASED_WRAP | NO_WRAP
    fsdp_min_num_params: int = 1_000_000
    # The frozen target of an online objective (EAGLE-1/3, Medusa, online KD) split across the ranks with FSDP2,
    # whatever shares the draft: for a target that does not fit one device (Teacher.shard).
    shard_target: bool = False

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_machines

    @property
    def sharded(self) -> bool:
        """Model/optimizer state is split across ranks (checkpoints go through accelerator.save_state)."""
        return self.strategy in ("fsdp", "deepspeed")

    def validate(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"launcher.strategy: {self.strategy!r} is not one of {STRATEGIES}")
        for field in ("num_processes", "num_machines"):
            if getattr(self, field) < 1:
                raise ValueError(f"launcher.{field} must be >= 1, got {getattr(self, field)}")
        if not 0 <= self.machine_rank < self.num_machines:
            raise ValueError(f"launcher.machine_rank {self.machine_rank} outside [0, {self.num_machines})")
        if self.strategy == "deepspeed" and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"launcher.zero_stage must be 0..3, got {self.zero_stage}")
        if self.strategy == "fsdp" and self.fsdp_sharding_strategy not in FSDP_RESHARD_AFTER_FORWARD:
            raise ValueError(f"launcher.fsdp_sharding_strategy must be one of {sorted(FSDP_RESHARD_AFTER_FORWARD)} "
                             f"(FSDP2), got {self.fsdp_sharding_strategy!r}; NO_SHARD is launcher=ddp")
        if self.shard_target and self.world_size == 1:
            raise ValueError("launcher.shard_target: sharding the target needs more than one process "
                             "(launcher=fsdp_target, or num_processes >= 2)")
        if self.strategy == "none" and self.world_size > 1:
            raise ValueError(
                f"launcher.strategy 'none' runs one process but num_processes x num_machines = {self.world_size}; "
                "use strategy ddp, fsdp or deepspeed"
            )

    def use_cpu(self) -> bool:
        return (not torch.cuda.is_available()) if self.cpu is None else self.cpu


def is_launched_child() -> bool:
    """True inside a process started by torchrun / accelerate launch / srun+torchrun."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def relaunch_command(launcher: LauncherConfig, job_argv: list[str], module: str = "draftsmith.train.cli") -> list[str] | None:
    """The torchrun command that runs `python -m <module> <job_argv>` as the launcher asks, or None
    when this process should just run the job itself (one process, or already a launched child)."""
    launcher.validate()
    if launcher.world_size == 1 or is_launched_child():
        return None
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(launcher.num_processes),
        "--nnodes", str(launcher.num_machines),
        "--node_rank", str(launcher.machine_rank),
        "--master_addr", launcher.main_process_ip,
        "--master_port", str(launcher.main_process_port),
        "--module", module, *job_argv,
    ]  # fmt: skip


def _init_cpu_process_group() -> None:
    """gloo group from torchrun's env, before accelerate: accelerate/DeepSpeed would otherwise pick a
    backend that does not exist on a CPU build (nccl/ccl)."""
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend="gloo")


def _deepspeed_plugin(launcher: LauncherConfig, micro_batch_size: int, grad_accum: int, grad_clip: float | None) -> Any:
    from accelerate.utils import DeepSpeedPlugin

    try:
        import deepspeed  # noqa: F401  (cluster extra; imported here so the error names it)
    except ImportError as err:
        raise ValueError(
            "launcher.strategy 'deepspeed' needs the deepspeed package: pip install 'draftsmith[cluster]'"
        ) from err
    offload = "cpu" if launcher.offload_optimizer else "none"
    plugin = DeepSpeedPlugin(
        zero_stage=launcher.zero_stage,
        gradient_accumulation_steps=grad_accum,
        gradient_clipping=grad_clip if grad_clip else 0.0,
        offload_optimizer_device=offload,
        offload_param_device="cpu" if launcher.offload_params else "none",
        # ZeRO-3: gather the sharded parameters into one state dict on save, so the draft can be exported.
        zero3_save_16bit_model=launcher.zero_stage == 3,
    )
    # We keep our own data loaders (resumable sampler), so accelerate cannot infer the batch size.
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size
    # Our optimizer is a plain torch one; DeepSpeed only trusts its own unless told otherwise.
    plugin.deepspeed_config["zero_allow_untested_optimizer"] = True
    return plugin


def _fsdp_plugin(launcher: LauncherConfig) -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=FSDP_RESHARD_AFTER_FORWARD[launcher.fsdp_sharding_strategy],
        auto_wrap_policy=launcher.fsdp_auto_wrap_policy,
        min_num_params=launcher.fsdp_min_num_params,
        state_dict_type="SHARDED_STATE_DICT",
    )


def _enable_cpu_fsdp(plugin: Any, mixed_precision: str) -> None:
    """Select FSDP on a CPU (gloo) world, which accelerate only does for accelerator devices. Both of
    accelerate's shared states hold the type (AcceleratorState re-reads PartialState's on each
    construction); the device must be plain "cpu", since FSDP compares it with the parameters' device."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        shared["distributed_type"] = DistributedType.FSDP
        shared["device"] = torch.device("cpu")
    AcceleratorState._shared_state["fsdp_plugin"] = plugin


def training_threads(setting: int | str) -> int:
    """torch intra-op threads for one training process: a count as given; auto = the cores this process's share
    of the machine holds (the cores it may run on / the processes launched on this node)."""
    if setting != AUTO:
        return int(setting)
    return max(1, available_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def resolve_mixed_precision(mixed_precision: str, cpu: bool) -> str:
    """accelerate's setting for train.mixed_precision: auto is bf16 where this device runs it fast, else no."""
    if mixed_precision != AUTO:
        return mixed_precision
    return "bf16" if resolve_bf16(AUTO, "cpu" if cpu else "cuda", "train.mixed_precision") else "no"


def make_accelerator(
    launcher: LauncherConfig,
    *,
    mixed_precision: str = "no",
    gradient_accumulation_steps: int = 1,
    micro_batch_size: int = 1,
    grad_clip: float | None = None,
) -> Any:
    """The Accelerator for this process, configured from the launcher entry."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    launcher.validate()
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"train.mixed_precision: {mixed_precision!r} is not one of {MIXED_PRECISION}")
    cpu = launcher.use_cpu()
    mixed_precision = resolve_mixed_precision(mixed_precision, cpu)
    if cpu:
        _init_cpu_process_group()
    kwargs: dict[str, Any] = {}
    if launcher.strategy == "deepspeed":
        kwargs["deepspeed_plugin"] = _deepspeed_plugin(launcher, micro_batch_size, gradient_accumulation_steps, grad_clip)
        if cpu:  # accelerate only finds a backend for DeepSpeed on an accelerator: name gloo explicitly
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    elif launcher.strategy == "fsdp" and not cpu:
        kwargs["fsdp_plugin"] = _fsdp_plugin(launcher)
    elif launcher.find_unused_parameters:
        kwargs["kwargs_handlers"] = [DistributedDataParallelKwargs(find_unused_parameters=True)]
    # accelerate ignores a DeepSpeed plugin when cpu=True (it silently falls back to MULTI_CPU DDP);
    # without CUDA, cpu=False still lands on the CPU device, with the gloo group made above.
    accelerator = Accelerator(
        cpu=cpu and launcher.strategy != "deepspeed", mixed_precision=mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps, **kwargs
    )
    if launcher.strategy == "fsdp" and cpu:
        _enable_cpu_fsdp(_fsdp_plugin(launcher), mixed_precision)
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != expected:  # the silent single-process trap, caught loudly
        raise RuntimeError(
            f"launcher {launcher.name!r}: WORLD_SIZE is {expected} but accelerate runs {accelerator.num_processes} "
            "process(es); launch with torchrun (see draftsmith/train/distill/launch.py)"
        )
    return accelerator


def shutdown_distributed(barrier: bool = True) -> None:
    """Tear the process group down before interpreter exit (gloo may abort in its destructor otherwise).
    `barrier=False` after an error that may have hit one rank only (the others would never arrive)."""
    if dist.is_available() and dist.is_initialized():
        try:
            if barrier:
                _settle_groups()
        finally:
            dist.destroy_process_group()


def _settle_groups() -> None:
    """A barrier on every process group this rank is in, in creation order (the same on every rank, as groups
    are created collectively). gloo's barrier first waits for the group's queued and running collectives, so
    none is left for a worker thread to finish during interpreter teardown. The registry is c10d's own (the
    one destroy_process_group walks); torch has no public list of groups."""
    from torch.distributed.distributed_c10d import _world

    for group in list(_world.pg_map):
        dist.barrier(group=group)


def write_rank_report(path: Path, accelerator: Any, module: torch.nn.Module, launcher: LauncherConfig,
                      example_ids: list[int], target_share: float | None = None) -> None:
    """One JSON per rank of what this process did: world size, the training examples it drew (since it
    started; a resumed run: since the resume) and a sha256 per trainable parameter, so a distributed run
    can be checked afterwards (shards disjoint, replicas equal). Digests are left out (None) where the
    launcher shards parameters (FSDP, ZeRO-3): a rank then holds only its piece. `target_share`: the fraction
    of the frozen target's weights this rank holds (None: no target in the loop)."""
    replicated = launcher.strategy in ("none", "ddp") or (launcher.strategy == "deepspeed" and launcher.zero_stage < 3)
    digests = None
    if replicated:
        digests = {
            name: hashlib.sha256(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, p in accelerator.unwrap_model(module).named_parameters() if p.requires_grad
        }
    report = {"rank": accelerator.process_index, "world_size": accelerator.num_processes,
              "distributed_type": str(accelerator.distributed_type), "strategy": launcher.strategy,
              "example_ids": example_ids, "param_sha256": digests, "target_share": target_share}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))


def accelerate_config(launcher: LauncherConfig, mixed_precision: str = "bf16") -> dict[str, Any]:
    """The `accelerate launch --config_file` equivalent of a launcher entry (templates in scripts/)."""
    distributed_type = {
        "none": "NO",
        "ddp": "MULTI_GPU",
        "fsdp": "FSDP",
        "deepspeed": "DEEPSPEED",
    }[launcher.strategy]
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
        "num_processes": launcher.world_size,
        "num_machines": launcher.num_machines,
        "machine_rank": launcher.machine_rank,
        "main_process_ip": launcher.main_process_ip,
        "main_process_port": launcher.main_process_port,
        "mixed_precision": mixed_precision,
        "use_cpu": bool(launcher.cpu),
    }
    if launcher.strategy == "deepspeed":
        config["deepspeed_config"] = {
            "zero_stage": launcher.zero_stage,
            "offload_optimizer_device": "cpu" if launcher.offload_optimizer else "none",
            "offload_param_device": "cpu" if launcher.offload_params else "none",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero3_init_flag": launcher.zero_stage == 3,
            "zero3_save_16bit_model": launcher.zero_stage == 3,
        }
    if launcher.strategy == "fsdp":
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": FSDP_RESHARD_AFTER_FORWARD[launcher.fsdp_sharding_strategy],
            "fsdp_auto_wrap_policy": launcher.fsdp_auto_wrap_policy,
            "fsdp_min_num_params": launcher.fsdp_min_num_params,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    return config
