r"""CDGraBSettings: what a framework's glue needs to know to order examples, one typed object for all of them.

    from sorters import CDGraBSettings
    settings = CDGraBSettings(sorter="CD-GraB", grad_params=r"^head\.", sketch_dim=256, structured=True)
    trainer = CDGraBTrainer(model=model, args=args, train_dataset=train_set, cdgrab=settings)   # sorters/hf.py
    callback = CDGraBCallback(settings=settings)                                               # sorters/lightning.py
    grads_of = settings.gradients(model, loss_fn)              # your own loop, Accelerate: PerExampleGrads
    sampler = settings.sampler(train_set, batch_size=16, d=grads_of.d, drop_last=True, view="global")

The fields are checked once, when the object is made (one line per bad value: TypeError for a wrong
type, ValueError for a bad value), so a script can build its settings from its flags before it loads any
data and refuse bad ones at once. Frozen: a run's settings do not change under it.
"""
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import torch

from sorters.checks import check_int, check_seed
from sorters.exact import ExactGradients
from sorters.layer_rules import Layout
from sorters.layer_sketch import LayerSketch, selected_parameters
from sorters.per_example import PerExampleGrads, PerExampleLossGrads
from sorters.registry import SORTERS
from sorters.sampler import CDGraBSampler
from sorters.thresholds import STRUCTURED_MIN_NUMEL, check_min_numel


@dataclass(frozen=True)
class CDGraBSettings:
    """How the glue orders examples and forms what the sorter balances.

    Args:
        sorter: one of sorters.SORTER_NAMES.
        seed: seeds the sorter and the sketch, the same in every process; None: the framework's own
            (the HF Trainer's args.seed), else 0.
        grad_params: which parameters' per-example gradients are balanced: None (every trainable one), a
            regular expression or a sequence of them, matched with re.search against
            named_parameters() names. Fewer coordinates cost less.
        grad_chunk_size: examples per torch.func call (None: the whole batch); bounds memory.
        sketch_dim: 0: balance the (B, d) gradients; D > 0: their (B, D) sketches (docs/sketching.md).
        structured: with sketch_dim > 0 and a sorter that balances gradients: build the sketches layer by
            layer from one batched backward (LayerSketch), never forming per example the
            Linear / Conv1D / Embedding weights of at least min_numel entries.
        min_numel: with structured: that threshold (>= 1; default the library's row of
            sorters/thresholds.py, which says why it differs from the engine's).
        num_replicas: replicas the data is split over; None: the number of processes.
        exact_low_memory: True (CD-GraB only, sketch_dim 0): balance the exact gradients without forming them
            whole: their products come layer by layer from the training step's own forward and
            backward (sorters/exact.py; docs/exact-cdgrab.md). The HF Trainer, Lightning's
            CDGraBCallback and your own loop (sampler(...) builds CDGraBSampler(exact=True), fed by
            step_units; under torch.distributed it all-gathers the layer records). False: form the
            per-example gradients (torch.func). None (the default, "auto"): the HF Trainer takes
            True where it gives CD-GraB's orders of the model's own loss (`exact_applies` and a
            causal LM's loss, see CDGraBTrainerMixin), else False; elsewhere (Lightning, your own
            loop, whose code picks the path) None is False.
            """
    sorter: str = "CD-GraB"
    seed: int | None = None
    grad_params: str | tuple[str, ...] | None = None
    grad_chunk_size: int | None = None
    sketch_dim: int = 0
    structured: bool = False
    min_numel: int = STRUCTURED_MIN_NUMEL
    num_replicas: int | None = None
    exact_low_memory: bool | None = None

    def __post_init__(self) -> None:
        owner = "CDGraBSettings"
        if not isinstance(self.sorter, str) or self.sorter not in SORTERS:
            raise ValueError(f"{owner}: unknown sorter {self.sorter!r}; choose one of {', '.join(SORTERS)}")
        if self.seed is not None:
            check_seed(owner, self.seed)
        params = self.grad_params
        if not (params is None or isinstance(params, str) or isinstance(params, Sequence)
                and params and all(isinstance(p, str) for p in params)):
            raise TypeError(f"{owner}: grad_params must be None, a regular expression or a list of them, "
                            f"got {params!r}")
        if params is not None and not isinstance(params, str):
            object.__setattr__(self, "grad_params", tuple(params))  # frozen, and comparable with a saved one
        check_int(owner, "grad_chunk_size", self.grad_chunk_size, 1, none_ok=True)
        check_int(owner, "sketch_dim", self.sketch_dim, 0)
        if not isinstance(self.structured, bool):
            raise TypeError(f"{owner}: structured must be True or False, got {self.structured!r}")
        check_min_numel(owner, self.min_numel)
        check_int(owner, "num_replicas", self.num_replicas, 1, none_ok=True)
        if self.structured and not (self.sketch_dim > 0 and self.uses_grads):
            raise ValueError(f"{owner}: structured=True builds sketches of the gradients a sorter balances: it needs "
                             f"sketch_dim > 0 and a balancing sorter, got sketch_dim={self.sketch_dim}, "
                             f"sorter={self.sorter}")
        if self.exact_low_memory is not None and not isinstance(self.exact_low_memory, bool):
            raise TypeError(f"{owner}: exact_low_memory must be None (auto), True or False, "
                            f"got {self.exact_low_memory!r}")
        if self.exact_low_memory and (self.sorter != "CD-GraB" or self.sketch_dim or self.structured):
            raise ValueError(f"{owner}: exact_low_memory=True balances CD-GraB's exact gradients: it needs "
                             f"sorter='CD-GraB', sketch_dim=0 and structured=False, got sorter={self.sorter}, "
                             f"sketch_dim={self.sketch_dim}, structured={self.structured}")

    @property
    def uses_grads(self) -> bool:
        """Whether the sorter balances gradients (False for D-RR, D-SO, Fold, FlipFlop and SWR, for which none are
        formed)."""
        return SORTERS[self.sorter].uses_grads

    def exact_applies(self, model: torch.nn.Module) -> bool:
        """Whether exact_low_memory can balance `model` with these settings.

        It can with CD-GraB, no sketch, and every selected parameter in a layer with a rule
        (sorters/layer_rules.py: Linear, Conv1D, Embedding, LayerNorm). Whether the loss is one the glue's
        records compute as the model does is the glue's to check (the HF Trainer: a causal LM's own loss).

        Args:
            model: the model to train (a DistributedDataParallel wrapper is unwrapped).

        Returns:
            True where the exact path applies, else False.

        Raises:
            ValueError: grad_params selects no parameter of `model` (one line).
        """
        if self.sorter != "CD-GraB" or self.sketch_dim or self.structured:
            return False
        model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        return not Layout(model, selected_parameters(model, self.grad_params, "CDGraBSettings")).formed

    @property
    def resolved_seed(self) -> int:
        """`seed`, or 0 when None (a framework with its own seed passes that instead)."""
        return 0 if self.seed is None else self.seed

    def gradients(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor]) -> PerExampleGrads:
        """The per-example gradients these settings balance, for (inputs, targets) batches.

        Building it computes nothing; call it only when `uses_grads`.

        Args:
            model: the model to train.
            loss_fn: loss_fn(outputs, targets) -> the scalar mean loss of a batch (see PerExampleGrads).

        Returns:
            A PerExampleGrads whose call gives (B, d) gradients, (B, sketch_dim) sketches, or with
            structured the layer-by-layer sketches.
        """
        return PerExampleGrads(model, loss_fn, params=self.grad_params, chunk_size=self.grad_chunk_size,
                               sketch_dim=self.sketch_dim, sketch_seed=self.resolved_seed,
                               structured=self.structured, min_numel=self.min_numel)

    def loss_gradients(self, model: torch.nn.Module) -> PerExampleLossGrads:
        """As gradients(), of the model's own loss on dict batches.

        For transformers models; not structured: the HF glue builds those sketches from the Trainer's own
        backward.

        Args:
            model: a model that computes its own loss from a dict batch holding "labels".

        Returns:
            A PerExampleLossGrads whose call gives (B, d) gradients or (B, sketch_dim) sketches.
        """
        return PerExampleLossGrads(model, params=self.grad_params, chunk_size=self.grad_chunk_size,
                                   sketch_dim=self.sketch_dim, sketch_seed=self.resolved_seed)

    def layer_sketch(self, model: torch.nn.Module) -> LayerSketch:
        """The LayerSketch of `model` with these settings (sketch_dim, seed, grad_params, min_numel).

        For glue that records the training step's own backward (Lightning's CDGraBCallback).

        Args:
            model: the model to train.

        Returns:
            The LayerSketch, whose sketches are (B, sketch_dim).

        Raises:
            ValueError: structured is False (one line).
        """
        if not self.structured:
            raise ValueError("CDGraBSettings: layer_sketch() builds structured sketches: set structured=True")
        return LayerSketch(model, self.sketch_dim, self.resolved_seed, params=self.grad_params,
                           min_numel=self.min_numel)

    def exact_gradients(self, model: torch.nn.Module) -> ExactGradients:
        """For exact_low_memory: the ExactGradients of `model` (sorters/exact.py) for these grad_params.

        Args:
            model: the model to train.

        Returns:
            The ExactGradients; its `d` is the sampler's d.
        """
        return ExactGradients(model, params=self.grad_params)

    def sampler(self, dataset: Sized | int, batch_size: int, d: int | None,
                cls: type[CDGraBSampler] = CDGraBSampler, **kwargs: Any) -> CDGraBSampler:
        """A CDGraBSampler with these settings' sorter, seed, sketch_dim and num_replicas.

        Args:
            dataset: the training set (only its length is read), or that length.
            batch_size: examples per batch and replica.
            d: the gradients' length (the `d` of gradients(), or of exact_gradients() with
                exact_low_memory); ignored for sorters that balance none.
            cls: CDGraBSampler or a subclass of it (e.g. sorters.lightning.LightningCDGraBSampler).
            **kwargs: the sampler's other arguments (drop_last, epochs, view, rank, ...).

        Returns:
            The sampler, an instance of `cls`.

        Raises:
            TypeError: the sampler refuses an argument of the wrong type (one line).
            ValueError: the sampler refuses an argument's value (one line).
        """
        if self.exact_low_memory:  # an ExactCDGraB, stepped with step_units (d: exact_gradients(model).d)
            kwargs = {"exact": True, **kwargs}
        return cls(dataset, batch_size=batch_size, d=d if self.uses_grads else None, sorter=self.sorter,
                   num_replicas=self.num_replicas, seed=self.resolved_seed, sketch_dim=self.sketch_dim, **kwargs)
