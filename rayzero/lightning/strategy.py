"""`RayZeroStrategy`: Lightning's `DeepSpeedStrategy`, keyword for keyword, on rayzero's engine.

[Note: Lightning strategy]
Built on Lightning's public Strategy API the way DeepSpeedStrategy is (a DDPStrategy subclass: the
process group, ranks, samplers, barriers and launchers are DDP's), with `rayzero.initialize` where
DeepSpeedStrategy calls `deepspeed.initialize`:
  - keywords -> DeepSpeed config (config.py) through `rayzero.config.lightning.lightning_to_dict` (the
    mapping `RayZeroConfig.from_lightning` uses), completed at `setup` from the Trainer: precision,
    `accumulate_grad_batches`, `gradient_clip_val`, the batch size. `config=` (a dict or JSON path), else
    $PL_DEEPSPEED_CONFIG_PATH, else the run's config ($RAYZERO_CONFIG from `rayzero run --config`)
    replaces the keywords, as in DeepSpeedStrategy;
  - the process group is formed by the engine's `init_distributed`, from the cluster environment's
    variables as DeepSpeedStrategy sets them (torchrun's are read as they are);
  - the engine is `trainer.model`; RayZeroPrecision runs backward and the step through it, so
    gradient accumulation and clipping are the engine's (`handles_gradient_accumulation`);
  - `configure_optimizers`' optimizer and scheduler, or the config's `optimizer`/`scheduler`; Lightning
    steps the scheduler (the engine's is detached), as with DeepSpeed;
  - checkpoints: see [Note: Lightning checkpoints] (checkpoints.py); restarts: [Note: Lightning
    restarts] (resume.py); planned stops and reports: callback.py.
Unlike DeepSpeedStrategy it runs on CPU (gloo) as on CUDA (nccl). It never imports ray, so the same
script runs under torchrun, `rayzero run` and `rayzero.fit`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig

from rayzero.config.environment import COLLECTIVE_TIMEOUT_S
from rayzero.config.lightning import LIGHTNING_DEFAULTS, lightning_to_dict
from rayzero.engine.api import initialize
from rayzero.engine.distributed import compute_device, init_distributed
from rayzero.engine.stage3.zero_init import Init
from rayzero.integrations.random_streams import streams_kept
from rayzero.lightning.callback import RayZeroCallback
from rayzero.lightning.checkpoints import (
    TAG,
    decode_state,
    encode_state,
    is_rayzero_checkpoint,
    load_full_state_dict,
    newest_lightning_checkpoint,
)
from rayzero.lightning.compiled import compile_lightning_module
from rayzero.lightning.config import engine_config
from rayzero.lightning.precision import LightningSetupError, RayZeroPrecision, as_rayzero_precision
from rayzero.lightning.resume import search_directories
from rayzero.workers import get_context

logger = logging.getLogger(__name__)

_HONOURED_HERE = ("accelerator", "parallel_devices", "cluster_environment", "precision_plugin",
                  "process_group_backend", "timeout", "logging_level", "load_full_weights",
                  "exclude_frozen_parameters")
"""DeepSpeedStrategy keywords with no config key: the strategy itself honours them."""


class RayZeroStrategy(DDPStrategy):
    """`Trainer(strategy=RayZeroStrategy(stage=3, offload_optimizer=True, ...))`: DeepSpeedStrategy's
    keywords and defaults ([Note: Lightning strategy]); `timeout` left at its default takes
    $RAYZERO_COLLECTIVE_TIMEOUT_S when set."""

    strategy_name = "rayzero"

    def __init__(
        self,
        accelerator: Any = None,
        zero_optimization: bool = True,
        stage: int = 2,
        remote_device: str | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_params_device: str = "cpu",
        nvme_path: str = "/local_nvme",
        params_buffer_count: int = 5,
        params_buffer_size: int = 100_000_000,
        max_in_cpu: int = 1_000_000_000,
        offload_optimizer_device: str = "cpu",
        optimizer_buffer_count: int = 4,
        block_size: int = 1048576,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = True,
        thread_count: int = 1,
        pin_memory: bool = False,
        sub_group_size: int = 1_000_000_000_000,
        contiguous_gradients: bool = True,
        overlap_comm: bool = True,
        allgather_partitions: bool = True,
        reduce_scatter: bool = True,
        allgather_bucket_size: int = 200_000_000,
        reduce_bucket_size: int = 200_000_000,
        zero_allow_untested_optimizer: bool = True,
        logging_batch_size_per_gpu: str | int = "auto",
        config: str | Path | dict[str, Any] | None = None,
        logging_level: int = logging.WARNING,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        loss_scale: float = 0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: int = 1,
        partition_activations: bool = False,
        cpu_checkpointing: bool = False,
        contiguous_memory_optimization: bool = False,
        synchronize_checkpoint_boundary: bool = False,
        load_full_weights: bool = False,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        exclude_frozen_parameters: bool = False,
    ) -> None:
        keywords = {key: value for key, value in locals().items() if key in LIGHTNING_DEFAULTS}
        if cluster_environment is None and all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
            # torchrun, `rayzero run` and rayzero.fit set these: read them (Lightning's default
            # environment would derive a rank from LOCAL_RANK and the node rank it is told).
            cluster_environment = TorchElasticEnvironment()
        if timeout == default_pg_timeout and COLLECTIVE_TIMEOUT_S.is_set():
            timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S.get())
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout)
        if isinstance(config, (str, Path)) and not os.path.isfile(config):
            raise LightningSetupError(f"RayZeroStrategy(config={str(config)!r}): no such file; pass a path to a "
                                      "DeepSpeed JSON config or a dict")
        self._keywords = {key: value for key, value in keywords.items() if key not in _HONOURED_HERE}
        lightning_to_dict(self._keywords, [])  # bad keywords fail here, as DeepSpeedStrategy's do
        self.load_full_weights = load_full_weights
        self.exclude_frozen_parameters = exclude_frozen_parameters
        logging.getLogger("rayzero.engine").setLevel(logging_level)  # DeepSpeedStrategy sets DeepSpeed's
        self._engine: Any = None  # the ZeroEngine; also `self.model` once set up
        self._config: dict[str, Any] | None = None  # the engine's DeepSpeed config, built at setup
        self._resumed: dict[str, Any] | None = None  # trainer state a restart resumed from (this fit)
        self._restarting = False  # loading the checkpoint a restart resumes from (its random state too)

    # ---- precision ------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> RayZeroPrecision:
        return self._precision_plugin if self._precision_plugin is not None else RayZeroPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        self._precision_plugin = as_rayzero_precision(plugin)

    # ---- what Lightning asks of a strategy ----------------------------------------------------
    @property
    def engine(self) -> Any:
        """The `ZeroEngine` training the LightningModule (None before `setup`)."""
        return self._engine

    @property
    def zero_stage_3(self) -> bool:
        zero = (self._config or self._engine_config(None, warn=False)).get("zero_optimization") or {}
        return zero.get("stage") == 3

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its shards

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restores its optimizer state with its shards

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_distributed(self) -> None:
        """As DeepSpeedStrategy: the node's variables from the cluster environment, then the engine's
        own `init_distributed` (a no-op where rayzero.fit formed the group), whose exit hook commits an
        async save in flight and leaves the group (gloo aborts a process that exits inside one)."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        os.environ.update(MASTER_ADDR=self.cluster_environment.main_address,
                          MASTER_PORT=str(self.cluster_environment.main_port), RANK=str(self.global_rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank))
        init_distributed(self._process_group_backend,
                         timeout_s=self._timeout.total_seconds() if self._timeout is not None else None)

    def setup_optimizers(self, trainer: Any) -> None:
        self.optimizers, self.lr_scheduler_configs = [], []  # built with the engine in setup

    def model_to_device(self) -> None:
        if self._engine is None and self.lightning_module is not None:
            self.lightning_module.to(self.root_device)  # else the engine placed it

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        pass  # the engine reduces gradients itself (DDP's hooks do not apply)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        pass

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self._check_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._resumed = None
        reusable = self._engine is not None and not self._engine.closed and self._engine.module is self.lightning_module
        if fitting or not reusable:
            self._close_engine()
            self._config = self._engine_config(trainer)
            self.model = self.precision_plugin.convert_module(self.lightning_module)
            if fitting:
                self._start_engine(trainer)
            else:
                self._start_inference_engine()
            compile_lightning_module(self._engine, self.lightning_module)  # [Note: a compiled LightningModule]
        self.model = self._engine
        if fitting:
            if not any(isinstance(callback, RayZeroCallback) for callback in trainer.callbacks):
                trainer.callbacks.append(RayZeroCallback())
            self._resume_after_restart(trainer)
        self.barrier()

    def _check_device(self) -> None:
        engine_device = compute_device()
        if engine_device != self.root_device and not (engine_device.type == "cpu" == self.root_device.type):
            raise LightningSetupError(
                f"Lightning placed rank {self.global_rank} on {self.root_device}, but rayzero's engine runs on "
                f"{engine_device} (cuda:LOCAL_RANK whenever CUDA is available): use accelerator='gpu' with "
                "devices=LOCAL_WORLD_SIZE (GPUs 0..N-1 of CUDA_VISIBLE_DEVICES), or hide the GPUs "
                "(CUDA_VISIBLE_DEVICES='') to train on the CPU")

    def _start_engine(self, trainer: Any) -> None:
        module = self.lightning_module
        if is_overridden("configure_gradient_clipping", module):
            rank_zero_warn("RayZeroStrategy clips gradients in the engine: `LightningModule.configure_gradient_clipping` "
                           "is called but clips nothing; set Trainer(gradient_clip_val=...) instead")
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise LightningSetupError("RayZeroStrategy (like DeepSpeed) clips gradients by their global norm only: "
                                      "drop gradient_clip_algorithm='value' or use 'norm'")
        optimizer, scheduler_config = None, None
        if "optimizer" in self._config:
            rank_zero_info("The DeepSpeed config has an `optimizer` section: it is used and "
                           "LightningModule.configure_optimizers is not called")
        else:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) > 1 or len(schedulers) > 1:
                raise LightningSetupError("RayZeroStrategy (like DeepSpeedStrategy) trains with one optimizer and "
                                          "at most one LR scheduler: return one of each from configure_optimizers")
            optimizer, scheduler_config = optimizers[0], (schedulers[0] if schedulers else None)
        engine, engine_optimizer, _, engine_scheduler = initialize(
            model=module, optimizer=optimizer, config=self._config, dist_init_required=False,
            lr_scheduler=scheduler_config.scheduler if scheduler_config is not None else None)
        self._engine = engine
        self.optimizers = [engine_optimizer]
        if engine_scheduler is not None:
            engine.lr_scheduler = None  # Lightning steps it (as it does DeepSpeed's)
            if scheduler_config is None:
                scheduler_config = LRSchedulerConfig(engine_scheduler, interval="step")
            scheduler_config.scheduler = engine_scheduler
            self.lr_scheduler_configs = [scheduler_config]

    def _start_inference_engine(self) -> None:
        """validate/test/predict without a fit before: the engine holds the (stage 3: partitioned)
        weights and loads checkpoints; its optimizer (SGD, lr 0) never steps."""
        config = {key: value for key, value in self._config.items() if key not in ("optimizer", "scheduler")}
        trainable = [param for param in self.lightning_module.parameters() if param.requires_grad]
        self._engine, _, _, _ = initialize(model=self.lightning_module, config=config, dist_init_required=False,
                                           optimizer=torch.optim.SGD(trainable, lr=0.0))

    def _close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()  # commits a save in flight, hands the module back
            self._engine = None
            self.model = self.lightning_module

    def _engine_config(self, trainer: Any, warn: bool = True) -> dict[str, Any]:
        """The engine's DeepSpeed config; `trainer` None: before there is one (no Trainer facts)."""
        precision = self.precision_plugin.precision if trainer is not None else None
        return engine_config(self._keywords, trainer, precision, warn)

    # ---- model construction -------------------------------------------------------------------
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if self.zero_stage_3:
            if empty_init is False:
                raise NotImplementedError(f"`{empty_init=}` is not a valid choice with RayZeroStrategy at ZeRO stage 3")
            yield  # the engine places the parameters
            return
        with super().tensor_init_context(empty_init=empty_init):
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """`configure_model` builds under `rayzero.zero.Init` at stage 3: parameters partitioned as they
        are created."""
        trainer = getattr(self.lightning_module, "_trainer", None)  # `.trainer` raises when not attached
        if trainer is None or trainer.state.fn is None:
            trainer = None
        precision = self.precision_plugin.precision if trainer is not None else None
        config = engine_config(self._keywords, trainer, precision, warn=False, read_batch_size=False)
        with Init(config=config, enabled=(config.get("zero_optimization") or {}).get("stage") == 3):
            yield

    # ---- checkpoints ([Note: Lightning checkpoints]) -----------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine saves the weights, sharded

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        return {}  # the engine saves the optimizer state, sharded

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A sharded rayzero checkpoint in the directory `filepath` (tag `checkpoint`); collective."""
        filepath = self.broadcast(os.fspath(filepath))
        if storage_options is not None:
            raise TypeError("Trainer.save_checkpoint(..., storage_options=...) is not supported by RayZeroStrategy: "
                            "the engine writes the checkpoint (its storage is the config's `checkpoint` section)")
        engine = self._require_engine("trainer.save_checkpoint")
        engine.save_checkpoint(filepath, tag=TAG, client_state=encode_state(checkpoint),
                               exclude_frozen_parameters=self.exclude_frozen_parameters)
        if self.lightning_module.trainer.state.status != TrainerStatus.RUNNING:
            engine.wait_for_checkpoint()  # outside fit nothing waits for it later

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self._resumed is not None:  # a restart resumes from the run's newest checkpoint instead
            rank_zero_info(f"RayZeroStrategy: restart of a rayzero run: ckpt_path={checkpoint_path!s} is superseded "
                           "by the run's newest checkpoint")
            return self._resumed
        path = self.broadcast(os.fspath(checkpoint_path))
        if self.load_full_weights and not is_rayzero_checkpoint(path):
            return super().load_checkpoint(path, weights_only)  # a single-file Lightning checkpoint
        if not is_rayzero_checkpoint(path):
            raise LightningSetupError(
                f"{path} is not a rayzero checkpoint (a directory written by trainer.save_checkpoint under "
                "RayZeroStrategy); for a single-file checkpoint set RayZeroStrategy(load_full_weights=True)")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        # the engine's checkpoint holds each rank's random state, restored on a restart of a rayzero run
        # (the run goes on as if never stopped); `fit(ckpt_path=...)` leaves the streams where they are,
        # as Lightning does under DDP ([Note: the user's random streams])
        with nullcontext() if self._restarting else streams_kept():
            _, client_state = self._require_engine("loading a checkpoint").load_checkpoint(
                path, load_optimizer_states=fitting, load_lr_scheduler_states=False,
                load_module_strict=self.lightning_module.strict_loading)
        if not client_state or "loops" not in client_state:
            raise LightningSetupError(
                f"{path} holds no trainer state: it was written by engine.save_checkpoint (e.g. a planned stop of a "
                "plain loop), not by trainer.save_checkpoint; resume a Lightning run from one of its own checkpoints")
        return decode_state(client_state)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" not in checkpoint:
            return  # a rayzero checkpoint: the engine loaded its shards in load_checkpoint
        # a single-file checkpoint (load_full_weights): its weights, and when fitting its optimizer's
        # hyperparameters (the learning rate its scheduler reached); per-parameter state starts fresh
        load_full_state_dict(self._engine, checkpoint["state_dict"], strict)
        saved = (checkpoint.get("optimizer_states") or [{}])[0].get("param_groups", [])
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING and saved:
            for group, saved_group in zip(self._engine.optimizer.param_groups, saved):
                group.update({key: value for key, value in saved_group.items() if key != "params"})
            rank_zero_warn("A single-file checkpoint was loaded (load_full_weights): its weights and optimizer "
                           "hyperparameters; the optimizer's per-parameter state (momentum, Adam moments) starts "
                           "fresh. Pass a RayZeroStrategy checkpoint directory to resume all of it")

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # the engine's (lightning_restore_optimizer is False)

    def _resume_after_restart(self, trainer: Any) -> None:
        """[Note: Lightning restarts] (resume.py)."""
        context = get_context()
        if not context.resuming:  # a fresh run, or plain torchrun
            return
        path = None
        if self.is_global_zero:
            path = newest_lightning_checkpoint(search_directories(trainer, context.resume_from))
        path = self.broadcast(path)
        if path is None:
            rank_zero_info(f"RayZeroStrategy: attempt {context.attempt} found no checkpoint to resume from; "
                           "training starts over")
            return
        rank_zero_info(f"RayZeroStrategy: attempt {context.attempt} resumes from {path}")
        self._restarting = True
        try:
            trainer._checkpoint_connector.resume_start(path)  # loads it through load_checkpoint above
        finally:
            self._restarting = False
        self._resumed = trainer._checkpoint_connector._loaded_checkpoint

    def _require_engine(self, what: str) -> Any:
        if self._engine is None:
            raise LightningSetupError(f"{what} needs RayZeroStrategy's engine, which exists once trainer.fit / "
                                      "validate / test / predict has set it up")
        return self._engine

    def teardown(self) -> None:
        """Commits a save in flight. The engine stays, with the module and optimizer where it placed
        them, so `trainer.save_checkpoint` after `fit` (and validate/test) still work; the next fit
        starts a new one."""
        if self._engine is not None:
            self._engine.wait_for_checkpoint()
        self._resumed = None
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

