"""CD-GraB example ordering for PyTorch Lightning: `CDGraBCallback` feeds a `CDGraBSampler`.

    class LitModel(L.LightningModule):
        def setup(self, stage):       # every rank, after Lightning set up DDP: the sampler sees the process group
            self.sampler = LightningCDGraBSampler(train_set, batch_size=16, d=self.grads_of.d, drop_last=True)
        def train_dataloader(self):
            return DataLoader(train_set, batch_size=self.sampler.loader_batch_size, sampler=self.sampler)
        def per_example_grads(self, batch):  # (B, d): the gradients of this batch's examples
            x, y = batch
            return self.grads_of(x, y)       # grads_of = PerExampleGrads(self.net, loss_fn)

    trainer = L.Trainer(use_distributed_sampler=False, callbacks=[CDGraBCallback()], strategy="ddp", devices=2)

With a sorters.CDGraBSettings (the same object the HF Trainer's glue takes), build the pieces from it and
hand it to the callback, which checks at on_fit_start that the sampler (and sketcher) agree with it:

    CDGRAB = CDGraBSettings(sorter="CD-GraB", seed=0)
    def setup(self, stage):
        self.grads_of = CDGRAB.gradients(self.net, loss_fn)            # PerExampleGrads
        self.sampler = CDGRAB.sampler(train_set, batch_size=16, d=self.grads_of.d, drop_last=True,
                                      cls=LightningCDGraBSampler)
    trainer = L.Trainer(use_distributed_sampler=False, callbacks=[CDGraBCallback(settings=CDGRAB)], ...)

What the callback does:
- setup: refuses `Trainer(use_distributed_sampler=True)` (Lightning would wrap the sampler in a
  DistributedSampler and every rank would see other examples than the sampler chose);
- on_train_batch_start: `sampler.step(pl_module.per_example_grads(batch))` (`step(None)` for sorters that
  need no gradients: D-RR, D-SO, Fold, FlipFlop, SWR). MB-GraB in one process hosting one replica steps
  after the backward instead (on_before_backward / on_after_backward) with the batch's gradient, what the
  backward added to .grad (`BackwardGradient`; the sampler's d = the module's trainable parameters'
  count), and needs no per_example_grads; under DDP, or R > 1 replicas in one process, per_example_grads.
  At batch start the parameters are those the batch's optimizer step starts from, as in the own-loop
  example where step() comes before optimizer.step(); the hook also sees the batch, which
  on_before_optimizer_step does not, and runs once per batch under gradient accumulation;
- state_dict / load_state_dict: the sampler's state goes into the checkpoint under the callback. Every
  rank holds the same state (each runs the same sorter on the same all-gathered gradients), so rank 0's
  copy, the one Lightning writes, restores every rank; except exact CD-GraB on a model sharded under
  ModelParallelStrategy, whose running sum is each rank's own rows: there the strategy's distributed
  checkpoint keeps each rank's rows, and each rank restores its own (docs/fsdp.md).
Lightning calls `set_epoch` on the DataLoader's sampler itself, with its epoch count; the sampler checks
that it is the epoch it yields next.

Mid-epoch resume. Lightning 2.6 saves and restores a DataLoader's position only when the DataLoader
itself has state_dict/load_state_dict (a sampler's are not looked at); for any other loader it starts a
fresh iterator after a mid-epoch checkpoint and takes the first (remaining count) batches from it,
warning that the loader is "not resumable". CDGraBSampler's iteration after a mid-epoch load_state_dict
yields the rest of the interrupted epoch, in that epoch's order, and its len() says so; Lightning,
though, counts the batches left itself (the loader's len() less the batches done), so
`LightningCDGraBSampler` keeps len() at the whole epoch's. The run then continues with the orders of an
uninterrupted run (Lightning's warning still appears: it looks at the loader, not the sampler).

Sketches from the training step's own backward (`CDGraBSettings(structured=True, sketch_dim=D)`, issue #31):
instead of a second per-example pass, the callback records the layers during the step's forward
(LayerSketch.recording, sorters/layer_sketch.py) and steps the sampler with the sketches after its
backward (on_after_backward). The step builds its loss from its (B,) per-example losses and hands them
over with `watch(self, losses)`. The sketcher is `self.sketcher = CDGRAB.layer_sketch(self.net)` in the
LightningModule (found there at on_fit_start, as the sampler is), or `CDGraBCallback(sketcher=...)`:

        def training_step(self, batch, batch_idx):
            x, y = batch
            losses = watch(self, F.cross_entropy(self.net(x), y, reduction="none"))   # (B,)
            return losses.mean()

The sampler is built with sketch_dim = the sketcher's dim (and d = its d); the checkpoint records the map
(its blocks and seed), and a resume with another map is refused.

Exact CD-GraB from the training step's own backward (`CDGraBSettings(exact_low_memory=True)`, issue #47): the
same recording, of the layers' inputs and output gradients (ExactGradients.recording, sorters/exact.py),
and after the backward `sampler.step_units(units)`: the orders of CD-GraB fed the formed per-example
gradients, which are never formed whole. training_step as above (watch(self, losses)); in the module:

    def setup(self, stage):
        self.exact = CDGRAB.exact_gradients(self.net)                       # ExactGradients
        self.sampler = CDGRAB.sampler(train_set, batch_size=16, d=self.exact.d, drop_last=True,
                                      cls=LightningCDGraBSampler)         # exact=True: an ExactCDGraB

Under DDP each rank hands over its own records and the sampler all-gathers them (docs/exact-cdgrab.md,
"Several processes").

A model sharded with FSDP2 (`ModelParallelStrategy`, `fully_shard` in the module's `configure_model`, which
Lightning calls after `setup()`): the callback rebuilds the module's ExactGradients (or sketcher, with the same
map) over the sharded parameters at on_fit_start, and exact CD-GraB's running sum follows their rows
(sorters.fsdp.ShardedRows; docs/fsdp.md). The formed per-example gradients, and FSDPStrategy (FSDP1's flat
parameters), are refused for a balancing sorter.

Lightning is imported here, so `import sorters` never needs it (pip extra: `cdgrab-sorters[lightning]`).
"""
from collections.abc import Callable
from typing import Any

import torch

from sorters._state_format import FORMAT_KEY, LIGHTNING_STATE_FORMAT, saved_format
from sorters.exact import ExactCDGraB, ExactGradients, ExactRecording
from sorters.fsdp import _exact_over_current_parameters, _sketch_over_current_parameters
from sorters.layer_sketch import LayerSketch, Recording
from sorters.per_example import BackwardGradient
from sorters.sampler import CDGraBSampler
from sorters.settings import CDGraBSettings

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError as error:  # the package depends on torch, numpy and numba only
    raise ImportError("sorters.lightning needs PyTorch Lightning: pip install 'lightning>=2.4' "
                      "(or the package's extra: pip install '.[lightning]')") from error

__all__ = ["CDGraBCallback", "LightningCDGraBSampler", "watch"]

# ModelParallelStrategy's distributed checkpoint: where the sampler's rows go in its "state_dict" (by DCP's key)
_SHARDED_KEY = "cdgrab_sampler"


class LightningCDGraBSampler(CDGraBSampler):
    """A CDGraBSampler (same arguments) for Lightning: len() is the whole epoch's.

    Also in the epoch after a mid-epoch load_state_dict, whose iteration yields only its rest. Lightning takes
    len() less the batches it had done from a resumed epoch's fresh iterator; the plain sampler's len() (the
    rest) would make it stop that many batches short.
    """

    def __len__(self) -> int:
        """The number of indices a whole epoch yields in this process, also while resuming one."""
        return len(self.replicas_yielded) * self.m


class CDGraBCallback(Callback):
    """Drives a CDGraBSampler from a Lightning Trainer: one step() per training batch, set-up checks,
    and the sampler's state in the checkpoint.

    Args:
        sampler: the CDGraBSampler the training DataLoader uses, or None (the default): the LightningModule's
            (else the DataModule's) attribute `sampler`, looked up at on_fit_start. Under DDP build it in
            their `setup()`: Lightning has started the process group by then (the sampler reads its world
            size and rank from it), and setup() runs before on_fit_start.
        grads_fn: grads_fn(pl_module, batch) -> (B, d) per-example gradients of the batch's B examples (B =
            sampler.loader_batch_size; rows in the order the sampler yielded them; d = the sampler's d,
            or its sketch_dim). None (the default): `pl_module.per_example_grads(batch)`. Called only
            for sorters that balance gradients (`sampler.uses_grads`).
        sketcher: a LayerSketch of the module's network instead of grads_fn: the (B, D) sketches come from the
            training step's own forward and backward; training_step must pass its (B,) per-example
            losses to `watch(self, losses)` and build its loss from them (see the module docstring).
            None: with settings.structured, the LightningModule's attribute `sketcher`.
        settings: a sorters.CDGraBSettings, or None: the sampler and sketcher are then taken as built. Given,
            on_fit_start refuses in one line a sampler (or sketcher) built with other settings;
            structured=True means sketches from the step's own backward (a sketcher).
            exact_low_memory None (the settings' default, "auto" in the HF Trainer) is False here:
            the module's code (self.exact and watch(), or per_example_grads) picks the path.
        exact: an ExactGradients of the module's network (with a sampler built with exact=True): exact
            CD-GraB from the same recording, watch() as for the sketcher. None: with
            settings.exact_low_memory, the LightningModule's attribute `exact`.

    Raises:
        ValueError: more than one of grads_fn, sketcher and exact; a sketcher without settings.structured,
            grads_fn with structured or exact_low_memory settings, or exact without exact_low_memory
            (each one line).
        TypeError: settings that are not a CDGraBSettings (one line).
    """

    def __init__(self, sampler: CDGraBSampler | None = None,
                 grads_fn: Callable[[LightningModule, Any], torch.Tensor] | None = None,
                 sketcher: LayerSketch | None = None, *, settings: CDGraBSettings | None = None,
                 exact: ExactGradients | None = None) -> None:
        if sum(x is not None for x in (sketcher, grads_fn, exact)) > 1:
            raise ValueError("CDGraBCallback: pass one of grads_fn, sketcher and exact")
        if settings is not None and not isinstance(settings, CDGraBSettings):
            raise TypeError(f"CDGraBCallback: settings must be a sorters.CDGraBSettings, "
                            f"got {type(settings).__name__}")
        if settings is not None and not settings.structured and sketcher is not None:
            raise ValueError("CDGraBCallback: a sketcher builds structured sketches: pass "
                             "CDGraBSettings(structured=True, sketch_dim=...) with it")
        if settings is not None and (settings.structured or settings.exact_low_memory) and grads_fn is not None:
            mode = "structured=True" if settings.structured else "exact_low_memory=True"
            raise ValueError(f"CDGraBCallback: {mode} takes what it balances from the step's own backward: "
                             "drop grads_fn")
        if settings is not None and not settings.exact_low_memory and exact is not None:
            raise ValueError("CDGraBCallback: exact= balances from layer records: pass "
                             "CDGraBSettings(exact_low_memory=True) with it")
        self.sampler, self.grads_fn, self.sketcher, self.settings = sampler, grads_fn, sketcher, settings
        self.exact = exact          # ExactGradients: exact CD-GraB from the step's own backward
        self._pending_state: dict[str, Any] | None = None  # a checkpoint's state loaded before the sampler was found
        # the current batch's recording: the sketcher's (LayerSketch) or the exact path's (ExactGradients)
        self._recording: Recording | ExactRecording | None = None
        # MB-GraB in one process hosting one replica: the micro-batch's gradient from the step's own backward
        self._backward: BackwardGradient | None = None
        # exact CD-GraB on a sharded model under a distributed checkpoint: the running sum's rows are saved by
        # each process into the checkpoint's model state (on_save_checkpoint) and read from trainer.ckpt_path
        self._saves_rows = False
        self._trainer: Trainer | None = None

    @property
    def _sampler(self) -> CDGraBSampler:
        """The sampler, which the hooks after on_fit_start have (on_fit_start finds it or refuses)."""
        if self.sampler is None:
            raise RuntimeError("CDGraBCallback: no sampler yet: Lightning's on_fit_start hook finds it")
        return self.sampler

    # ------------------------------------------------------------------ set-up

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Lightning's hook: refuses `Trainer(use_distributed_sampler=True)` before fitting.

        Raises:
            ValueError: the Trainer would replace the sampler with a DistributedSampler (one line).
        """
        if stage == "fit" and getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
            raise ValueError("CDGraBCallback: pass Trainer(use_distributed_sampler=False): the CDGraBSampler "
                             "already gives each rank its examples, and Lightning would replace it")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Lightning's hook: finds the sampler (and sketcher, exact records), checks them against each other
        and the settings, and loads a checkpoint's state that came before the sampler was found.

        Raises:
            ValueError: no sampler; a sampler, sketcher or ExactGradients built with other settings or of
                another d; a gradient sorter without per_example_grads or grads_fn (each one line).
        """
        if self.sampler is None:
            # Trainer.datamodule is set by Lightning's data connector at fit, not declared on the class
            for owner in (pl_module, trainer.datamodule):  # type: ignore[attr-defined]
                found = getattr(owner, "sampler", None)
                if isinstance(found, CDGraBSampler):
                    self.sampler = found
                    break
            else:
                raise ValueError("CDGraBCallback: no sampler: pass CDGraBCallback(sampler=...) or set "
                                 "self.sampler = CDGraBSampler(...) in the LightningModule's setup()")
        if self.settings is not None:
            self._check_settings(pl_module)
        if self.sketcher is not None:
            self._check_sketcher()
        self._check_sharding(trainer, pl_module)
        self._check_exact()
        if self.exact is not None and getattr(trainer, "world_size", 1) > 1:
            # Lightning takes every callback's state on every rank (dump_checkpoint), as a divided sampler's
            # state_dict() needs: each rank takes its share of the parameters' products
            self._sampler.divide_products = True
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
        self._backward = self._backward_gradient(trainer, pl_module)
        self._trainer = trainer
        self._saves_rows = isinstance(self._sampler.sorter, ExactCDGraB) and self.exact is not None \
            and _has_dtensors(pl_module) and bool(getattr(trainer.strategy, "_save_distributed_checkpoint", False))
        if self._sampler.uses_grads and self._backward is None and self.sketcher is None and self.exact is None \
                and self.grads_fn is None \
                and not hasattr(pl_module, "per_example_grads"):
            raise ValueError(f"CDGraBCallback: {self._sampler.sorter.name} balances per-example gradients: define "
                             "per_example_grads(self, batch) -> (B, d) in the LightningModule, or pass grads_fn")

    def _check_settings(self, pl_module: LightningModule) -> None:
        """The sampler (and, structured, the sketcher) must be the ones these settings build."""
        settings, sampler = self.settings, self._sampler
        if settings is None:
            return
        built: dict[str, object] = {"sorter": sampler.sorter.name, "seed": sampler.seed,
                                    "sketch_dim": sampler.sketch_dim}
        wanted: dict[str, object] = {"sorter": settings.sorter, "seed": settings.resolved_seed,
                                     "sketch_dim": settings.sketch_dim}
        if settings.num_replicas is not None:
            built["num_replicas"], wanted["num_replicas"] = sampler.num_replicas, settings.num_replicas
        if built != wanted:
            changed = ", ".join(f"{key}={built[key]!r} (settings: {wanted[key]!r})"
                                for key in built if built[key] != wanted[key])
            raise ValueError(f"CDGraBCallback: the sampler was built with {changed}: "
                             "build it with settings.sampler(...)")
        if settings.exact_low_memory and self.exact is None:
            self.exact = getattr(pl_module, "exact", None)
        if not settings.structured:
            return
        if self.sketcher is None:
            self.sketcher = getattr(pl_module, "sketcher", None)
        if not isinstance(self.sketcher, LayerSketch):
            raise ValueError("CDGraBCallback: structured=True needs a sketcher: set self.sketcher = "
                             "settings.layer_sketch(self.net) in the LightningModule, or pass "
                             "CDGraBCallback(sketcher=...)")
        sketcher = self.sketcher
        if (sketcher.dim, sketcher.sketch.seed) != (min(settings.sketch_dim, sketcher.d), settings.resolved_seed):
            raise ValueError(f"CDGraBCallback: the sketcher has dim={sketcher.dim}, seed={sketcher.sketch.seed}, "
                             f"the settings sketch_dim={settings.sketch_dim}, seed={settings.resolved_seed}: build it "
                             "with settings.layer_sketch(...)")

    def _check_sharding(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A sharded model: FSDP2 (ModelParallelStrategy, fully_shard in configure_model) takes exact CD-GraB
        or the structured sketches from layer records, the ExactGradients or LayerSketch rebuilt over the sharded
        parameters; FSDP1 (FSDPStrategy) and the paths that need the parameters whole are refused."""
        if not self._sampler.uses_grads:  # D-RR, D-SO, Fold, FlipFlop, SWR: no gradient, any strategy
            return
        if _is_fsdp1(trainer):
            raise ValueError(f"CDGraBCallback: {type(trainer.strategy).__name__} wraps the model in FSDP1, whose flat "
                             "parameters the layer records cannot name; use ModelParallelStrategy and fully_shard "
                             "(FSDP2) in configure_model (docs/fsdp.md)")
        if not _has_dtensors(pl_module):
            return
        if self.sketcher is not None:
            stale_sketcher, self.sketcher = self.sketcher, _sketch_over_current_parameters(self.sketcher)
            if getattr(pl_module, "sketcher", None) is stale_sketcher:  # the module's attribute, as found
                pl_module.sketcher = self.sketcher  # type: ignore[assignment]  # nn.Module.__setattr__: tensors, modules
            return
        if self.exact is None:
            raise ValueError(f"CDGraBCallback: the model is sharded (fully_shard), and {self._sampler.sorter.name} "
                             "from formed per-example gradients or the backward's gradient needs the parameters "
                             "whole; balance from layer records: exact CD-GraB (CDGraBSettings(exact_low_memory="
                             "True), self.exact = settings.exact_gradients(self.net)) or structured sketches (a "
                             "sketcher), with watch(self, losses) in training_step (docs/fsdp.md)")
        stale, self.exact = self.exact, _exact_over_current_parameters(self.exact)
        if getattr(pl_module, "exact", None) is stale:  # the module's attribute, as the callback found it
            pl_module.exact = self.exact  # type: ignore[assignment]  # nn.Module.__setattr__: tensors, modules

    def _check_sketcher(self) -> None:
        """The sampler balances gradients, of the sketcher's d and dim."""
        sampler, sketcher = self._sampler, self.sketcher
        if sketcher is None:
            return
        if not sampler.uses_grads:
            raise ValueError(f"CDGraBCallback: {sampler.sorter.name} balances no gradients: drop the sketcher")
        if sampler.sketch_dim != sketcher.dim or sampler.d != sketcher.d:
            raise ValueError(f"CDGraBCallback: the sampler balances d={sampler.d}, sketch_dim={sampler.sketch_dim}, "
                             f"the sketcher gives d={sketcher.d}, dim={sketcher.dim}: build the sampler with "
                             "d=sketcher.d, sketch_dim=sketcher.dim")

    def _backward_gradient(self, trainer: Trainer, pl_module: LightningModule) -> BackwardGradient | None:
        """MB-GraB (its unit a replica's whole batch) in one process hosting one replica, without grads_fn: the
        batch's gradient is what the step's own backward adds to .grad (BackwardGradient of the module's
        parameters, or the settings' grad_params), so no per-example gradient is formed. Under DDP the
        backward averages .grad over the ranks, and one process hosting R > 1 replicas has one backward for
        all R: there per_example_grads (or grads_fn) gives the rows the sampler averages per replica."""
        sampler = self._sampler
        if not getattr(sampler.sorter, "uses_batch_size", False) or self.grads_fn is not None \
                or self.sketcher is not None or self.exact is not None or len(sampler.replicas_here) != 1 \
                or getattr(trainer, "world_size", 1) != 1:
            return None
        backward = BackwardGradient(pl_module, None if self.settings is None else self.settings.grad_params)
        if sampler.d != backward.d:
            raise ValueError(f"CDGraBCallback: {sampler.sorter.name} balances each batch's gradient from the step's "
                             f"own backward, {backward.d} numbers for the module's trainable parameters, but the "
                             f"sampler was built with d={sampler.d}: build it with d=sum(p.numel() for p in "
                             "self.parameters() if p.requires_grad)")
        return backward

    def _check_exact(self) -> None:
        """An exact sampler (ExactCDGraB) and an ExactGradients of the same d come together, or neither."""
        sampler, exact = self._sampler, self.exact
        is_exact = isinstance(sampler.sorter, ExactCDGraB)
        if exact is None and not is_exact:
            return
        if not isinstance(exact, ExactGradients):
            raise ValueError("CDGraBCallback: an exact sampler (exact=True) needs the layer records: set "
                             "self.exact = settings.exact_gradients(self.net) in the LightningModule, or pass "
                             "CDGraBCallback(exact=...)")
        if not is_exact:
            raise ValueError("CDGraBCallback: exact CD-GraB needs a sampler built with exact=True: build it with "
                             "CDGraBSettings(exact_low_memory=True).sampler(...)")
        if sampler.d != exact.d:
            raise ValueError(f"CDGraBCallback: the sampler balances d={sampler.d}, the ExactGradients give "
                             f"d={exact.d}: build the sampler with d=exact.d")

    # ------------------------------------------------------------------ per batch

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Lightning's hook: steps the sampler with the batch's per-example gradients, or starts the recording
        of the training step's forward (sketcher, exact), whose sampler step comes after its backward.

        Args:
            trainer: the Lightning Trainer.
            pl_module: the LightningModule; its per_example_grads(batch) gives the (B, d) gradients unless
                grads_fn, a sketcher or exact is set.
            batch: the training batch, of the B = sampler.loader_batch_size examples the sampler yielded.
            batch_idx: the batch's index in the epoch.
        """
        sampler = self._sampler
        if not sampler.uses_grads:
            sampler.step(None)
            return
        if self._backward is not None:  # MB-GraB: the sampler steps after the backward (on_after_backward)
            return
        recorder = self.sketcher if self.sketcher is not None else self.exact
        if recorder is not None:  # the step's forward is recorded; the sampler steps after its backward
            self._recording = recorder.recording().__enter__()
            # nn.Module.__setattr__ is annotated for tensors and modules only; it sets any attribute
            pl_module.cdgrab_recording = self._recording  # type: ignore[assignment]
            return
        # nn.Module.__getattr__ is annotated as giving a Tensor or Module; this is the user's method
        grads = self.grads_fn(pl_module, batch) if self.grads_fn else pl_module.per_example_grads(batch)  # type: ignore[operator]
        sampler.step(grads)  # balancing sorters all-gather here: every rank calls it at the same batch

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        """Lightning's hook (after zero_grad, right before the backward): MB-GraB notes what .grad holds."""
        if self._backward is not None:
            self._backward.start()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Lightning's hook: with a recording (sketcher, exact), ends it and steps the sampler with its sketches
        or layer records.

        Raises:
            ValueError: the step's loss was not built from the losses handed to watch() (one line).
        """
        if self._backward is not None:  # (1, d): the batch's gradient, as the backward added it to .grad
            self._sampler.step(self._backward.delta()[None])
            return
        recording, self._recording = self._recording, None
        if recording is None:
            return
        recording.__exit__(None, None, None)
        pl_module.cdgrab_recording = None  # type: ignore[assignment]  # see on_train_batch_start
        try:
            if isinstance(recording, ExactRecording):  # .grad is this backward's alone when it was None at watch()
                self._sampler.step_units(recording.units(from_grad=True))  # all-gathered under DDP
                return
            sketches = recording.sketches()
        except ValueError as error:
            if "no gradient reached" not in str(error):
                raise
            raise ValueError("CDGraBCallback: the training step's loss is not built from watched per-example "
                             "losses: in training_step, losses = watch(self, per_example_losses) and return a "
                             "loss made of them (e.g. losses.mean())") from None
        self._sampler.step(sketches.float())  # all-gathered: every rank calls it at the same batch

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The callback's state in Lightning's checkpoint.

        Returns:
            The sampler's state_dict() under "sampler", the sketcher's map under "sketch_map" (None without
            one) and the state's format under "format_version"; before the sampler is found, the state
            loaded and waiting for it, if any.
        """
        if self.sampler is None:  # nothing to save yet, or the loaded state still waiting for the sampler
            return {FORMAT_KEY: LIGHTNING_STATE_FORMAT} if self._pending_state is None else self._pending_state
        # on a sharded model the rows go into the distributed checkpoint (on_save_checkpoint), not d numbers here
        sampler = {"sharded": _SHARDED_KEY} if self._saves_rows else self.sampler.state_dict()
        return {"sampler": sampler, "sketch_map": self._sketch_map(),
                FORMAT_KEY: LIGHTNING_STATE_FORMAT}  # the format: sorters/_state_format.py

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Lightning's hook (every process): exact CD-GraB on a sharded model under ModelParallelStrategy's
        distributed checkpoint puts this process's rows of the running sum into the checkpoint's model state,
        which the strategy saves with torch.distributed.checkpoint (sorters.fsdp.sharded_state_dict), so that no
        process holds d numbers."""
        if self._saves_rows and self.exact is not None:
            from sorters.fsdp import sharded_state_dict
            checkpoint["state_dict"][_SHARDED_KEY] = sharded_state_dict(self._sampler, self.exact)

    def _sketch_map(self) -> dict[str, object] | None:
        """The sketcher's map (None without one): what the sampler's sketch_dim and seed do not say."""
        if self.sketcher is None:
            return None
        sketch = self.sketcher.sketch
        return {"d": sketch.d, "dim": sketch.dim, "seed": sketch.seed,
                "blocks": [[block.offset, block.rows, block.cols] for block in sketch.blocks]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the sampler from a state that state_dict() returned (kept until on_fit_start finds the
        sampler, when it comes first).

        Args:
            state_dict: the callback's state from Lightning's checkpoint.

        Raises:
            ValueError: a state of a newer format; a state saved with another sketch map; a state saved part-way
                through an epoch for a sampler that is not a LightningCDGraBSampler (each one line).
        """
        # format 0 (no format key) holds format 1's keys; a newer format is refused at once, not at fit start
        saved_format("CDGraBCallback.load_state_dict", state_dict, LIGHTNING_STATE_FORMAT)
        if "sampler" not in state_dict:
            return
        if self.sampler is None:  # Lightning restores callbacks before on_fit_start: keep it until then
            self._pending_state = state_dict
            return
        self._pending_state = None
        saved_map, map_now = state_dict.get("sketch_map"), self._sketch_map()
        if saved_map != map_now:
            raise ValueError(f"CDGraBCallback: the checkpoint's sampler balanced the sketches of map {saved_map}, "
                             f"this run's is {map_now}: resume with the same sketcher (LayerSketch dim, seed, "
                             "params, min_numel) or none, as the checkpoint's run")
        state = state_dict["sampler"]
        if "sharded" in state:  # the running sum's rows, in the distributed checkpoint being resumed
            self._load_rows(state["sharded"])
            state = {"started": self.sampler.started, "position": self.sampler.position}
        if state["started"] and 0 < state["position"] < self.sampler.m and not isinstance(self.sampler,
                                                                                     LightningCDGraBSampler):
            raise ValueError("CDGraBCallback: the checkpoint was saved part-way through an epoch, which Lightning "
                             "resumes by counting batches itself: build the sampler as "
                             "sorters.lightning.LightningCDGraBSampler (same arguments)")
        if "sharded" not in state_dict["sampler"]:
            self.sampler.load_state_dict(state)  # mid-epoch: its next iteration is the rest of that epoch

    def _load_rows(self, key: str) -> None:
        """The sampler's state from the distributed checkpoint Lightning resumes (trainer.ckpt_path), each
        process reading its rows of the running sum (sorters.fsdp.load_sharded_state_dict)."""
        path = getattr(self._trainer, "ckpt_path", None)
        if self.exact is None or path is None or not self._saves_rows:
            raise ValueError("CDGraBCallback: the checkpoint holds the sampler's running sum sharded, as exact CD-GraB "
                             "on a model sharded with fully_shard under ModelParallelStrategy saves it; resume that "
                             "way (exact_low_memory, the same strategy)")
        from sorters.fsdp import load_sharded_state_dict
        load_sharded_state_dict(self._sampler, self.exact, checkpoint_id=path, key=f"state_dict.{key}")


def _is_fsdp1(trainer: Trainer) -> bool:
    """Whether the Trainer's strategy is Lightning's FSDPStrategy (FSDP1's FullyShardedDataParallel wrapper)."""
    from lightning.pytorch.strategies import FSDPStrategy
    return isinstance(getattr(trainer, "strategy", None), FSDPStrategy)


def _has_dtensors(module: torch.nn.Module) -> bool:
    """Whether fully_shard (FSDP2) made the module's parameters DTensors (False for an object without
    parameters())."""
    if not torch.distributed.is_available() or not callable(getattr(module, "parameters", None)):
        return False
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in module.parameters())


def watch(pl_module: LightningModule, losses: torch.Tensor) -> torch.Tensor:
    """Hands a training step's per-example losses to the batch's recording.

    For a LightningModule's training_step under CDGraBCallback(sketcher=...) or (exact=...). Does nothing
    outside a recorded batch (validation, or a callback without a sketcher).

    Args:
        pl_module: the LightningModule (its training_step's `self`).
        losses: (B,) per-example losses, still attached to the graph; the step's loss must be built from them.

    Returns:
        `losses`, unchanged.

    Example:
        In training_step: ``losses = watch(self, F.cross_entropy(self.net(x), y, reduction="none"))``, then
        ``return losses.mean()``.
    """
    recording = getattr(pl_module, "cdgrab_recording", None)
    if recording is not None:
        recording.watch(losses)
    return losses
