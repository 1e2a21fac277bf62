"""CD-GraB example ordering inside the Hugging Face `Trainer`: `CDGraBTrainer` and `CDGraBTrainerMixin`.

    from sorters import CDGraBSettings
    from sorters.hf import CDGraBTrainer
    trainer = CDGraBTrainer(model=model, args=TrainingArguments(..., dataloader_drop_last=True),
                            train_dataset=train_set, cdgrab=CDGraBSettings(sorter="CD-GraB"))
    trainer.train()                                   # or train(resume_from_checkpoint=True)

    class CDGraBSFTTrainer(CDGraBTrainerMixin, SFTTrainer):   # any Trainer subclass (TRL's): mixin first
        pass

What the mixin changes in the Trainer, and why:
- the train sampler is a `CDGraBSampler` (sorters/sampler.py) with view="global": every process yields
  every replica's batch of each step, replica 0's first, so that Accelerate's re-sharding of the loader
  (batch i to process i mod world size) hands each process its own replica's batch. A sampler yielding
  only this rank's indices would lose half of them there, silently (docs/sampler.md#accelerate);
- `training_step` also computes the batch's per-example gradients (`PerExampleLossGrads`: a torch.func
  pass over the dict batch, of the loss the model computes from its `labels`) with the parameters the
  optimizer step starts from, and hands them to `sampler.step()`. One micro-batch is one sampler step,
  so gradient accumulation changes nothing in the orders. Sorters that ignore gradients (D-RR, D-SO,
  Fold, FlipFlop, SWR) get `step(None)` and cost nothing. MB-GraB, in one process hosting one replica, gets
  the micro-batch's gradient from the Trainer's own backward (`BackwardGradient`: what it added to .grad, a
  constant multiple of the micro-batch's mean gradient wherever micro-batches hold as many labelled items);
  under torchrun or with R > 1 replicas in one process, the mean of its examples' formed gradients;
- the sampler's state is saved in every `checkpoint-N/` (as `cdgrab_sampler.pt`, by the main process:
  every process holds the same state) and restored by `train(resume_from_checkpoint=...)` before the
  first batch. The Trainer replays a resumed epoch and drops the batches already done
  (`skip_first_batches`), so the state is loaded with `replay_from_epoch_start=True`; the orders are an
  uninterrupted run's;
- what it cannot honour is refused with one line when `train()` starts, before the first step (see
  `CDGraBTrainerMixin.check_settings`);
- for a sorter that balances gradients, it reads train_dataset[0] and [1] once before training (a dry
  run: through the collator into the model, in eval mode without gradients, to choose exact_low_memory's
  default and refuse what the layer records cannot serve; the formed path also forms item 0's gradient),
  logged at INFO level by the logger "sorters.hf".

Under Accelerate's FSDP2 plugin (`fsdp=True`, fsdp_config={"version": 2}; on GPUs: Accelerate drops the plugin on
the CPU, and the mixin then logs a warning) a balancing sorter takes what the layer records give: exact CD-GraB,
its running sum split like the sharded parameters (sorters.fsdp.ShardedRows, each process its rows), or the
structured sketches. The Trainer shards the model after it built the sampler, so the ExactGradients (LayerSketch)
is rebuilt over the sharded parameters in `_prepare_for_training`; the records never write .grad (FSDP
reduce-scatters it), and a checkpoint keeps each process's rows (sorters.fsdp.sharded_state_dict, in a
torch.distributed.checkpoint folder beside cdgrab_sampler.pt), loaded on resume once the model is sharded.
FSDP1 is refused.

One process can also host several replicas (`num_replicas=R` when not launched by torchrun): each
micro-batch is then every replica's `per_device_train_batch_size` examples side by side, and the orders
equal those of R processes (the sampler's one-process mode).

transformers and accelerate are imported here only, so `import sorters` never needs them (pip extra:
`cdgrab-sorters[hf]`). Checked against transformers 5.23 (the Trainer's private `_get_dataloader`,
`_get_output_dir`, `_save_checkpoint` and `_prepare_for_training` are used, as documented subclassing points
are not enough: the loader's batch size, the checkpoint folder, the moment FSDP has sharded the model).
"""
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import inspect
import logging
import math
import os
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch.utils.data import DataLoader, Dataset

from sorters import CDGraBSampler, PerExampleLossGrads
from sorters._state_format import FORMAT_KEY, TRAINER_STATE_FORMAT, saved_format
from sorters.checks import check_no_dropout, plural
from sorters.exact import ExactCDGraB, ExactGradients, ExactRecording
from sorters.gather import ParameterShare
from sorters.layer_rules import Layout
from sorters.layer_sketch import LayerSketch, Recording, selected_parameters
from sorters.per_example import BackwardGradient
from sorters.registry import SORTERS
from sorters.settings import CDGraBSettings

try:
    from transformers import Trainer
    from transformers.trainer_pt_utils import AcceleratorConfig
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint
except ImportError as error:  # the package depends on torch, numpy and numba only
    raise ImportError("sorters.hf needs transformers and accelerate: pip install 'transformers>=5.17' "
                      "'accelerate>=1.15' (or the package's extra: pip install '.[hf]')") from error

__all__ = ["CDGraBTrainer", "CDGraBTrainerMixin", "SAMPLER_FILE"]

SAMPLER_FILE = "cdgrab_sampler.pt"
# under FSDP: the sampler's rows of the running sum, a torch.distributed.checkpoint folder beside SAMPLER_FILE
_SHARDED_SAMPLER_DIR = "cdgrab_sampler_shards"
_LOGGER = logging.getLogger(__name__)  # "sorters.hf": the dry run's reads of the user's data (INFO)

# the keyword arguments the mixin took before CDGraBSettings, and the settings' field each one sets
_KEYWORDS = {"sorter": "sorter", "sorter_seed": "seed", "grad_params": "grad_params",
             "grad_chunk_size": "grad_chunk_size", "sketch_dim": "sketch_dim", "structured": "structured",
             "sketch_min_numel": "min_numel", "num_replicas": "num_replicas", "exact_low_memory": "exact_low_memory"}

if TYPE_CHECKING:  # the type checker reads the mixin as the Trainer it is mixed into (its attributes, hooks)
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class _MapDataset(Protocol):
    """A map-style dataset, as check_settings requires the train_dataset to be: a length and indexing."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def _ignore_a_datasets_folder() -> None:
    """Our data folder's default name, ./datasets, shadows the Hugging Face `datasets` package where that is
    not installed: run from the checkout, `import datasets` finds the folder as a namespace package, the
    Trainer's is_datasets_available() (a find_spec test) says yes, and its loader fails on
    `datasets.Dataset`. Accelerate checks the package's metadata instead; do the same for the Trainer."""
    import transformers.trainer

    if importlib.util.find_spec("datasets") is None:
        return
    try:
        importlib.metadata.version("datasets")
    except importlib.metadata.PackageNotFoundError:
        transformers.trainer.is_datasets_available = lambda: False


_ignore_a_datasets_folder()


class CDGraBTrainerMixin(_TrainerBase):
    """Mix into a `transformers.Trainer` (sub)class, first in the bases, to train on CD-GraB's orders.

    Args:
        *args: the Trainer's positional arguments.
        cdgrab: a sorters.CDGraBSettings (sorters/settings.py: sorter, seed, grad_params, grad_chunk_size,
            sketch_dim, structured, min_numel, num_replicas, exact_low_memory). Its seed None means `args.seed`.
            num_replicas R > 1 in one process hosts R replicas: each micro-batch holds R x
            per_device_train_batch_size examples, as R processes would together.
            structured=True (with sketch_dim, for a causal LM: outputs.logits, labels shifted by one, -100
            ignored; or a token or sequence classifier: _example_losses) builds the sketches layer by layer
            from the Trainer's own forward and backward (LayerSketch.recording): no second pass; the loss is
            then computed here from the logits, as the model computes it, so that each example's own loss
            can be watched.
            exact_low_memory=True (CD-GraB, the same losses) balances the exact gradients from the same
            records (sorters/exact.py): the orders of exact CD-GraB without forming the per-example gradients
            whole (docs/exact-cdgrab.md). In one process the backward then skips the weights' own gradient
            products, and .grad is written from the same records. Under torchrun each process's records are
            all-gathered (CDGraBSampler.step_units), and the backward is the ordinary one, so that DDP
            averages .grad over the processes as for any Trainer (see training_step).
            exact_low_memory None (the default) takes it wherever it gives the same orders and loss
            (_exact_is_the_default: every selected parameter has a layer rule, the Trainer's own
            compute_loss, a causal LM, token or sequence classifier whose outputs.loss is the records' loss
            on the first two examples), and the formed gradients elsewhere; after train() starts,
            cdgrab_settings.exact_low_memory says which (and every checkpoint's cdgrab_sampler.pt).
        **kwargs: the Trainer's keyword arguments. The settings' fields may also be given here, as before
            CDGraBSettings (`sorter=`, `sorter_seed=` for seed, `sketch_min_numel=` for min_numel, and the
            others by their names): they build the settings (not together with `cdgrab=`).

    Attributes:
        cdgrab_settings: the settings, with the seed and (once train() starts) exact_low_memory decided.
        cdgrab_sampler: after train() starts, the CDGraBSampler; None before.
        cdgrab_grads: after train() starts, the PerExampleLossGrads, or with structured the LayerSketch, or
            with exact_low_memory the ExactGradients; None for sorters that ignore gradients.

    Raises:
        TypeError: both cdgrab and the settings' keyword arguments, or a cdgrab that is not a CDGraBSettings
            (one line).
        ValueError: the settings' keyword arguments refuse a value (one line, from CDGraBSettings).
    """

    def __init__(self, *args: Any, cdgrab: CDGraBSettings | None = None, **kwargs: Any) -> None:
        settings = self.settings_from(cdgrab, {key: kwargs.pop(key) for key in _KEYWORDS if key in kwargs})
        super().__init__(*args, **kwargs)
        if settings.seed is None:
            settings = dataclasses.replace(settings, seed=self.args.seed)
        self.cdgrab_settings: CDGraBSettings = settings
        self.cdgrab_sampler: CDGraBSampler | None = None
        # the formed gradients, the structured sketches or the exact path's records
        self.cdgrab_grads: PerExampleLossGrads | LayerSketch | ExactGradients | BackwardGradient | None = None
        self._cdgrab_resume_from: str | None = None
        self._cdgrab_sharded_state: str | None = None  # a sharded sampler state to load once the model is sharded
        # structured / exact: the recording of the current micro-batch
        self._cdgrab_recording: Recording | ExactRecording | None = None

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def settings_from(cdgrab: CDGraBSettings | None, keywords: dict[str, Any]) -> CDGraBSettings:
        """The settings: `cdgrab`, or those the keyword arguments build.

        Args:
            cdgrab: the settings, or None.
            keywords: the settings' fields by their keyword names of the Trainer (`sorter`, `sorter_seed`,
                `sketch_min_numel`, and the others by the fields' names).

        Returns:
            `cdgrab`, or the CDGraBSettings the keywords make (the default settings for none).

        Raises:
            TypeError: both, or a cdgrab that is not a CDGraBSettings (one line).
        """
        if cdgrab is not None and keywords:
            raise TypeError(f"CDGraBTrainer: pass cdgrab=CDGraBSettings(...) or the keyword arguments "
                            f"{', '.join(keywords)}, not both")
        if cdgrab is not None and not isinstance(cdgrab, CDGraBSettings):
            raise TypeError(f"CDGraBTrainer: cdgrab must be a sorters.CDGraBSettings, got {type(cdgrab).__name__}")
        return cdgrab or CDGraBSettings(**{_KEYWORDS[key]: value for key, value in keywords.items()})

    @property
    def _uses_grads(self) -> bool:
        """Whether the sorter balances gradients (which the Trainer then forms or records)."""
        return self.cdgrab_settings.uses_grads

    @property
    def _grads_from_backward(self) -> bool:
        """MB-GraB in one process hosting one replica: its micro-batch's gradient is read from the Trainer's own
        backward (BackwardGradient), and no per-example gradient is formed. Under torchrun DDP averages .grad
        over the processes in the backward, and one process hosting R > 1 replicas has one backward for all R,
        so there each replica's micro-batch gradient is the mean of its examples' formed ones (the sampler
        averages the (R * b, d) rows), as costly as the other balancing sorters."""
        settings = self.cdgrab_settings
        return (getattr(SORTERS[settings.sorter], "uses_batch_size", False) and not settings.structured
                and self.args.world_size == 1 and self._replicas == (1, 1))

    @property
    def _module(self) -> torch.nn.Module:
        """The Trainer's model (set by its __init__, from model_init too)."""
        return cast(torch.nn.Module, self.model)

    @property
    def _sampler(self) -> CDGraBSampler:
        """The sampler, which _get_train_sampler built before the first micro-batch."""
        return cast(CDGraBSampler, self.cdgrab_sampler)

    @property
    def _replicas(self) -> tuple[int, int]:
        """(replicas in all, replicas hosted by this process)."""
        world = self.args.world_size
        wanted = self.cdgrab_settings.num_replicas or world
        return wanted, (wanted if world == 1 else 1)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> TrainOutput:
        """Trainer.train, after check_settings(); resuming also restores the sampler's state.

        Args:
            resume_from_checkpoint: as Trainer.train: a checkpoint-N folder, True for the last one in
                output_dir, or None (False) for a new run.
            *args: Trainer.train's other positional arguments.
            **kwargs: Trainer.train's other keyword arguments.

        Returns:
            The Trainer's TrainOutput.

        Raises:
            ValueError: True without any checkpoint in output_dir; what check_settings refuses; a checkpoint
                without the sampler's state, or written with other settings (each one line).
        """
        if resume_from_checkpoint is True:  # the Trainer's own rule: the last checkpoint in output_dir
            last = get_last_checkpoint(self.args.output_dir)
            if last is None:
                raise ValueError(f"no checkpoint-N folder in output_dir {self.args.output_dir} to resume from")
            resume_from_checkpoint = last
        self._cdgrab_resume_from = cast("str | None", resume_from_checkpoint or None)  # True: replaced above
        self.check_settings()
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def check_settings(self) -> None:
        """Refuse what would give other orders than CD-GraB's or lose examples silently; train() calls it.

        Raises:
            ValueError: one line for each: a train_dataset without a length, another train_sampling_strategy,
                auto_find_batch_size, DataParallel, DeepSpeed, FSDP1 or under FSDP2 a balancing
                sorter on what the layer records do not give, split_batches / dispatch_batches,
                ignore_data_skip on a resume, num_replicas other than the processes, a dataset that does not
                split into full batches without dataloader_drop_last; for a sorter that balances gradients,
                gradient checkpointing, dropout, NEFTune, label smoothing or a compute_loss_func.
        """
        args, name = self.args, type(self).__name__
        dataset = self.train_dataset
        if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError(f"{name} orders the examples of a map-style train_dataset (with __len__ and "
                             f"indexing); got {type(dataset).__name__}")
        if args.train_sampling_strategy != "random":
            raise ValueError(f"{name}: train_sampling_strategy={args.train_sampling_strategy!r} would replace the "
                             "sorter's order; leave it at 'random' (the sorter's sampler takes its place)")
        if args.auto_find_batch_size:
            raise ValueError(f"{name}: auto_find_batch_size changes the batch size mid-run, and with it the "
                             "sorter's steps; set per_device_train_batch_size yourself")
        if args.n_gpu > 1:
            raise ValueError(f"{name}: {args.n_gpu} GPUs in one process (DataParallel) split every batch; start "
                             "one process per GPU with torchrun instead")
        if self.is_deepspeed_enabled:
            raise ValueError(f"{name}: DeepSpeed shards the parameters, which the per-example gradients need whole; "
                             "use FSDP2 (fsdp=True) with exact_low_memory, or plain DDP (torchrun)")
        if self.is_fsdp_enabled:
            self._check_fsdp()
        elif args.fsdp:  # Accelerate 1.15 keeps MULTI_CPU on gloo CPU processes and drops the plugin, silently
            _LOGGER.warning("%s: fsdp is set, but Accelerate did not enable FSDP (it does on GPUs only): the model is "
                            "trained unsharded, with DDP across processes; CD-GraB's orders are the same", name)
        config = cast(AcceleratorConfig, args.accelerator_config)  # TrainingArguments' __post_init__ made it one
        if config.split_batches or config.dispatch_batches:
            raise ValueError(f"{name}: accelerator_config split_batches / dispatch_batches change how the loader's "
                             "batches reach the processes; leave both off (the default)")
        if self._cdgrab_resume_from is not None and args.ignore_data_skip:
            raise ValueError(f"{name}: ignore_data_skip=True replays a resumed epoch from its first batch, out of "
                             "step with the sorter; leave it False to resume")
        world, _ = self._replicas
        if args.world_size > 1 and world != args.world_size:
            raise ValueError(f"{name}: num_replicas={world} under {args.world_size} processes; each process is "
                             "one replica (leave num_replicas unset)")
        batch = args.per_device_train_batch_size
        if len(dataset) % (world * batch) and not args.dataloader_drop_last:
            raise ValueError(f"{name}: a dataset of {plural(len(dataset), 'example')} does not split into full "
                             f"batches of {plural(world, 'replica')} x {batch}; pass dataloader_drop_last=True (the "
                             f"last {plural(len(dataset) % (world * batch), 'example')} would never be used) or trim "
                             "the dataset")
        if self._uses_grads and not self._grads_from_backward:  # the backward's own gradient needs no tracing
            self._check_gradients_can_be_formed()

    def _check_fsdp(self) -> None:
        """Under Accelerate's FSDP plugin: FSDP2 only, and for a balancing sorter what the layer records give,
        exact CD-GraB or the structured sketches, of parameters that all have a layer rule (the formed
        per-example gradients need the parameters whole; docs/fsdp.md)."""
        name, settings = type(self).__name__, self.cdgrab_settings
        version = getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            raise ValueError(f"{name}: FSDP{version} flattens the parameters, whose per-layer weights the layer "
                             "records cannot name; use FSDP2: fsdp_config={'version': 2} (fully_shard)")
        if not self._uses_grads:
            return
        if getattr(self.accelerator.state.fsdp_plugin, "activation_checkpointing", False):
            raise ValueError(f"{name}: FSDP's activation checkpointing runs the layers' forward again in the "
                             f"backward, outside the recording whose layer records {settings.sorter} balances; turn "
                             "fsdp_config's activation_checkpointing off")
        model = self._module
        every_one_recorded = not Layout(model, selected_parameters(model, settings.grad_params, name)).formed
        if not every_one_recorded or not settings.structured and (
                settings.exact_low_memory is False or not settings.exact_applies(model)):
            raise ValueError(f"{name}: under FSDP {settings.sorter} balances what layer records give (the formed "
                             "per-example gradients need the parameters whole): exact CD-GraB (no sketch, "
                             "exact_low_memory=True or unset) or structured sketches (structured=True), with "
                             "grad_params selecting Linear, Conv1D, Embedding and LayerNorm parameters only")

    def _check_gradients_can_be_formed(self) -> None:
        args, name = self.args, type(self).__name__
        if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
            raise ValueError(f"{name}: gradient checkpointing cannot be traced by torch.func, which forms the "
                             f"per-example gradients {self.cdgrab_settings.sorter} balances; turn it off")
        # the Trainer trains in training mode: one line for the formed gradients and the layer records alike
        check_no_dropout(name, self._module, trains=True)
        if args.neftune_noise_alpha is not None:
            raise ValueError(f"{name}: NEFTune adds random noise in the forward, which per-example gradients cannot "
                             "replay; leave neftune_noise_alpha unset")
        if args.label_smoothing_factor > 0 or self.compute_loss_func is not None:
            raise ValueError(f"{name}: the sorter balances the gradients of the model's own loss (outputs.loss), "
                             "not of a label-smoothed or custom compute_loss_func one; drop those, or use a "
                             "sorter that ignores gradients (D-RR)")

    # ------------------------------------------------------------------ the loader and its sampler

    def get_train_dataloader(self) -> DataLoader:
        """The Trainer's loader, with a batch of every replica hosted here (one, under torchrun).

        Returns:
            The DataLoader of the train_dataset, whose sampler is a fresh CDGraBSampler.

        Raises:
            ValueError: no train_dataset.
        """
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        _, here = self._replicas
        return self._get_dataloader(dataset=self.train_dataset, description="Training",
                                    batch_size=here * self.args.per_device_train_batch_size,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    def _get_train_sampler(self, train_dataset: Dataset | None = None) -> CDGraBSampler:
        """A fresh CDGraBSampler (and per-example gradients) for this train() call, with the checkpoint's
        state when resuming."""
        # check_settings refused a train_dataset without a length and indexing before train() came here
        dataset = cast(_MapDataset, self.train_dataset if train_dataset is None else train_dataset)
        if self.cdgrab_settings.exact_low_memory is None:  # auto: decided once, kept in the settings
            # under FSDP the records are the only path (_check_fsdp): the dry run below then says why they fail
            exact = self._uses_grads and not self.cdgrab_settings.structured if self.is_fsdp_enabled \
                else self._exact_is_the_default(dataset)
            self.cdgrab_settings = dataclasses.replace(self.cdgrab_settings, exact_low_memory=exact)
        settings, args = self.cdgrab_settings, self.args
        world, here = self._replicas
        if self._uses_grads and self.cdgrab_grads is None:
            if settings.exact_low_memory:  # products from the Trainer's own backward (training_step)
                self.cdgrab_grads = settings.exact_gradients(self._module)
                self._first_sketch_dry_run(dataset)
            elif self._grads_from_backward:  # MB-GraB: the micro-batch's gradient is the backward's (training_step)
                self.cdgrab_grads = BackwardGradient(self._module, settings.grad_params)
            elif settings.structured:  # the sketches come from the Trainer's own backward (training_step)
                self.cdgrab_grads = self._layer_sketch()
                self._first_sketch_dry_run(dataset)
            else:
                self.cdgrab_grads = settings.loss_gradients(self._module)
                self._first_gradients_dry_run(dataset)
        # exact_low_memory: built with D-RR (no (d,) state), then given the exact sorter
        built: dict[str, Any] = {"sorter": "D-RR", "exact_low_memory": False} if settings.exact_low_memory else {}
        self.cdgrab_sampler = dataclasses.replace(settings, num_replicas=world, **built).sampler(
            len(dataset), batch_size=args.per_device_train_batch_size,
            d=self.cdgrab_grads.d if self.cdgrab_grads else None, drop_last=args.dataloader_drop_last,
            epochs=self._total_epochs(len(dataset) // world), view="rank" if here > 1 else "global")
        if settings.exact_low_memory:
            self._install_exact_sorter(len(dataset), world)
        if self._cdgrab_resume_from is not None:
            state = self._saved_sampler_state()
            if "sharded" not in state:
                self._sampler.load_state_dict(state, replay_from_epoch_start=True)
            elif not self.is_fsdp_enabled:
                raise ValueError(f"{type(self).__name__}: {self._cdgrab_resume_from} holds the sampler's state "
                                 "sharded, as written under FSDP; resume under FSDP (fsdp=True)")
            else:  # its rows follow the sharded parameters: loaded by _prepare_for_training, after the sharding
                self._cdgrab_sharded_state = os.path.join(self._cdgrab_resume_from, state["sharded"])
        return self._sampler

    def _install_exact_sorter(self, dataset_size: int, world: int) -> None:
        """exact_low_memory: the sampler's sorter is an ExactCDGraB (the orders of CD-GraB, a float32 running
        sum, no (d,) float64 one). The sampler was built with CD-GraB, which allocates that sum: rebuilt
        with D-RR (no state of size d), then given the exact sorter."""
        sampler, exact = self._sampler, cast(ExactGradients, self.cdgrab_grads)  # built for exact_low_memory
        # under torchrun every process has every replica's units (all-gathered): each takes its share of the
        # parameters' products and update (ParameterShare), with sum_all over its share only (d / N floats)
        # under FSDP the sampler's first step_units gives it the rows of the sharded parameters (ShardedRows)
        divided = self.args.world_size > 1 and not self.is_fsdp_enabled
        sampler.sorter = ExactCDGraB(world, sampler.m, exact.d, seed=self.cdgrab_settings.resolved_seed,
                                     sum_all=divided, share=ParameterShare(exact) if divided else None)
        sampler.d = exact.d

    def _layer_sketch(self) -> LayerSketch:
        """structured: the LayerSketch of the model as it is now, with the settings' map."""
        settings = self.cdgrab_settings
        return LayerSketch(self._module, settings.sketch_dim, settings.resolved_seed, params=settings.grad_params,
                           min_numel=settings.min_numel)

    def _total_epochs(self, per_replica: int) -> int:
        """The run's epochs (KH-SGD's and SBW's thresholds depend on it): num_train_epochs, or max_steps'."""
        args = self.args
        if args.max_steps > 0:
            micro_batches = per_replica // args.per_device_train_batch_size
            updates_per_epoch = max(math.ceil(micro_batches / args.gradient_accumulation_steps), 1)
            return math.ceil(args.max_steps / updates_per_epoch)
        return max(math.ceil(args.num_train_epochs), 1)

    def _first_gradients_dry_run(self, dataset: _MapDataset) -> None:
        """Form one example's gradient now, so that a model torch.func cannot trace (sdpa with a mask,
        dropout, a forward without labels) is refused before the first step, in PerExampleLossGrads' line.
        Reads train_dataset[0] (logged at INFO)."""
        collate = self._get_collator_with_removed_columns(self.data_collator, description="training")
        _LOGGER.info("%s: reading train_dataset[0] before training, to form its gradient once (a dry run that "
                     "refuses a model the per-example gradients cannot trace)", type(self).__name__)
        batch = self._prepare_inputs(collate([dataset[0]]))
        model, grads_of = self._module, cast(PerExampleLossGrads, self.cdgrab_grads)  # the formed path's
        was_training = model.training
        model.train()
        try:
            grads_of(batch)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}: {error}") from None
        finally:
            model.train(was_training)

    def _exact_is_the_default(self, dataset: _MapDataset) -> bool:
        """exact_low_memory None (auto): True where the records give the orders of CD-GraB fed the gradients
        of the model's own loss: CD-GraB unsketched with a layer rule for every selected parameter
        (CDGraBSettings.exact_applies), the Trainer's own compute_loss (a subclass's would be bypassed), and
        a causal LM, token or sequence classifier whose loss on the first two examples is the one the records'
        compute_loss computes."""
        settings = self.cdgrab_settings
        if not (self._uses_grads and settings.exact_applies(self._module)):
            return False
        mixin = type(self).__mro__.index(CDGraBTrainerMixin)
        if any("compute_loss" in vars(cls) for cls in type(self).__mro__[mixin + 1:] if cls is not Trainer) \
                or any("compute_loss" in vars(cls) for cls in type(self).__mro__[:mixin]):
            return False
        return self._records_refusal(dataset, "exact_low_memory=True") is None

    def _first_sketch_dry_run(self, dataset: _MapDataset) -> None:
        """structured / exact_low_memory: refuse now, in one line, a model or batch the layer records cannot
        serve (see _records_refusal)."""
        mode = "exact_low_memory=True" if self.cdgrab_settings.exact_low_memory else "structured=True"
        refusal = self._records_refusal(dataset, mode)
        if refusal is not None:
            raise ValueError(f"{type(self).__name__}: {refusal}")

    def _records_refusal(self, dataset: _MapDataset, mode: str) -> str | None:
        """Why the records' loss (compute_loss: _example_losses of the kind _loss_kind reads from the model's
        outputs) cannot stand for the model's own on the first two examples: no labels, logits neither a
        causal LM's (B, T, vocab) nor a classifier's (B, K), logits that change with explicit (B, T) position
        ids, or a model loss (outputs.loss) other than that loss of its logits; None when it can (the kind
        is then kept for compute_loss). Reads train_dataset[0] and [1] (logged at INFO)."""
        collate = self._get_collator_with_removed_columns(self.data_collator, description="training")
        _LOGGER.info("%s: reading train_dataset[0] and [1] before training, to run the model on them once (a dry "
                     "run, eval mode, no gradients: it checks %s against the model's own loss)", type(self).__name__,
                     mode)
        batch = self._prepare_inputs(collate([dataset[0], dataset[min(1, len(dataset) - 1)]]))
        if "labels" not in batch:
            return (f"{mode} computes the model's loss from the batch's labels; the collator gives none "
                    "(e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False))")
        flag = mode.split("=")[0]
        model = self._module
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                outputs = model(**batch)
                logits = getattr(outputs, "logits", None)
                kind = _loss_kind(model, logits, batch["labels"])
                if kind is None or not isinstance(logits, torch.Tensor):  # (_loss_kind gives None for no tensor)
                    return (f"{mode} needs a causal LM or token classifier whose outputs.logits are (B, T, classes) "
                            f"for (B, T) labels, or a sequence classifier whose logits are (B, labels) for B labels; "
                            f"use {flag}=False for this model")
                self._cdgrab_loss_kind = kind
                with_positions = self._with_positions(batch)
                if with_positions is not batch and not torch.allclose(
                        model(**with_positions).logits, logits, rtol=1e-4, atol=1e-5):
                    return (f"{mode} passes position_ids (B, T) = 0..T-1 so that the position embedding sees the "
                            f"examples, but this model's logits change with them (left padding?); use {flag}=False")
                losses, counts = _example_losses(kind, logits, batch["labels"])
                own = getattr(outputs, "loss", None)
                if not isinstance(own, torch.Tensor) or not torch.allclose(
                        ((losses * counts).sum() / counts.sum()).to(own.dtype), own, rtol=1e-4, atol=1e-6):
                    return (f"{mode} computes the {_LOSS_WORDS[kind]} loss, but this model's own loss "
                            f"(outputs.loss) is another; use {flag}=False for this model")
        finally:
            model.train(was_training)
        return None

    def _with_positions(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """inputs plus position_ids 0..T-1 per example, (B, T), when the model takes them and none are given:
        a model's own default (1, T) positions broadcast over the batch, and the position embedding's
        per-example gradients cannot be recovered from a broadcast output."""
        takes_positions = self.__dict__.get("_cdgrab_takes_positions")
        if takes_positions is None:  # once: the signature does not change during training
            model = self.accelerator.unwrap_model(self._module) if hasattr(self, "accelerator") else self._module
            takes_positions = "position_ids" in inspect.signature(model.forward).parameters
            self._cdgrab_takes_positions = takes_positions
        if "position_ids" in inputs or not takes_positions:
            return inputs
        ids = inputs.get("input_ids", inputs["labels"])
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        return {**inputs, "position_ids": positions}

    # ------------------------------------------------------------------ each micro-batch

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None, *args: Any,
                      **kwargs: Any) -> torch.Tensor:
        """The Trainer's step, and the sampler's.

        The per-example gradients of this micro-batch (rows in the sampler's order), with the parameters
        before the optimizer step, go to the sampler's step(), which all-gathers them. With structured, the
        sketches come from the step's own forward and backward (compute_loss).

        exact_low_memory: the backward skips the recorded weights' gradients (write_grads) and the records
        give .grad: in one process from the products' blocks; under torchrun (_records_write_grads) each
        parameter's owner takes the step's gradient from its blocks and broadcasts the processes' mean
        (CDGraBSampler.step_units), so DDP's all-reduce is skipped (no_sync) and .grad is what it would give.
        Otherwise (a parameter without a layer rule, or not selected) the backward keeps the weights'
        gradients and DDP averages them.

        Args:
            model: the model the Trainer trains (wrapped, e.g. in DistributedDataParallel).
            inputs: the micro-batch, a dict of (micro-batch, ...) tensors with "labels".
            num_items_in_batch: as Trainer.training_step.
            *args: Trainer.training_step's other positional arguments.
            **kwargs: Trainer.training_step's other keyword arguments.

        Returns:
            The Trainer's detached loss of the micro-batch.

        Raises:
            NonFiniteGradientError: a per-example gradient holds NaN or inf, naming the step and epoch.
        """
        grads, exact = None, self.cdgrab_settings.exact_low_memory
        if self.is_fsdp_enabled:
            self._records_over_sharded_parameters()
        writes = bool(exact) and self._records_write_grads()
        # cdgrab_grads: what _get_train_sampler built for these settings (ExactGradients, PerExampleLossGrads or
        # a LayerSketch)
        backward = self.cdgrab_grads if isinstance(self.cdgrab_grads, BackwardGradient) else None
        if exact:  # the records give the weight gradients too, the backward skips its own
            self._cdgrab_recording = cast(ExactGradients, self.cdgrab_grads).recording(write_grads=writes)
        elif backward is not None:  # MB-GraB: what the step's own backward adds to .grad
            backward.start()
        elif self._uses_grads and not self.cdgrab_settings.structured:
            self._module.train()
            grads_of = cast(PerExampleLossGrads, self.cdgrab_grads)
            grads = grads_of(self._prepare_inputs(inputs)).float()  # (micro-batch, d or D)
        elif self._uses_grads:
            self._cdgrab_recording = cast(LayerSketch, self.cdgrab_grads).recording()
        unsynced = model if writes and isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        try:
            # the owners write .grad instead
            with unsynced.no_sync() if unsynced is not None else contextlib.nullcontext():
                loss = super().training_step(model, inputs, num_items_in_batch, *args, **kwargs)
            if exact:
                units = cast(ExactRecording, self._cdgrab_recording).units()  # (micro-batch) units
                self._sampler.step_units(units)
                units.write_grads()  # one process: .grad of the parameters the step's products did not reach
                return loss
            if self._cdgrab_recording is not None:
                grads = cast(Recording, self._cdgrab_recording).sketches().float()  # (micro-batch, D)
            if backward is not None:
                grads = backward.delta()[None]  # (1, d): the replica's micro-batch gradient
        finally:
            self._cdgrab_recording = None
        self._sampler.step(grads)
        return loss

    def _records_over_sharded_parameters(self) -> None:
        """Under FSDP: the Trainer shards the model (fully_shard, new DTensor parameters) after it built the
        sampler and its ExactGradients (or LayerSketch), so at the first micro-batch they are built again over
        the sharded parameters (the same names, the same d and map): exact CD-GraB's running sum then follows
        them (ShardedRows), and no unsharded copy of the model is kept alive."""
        from sorters.fsdp import _exact_over_current_parameters, _sketch_over_current_parameters
        grads = self.cdgrab_grads
        if isinstance(grads, ExactGradients):
            self.cdgrab_grads = _exact_over_current_parameters(grads)
        elif isinstance(grads, LayerSketch):
            self.cdgrab_grads = _sketch_over_current_parameters(grads)

    def _records_write_grads(self) -> bool:
        """exact_low_memory: whether the records write .grad (the backward skipping the recorded weights'
        gradients): always in one process; under torchrun where every trainable parameter is selected and has a
        layer rule (each then has an owner that writes it; any other would keep autograd's unsynced gradient);
        never under FSDP, which reduce-scatters the gradients itself."""
        if self.is_fsdp_enabled:
            return False
        if self.args.world_size == 1:
            return True
        exact = cast(ExactGradients, self.cdgrab_grads)
        selected = {id(p) for p in exact.params}
        return not exact.formed and all(id(p) in selected for p in self._module.parameters() if p.requires_grad)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None, *args: Any,
                     **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The Trainer's loss, or with a recording (inside training_step) the model's loss from per-example ones.

        With a recording (structured, exact_low_memory), the model's loss (causal LM or classifier:
        _example_losses) is computed from the per-example losses that the recording watches, as the model
        would compute it.

        Args:
            model: the model, as Trainer.compute_loss takes it.
            inputs: the micro-batch, a dict of (micro-batch, ...) tensors with "labels".
            return_outputs: also return the model's outputs.
            num_items_in_batch: as Trainer.compute_loss: the batch's labelled tokens; where the model accepts
                loss keyword arguments, the token sum is divided by it, else by this micro-batch's labelled
                tokens.
            *args: Trainer.compute_loss's other positional arguments.
            **kwargs: Trainer.compute_loss's other keyword arguments.

        Returns:
            The scalar loss, or with return_outputs the pair (loss, outputs).
        """
        recording = self._cdgrab_recording
        if recording is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch, *args, **kwargs)
        inputs = self._with_positions(dict(inputs))
        labels = inputs.pop("labels")
        with recording:
            outputs = model(**inputs)
            kind = self.__dict__.get("_cdgrab_loss_kind", "causal_lm")  # _records_refusal's, on the first examples
            losses, counts = _example_losses(kind, outputs.logits, labels)
            recording.watch(losses)
        token_sum = (losses * counts).sum()
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss = token_sum / torch.as_tensor(num_items_in_batch, device=token_sum.device)
            if self.args.average_tokens_across_devices:  # as Trainer.compute_loss scales the model's loss
                loss = loss * self.accelerator.num_processes
        else:
            loss = token_sum / counts.sum()
        return (loss, outputs) if return_outputs else loss

    # ------------------------------------------------------------------ checkpoints

    # trial: an optuna.Trial or a dict of hyperparameters (optuna is optional, so not named here)
    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's model wrapping (under FSDP: the sharding), then what follows the sharded parameters:
        the records' ExactGradients or LayerSketch, and a resumed sampler's sharded state (before the loader
        is iterated)."""
        prepared = super()._prepare_for_training(*args, **kwargs)
        if self.is_fsdp_enabled:
            self._records_over_sharded_parameters()
        checkpoint, self._cdgrab_sharded_state = self._cdgrab_sharded_state, None
        if checkpoint is not None:
            from sorters.fsdp import load_sharded_state_dict
            load_sharded_state_dict(self._sampler, cast(ExactGradients, self.cdgrab_grads), checkpoint,
                                    replay_from_epoch_start=True)
        return prepared

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        sampler, exact = self.cdgrab_sampler, self.cdgrab_grads
        state: dict[str, Any] | None = None
        if sampler is not None and self.is_fsdp_enabled and isinstance(exact, ExactGradients):
            # under FSDP each process saves its rows of the running sum (torch.distributed.checkpoint), so that no
            # process holds d numbers; SAMPLER_FILE names the folder
            import torch.distributed.checkpoint as dcp

            from sorters.fsdp import sharded_state_dict
            dcp.save({"sampler": sharded_state_dict(sampler, exact)},
                     checkpoint_id=os.path.join(folder, _SHARDED_SAMPLER_DIR))
            state = {"sharded": _SHARDED_SAMPLER_DIR}
        elif sampler is not None:
            # every process takes the state (exact_low_memory under torchrun sums its running sum over them)
            state = sampler.state_dict()
        if self.args.should_save and state is not None:
            path = os.path.join(folder, SAMPLER_FILE)
            torch.save({"sampler": state, "gradients": self._gradient_settings(), FORMAT_KEY: TRAINER_STATE_FORMAT},
                       path + ".tmp")  # the format: sorters/_state_format.py
            os.replace(path + ".tmp", path)  # never a half-written state beside a complete checkpoint

    def _saved_sampler_state(self) -> dict[str, Any]:
        path = os.path.join(cast(str, self._cdgrab_resume_from), SAMPLER_FILE)  # train() set it to resume
        if not os.path.isfile(path):
            raise ValueError(f"{type(self).__name__}: {self._cdgrab_resume_from} has no {SAMPLER_FILE}, so its "
                             "sorter state is lost (a checkpoint of a plain Trainer?); resume from a "
                             "checkpoint this trainer wrote, or start a new run")
        try:
            saved = torch.load(path, weights_only=True)
        except Exception as error:
            raise ValueError(f"{type(self).__name__}: cannot read {path} ({error}); resume from another "
                             "checkpoint") from None
        # format 0 (no format key): the two layouts below, both still read; a newer format is refused
        saved_format(f"{type(self).__name__}: {path}", saved, TRAINER_STATE_FORMAT)
        if "sampler" not in saved:  # written before the gradient settings were recorded
            saved = {"sampler": saved, "gradients": {"structured": False, "sketch_min_numel": None,
                                                     "grad_params": self._gradient_settings()["grad_params"]}}
        now, then = self._gradient_settings(), saved["gradients"]
        if isinstance(then["grad_params"], (list, tuple)):  # a list of expressions, saved as a list
            then = {**then, "grad_params": list(then["grad_params"])}
        if then["sketch_min_numel"] == 0:  # accepted before it had to be >= 1; chose the weights 1 does
            then = {**then, "sketch_min_numel": 1}
        if self._uses_grads and (now["structured"], now["grad_params"]) != (then["structured"], then["grad_params"]) \
                or now["structured"] and now["sketch_min_numel"] != then["sketch_min_numel"]:
            changed = ", ".join(f"{key}={then.get(key)!r} (now {now[key]!r})"
                                for key in now if now[key] != then.get(key))
            raise ValueError(f"{type(self).__name__}: {path} was written with other gradient settings: {changed}; "
                             "resume with the checkpoint's settings")
        return saved["sampler"]

    def _gradient_settings(self) -> dict[str, Any]:
        """What the balanced vectors are, beside the sampler's own settings (sketch_dim, seed, d)."""
        settings = self.cdgrab_settings
        params = list(settings.grad_params) if isinstance(settings.grad_params, tuple) else settings.grad_params
        return {"structured": settings.structured, "grad_params": params,
                "sketch_min_numel": settings.min_numel if settings.structured else None,
                "exact_low_memory": settings.exact_low_memory}  # which path ran (auto decided), for the record


_LOSS_WORDS = {"causal_lm": "causal LM (logits at t predict labels at t + 1)",
              "token_classification": "token classification (logits at t scored against labels at t)",
              "single_label_classification": "single-label classification (cross-entropy)",
              "multi_label_classification": "multi-label classification (binary cross-entropy)",
              "regression": "regression (mean squared error)"}


def _loss_kind(model: torch.nn.Module, logits: object, labels: object) -> str | None:
    """Which loss the model's own is, as transformers picks it from the outputs: for (B, T, V) logits and
    (B, T) labels "token_classification" where the model says so (transformers' loss_type
    "ForTokenClassification": token t's logits scored against labels[t]), else "causal_lm"; for (B, K) logits
    and B labels (a sequence classifier) the config's problem_type,
    or as transformers infers it: "regression" for K = 1, "single_label_classification" for integer labels,
    else "multi_label_classification"; None for anything else."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return None
    if logits.dim() == 3 and logits.shape[:2] == labels.shape:
        return "token_classification" if getattr(model, "loss_type", None) == "ForTokenClassification" \
            else "causal_lm"
    if logits.dim() != 2 or labels.shape[0] != logits.shape[0]:
        return None
    problem = getattr(getattr(model, "config", None), "problem_type", None)
    if problem in _LOSS_WORDS:
        return problem
    if logits.shape[1] == 1:
        return "regression"
    return "single_label_classification" if not labels.dtype.is_floating_point else "multi_label_classification"


def _example_losses(kind: str, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's loss of `kind` (_loss_kind), as transformers computes a batch's, and its weight:
    (losses (B,), counts (B,)), the batch's loss (losses * counts).sum() / counts.sum(). A classifier's
    logits (B, K): its examples weigh alike (counts 1), each loss the mean over its K outputs where
    transformers takes the mean over all B K (regression with K > 1, multi-label)."""
    if kind == "causal_lm":
        return _causal_lm_losses(logits, labels)
    if kind == "token_classification":
        return _labelled_token_losses(logits, labels)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    B = logits.shape[0]
    if kind == "single_label_classification":
        losses = torch.nn.functional.cross_entropy(logits.view(B, -1), labels.view(-1), reduction="none")
    elif kind == "regression":
        losses = (logits.view(B, -1) - labels.view(B, -1).to(logits.dtype)).square().mean(1)
    else:
        losses = torch.nn.functional.binary_cross_entropy_with_logits(
            logits.view(B, -1), labels.view(B, -1).to(logits.dtype), reduction="none").mean(1)
    return losses, torch.ones(B, dtype=losses.dtype, device=losses.device)


def _causal_lm_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's causal LM loss, as transformers computes a batch's (ForCausalLMLoss): token t's
    logits predict labels[t + 1], labels of -100 are ignored, in float32 (or wider).

    logits (B, T, V), labels (B, T) -> (losses (B,): the mean cross-entropy over each example's labelled
    tokens; counts (B,): how many it has, in the losses' dtype). The batch's loss is
    (losses * counts).sum() / counts.sum(). An example with no labelled token: loss 0, count 0."""
    return _labelled_token_losses(logits, torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:])


def _labelled_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's mean cross-entropy of token t's logits against targets[t] over its tokens whose target
    is not -100, in float32 (or wider): a token classifier's loss (transformers' CrossEntropyLoss over the
    batch's tokens), and the causal LM's with the targets shifted. logits (B, T, V), targets (B, T) ->
    (losses (B,), counts (B,)) as _causal_lm_losses."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    B, T, V = logits.shape  # the classes along the contiguous last dim: (B T, V), as transformers does
    per_token = torch.nn.functional.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T),
                                                  ignore_index=-100, reduction="none").view(B, T)  # 0 where ignored
    counts = (targets != -100).sum(1).to(per_token.dtype)
    return per_token.sum(1) / counts.clamp(min=1), counts


class CDGraBTrainer(CDGraBTrainerMixin, Trainer):
    """A `transformers.Trainer` that trains on the orders of a sorter (CD-GraB by default); see the module
    docstring and CDGraBTrainerMixin for its arguments."""
