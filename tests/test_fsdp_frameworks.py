"""The frameworks' glue on a model sharded with FSDP2 (issue #61 goal 3; docs/fsdp.md, docs/frameworks.md).

- Lightning's ModelParallelStrategy (FSDP2: fully_shard in configure_model) runs on the CPU with gloo: 2 forked
  processes train MLP-M4's small model of tests/test_fsdp.py with CDGraBCallback (exact CD-GraB from layer
  records), against the same oracle as the own loop there: one unsharded process hosting both replicas, with
  sorters.CDGraB fed float64 per-example gradients from one backward per example. The orders are equal bit for
  bit, losses and parameters within float32 rounding, and each process keeps the running sum of its own rows.
- The HF Trainer: Accelerate 1.15 takes its FSDP plugin on GPUs only. On gloo CPU processes it keeps
  MULTI_CPU, drops the plugin without a message, and the Trainer trains with DDP. The test sets the state the
  plugin gives on a GPU (FSDPOnCPU, after the Trainer built its Accelerator); from there the Trainer's and
  Accelerate's own code shard the model (fsdp2_prepare_model: fully_shard of the GPT2Block and the root),
  train it and write a sharded checkpoint. Its orders are those of one process hosting both replicas with the
  formed per-example gradients and sorters.CDGraB (tests/test_hf_trainer.py checks that trainer against
  ordinary backward passes).
- What each framework refuses, in its own words and in ours.
"""
import logging
import os
import socket

import pytest
import torch

from tests.helpers import REPO, release_check, run_forked
from tests.test_fsdp import EPOCHS, LR, SEED, K, MLPCase, one_process
from tests.test_fsdp_sketch import DIMS, MIN_NUMEL, SKETCH_SEED
from tests.test_fsdp_sketch import one_process as sketched_one_process


def free_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def torchrun_environment(rank: int, port: int) -> None:
    """What torchrun sets for one of 2 processes on one node (Lightning and Accelerate read it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", NODE_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)


# ---------------------------------------------------------------------------------- Lightning: ModelParallelStrategy


def lightning_module(settings):
    """A LightningModule training MLPCase's model on its data (SGD, LR), fully_shard-ed layer by layer and at
    the root in configure_model. With settings.exact_low_memory exact CD-GraB's records (self.exact, built in
    setup()); else the structured sketches of tests/test_fsdp_sketch.py's map (self.sketcher, built in
    __init__), balanced by CD-GraB with the SEED of tests/test_fsdp.py. Both are built before the sharding,
    which the callback catches up with. Records every epoch's orders and every step's losses."""
    import lightning.pytorch as L
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    from sorters import LayerSketch
    from sorters.lightning import LightningCDGraBSampler, watch

    class ShardedMLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = MLPCase.model()
            self.train_set = TensorDataset(*MLPCase.data())
            self.orders, self.losses = [], []
            if not settings.exact_low_memory:
                self.sketcher = LayerSketch(self.net, DIMS["mlp"], seed=SKETCH_SEED, min_numel=MIN_NUMEL)

        def setup(self, stage):
            if settings.exact_low_memory:
                self.exact = settings.exact_gradients(self.net)
                self.sampler = settings.sampler(self.train_set, batch_size=K, d=self.exact.d,
                                                cls=LightningCDGraBSampler)
            else:
                self.sampler = LightningCDGraBSampler(self.train_set, batch_size=K, d=self.sketcher.d, seed=SEED,
                                                      sketch_dim=self.sketcher.dim)

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for block in MLPCase.blocks(self.net):
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def train_dataloader(self):
            return DataLoader(self.train_set, batch_size=self.sampler.loader_batch_size, sampler=self.sampler)

        def training_step(self, batch, batch_idx):
            x, y = batch
            losses = watch(self, MLPCase.losses(self.net, x, y))  # (K,) this process's replica
            self.losses.append(losses.detach())
            return losses.mean()

        def on_train_epoch_end(self):
            self.orders.append(self.sampler.all_indices())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return ShardedMLP()


def lightning_rank(rank, port, path, how):
    """One of 2 forked processes: Lightning's ModelParallelStrategy over gloo (it reads the torchrun variables)
    with CDGraBCallback, balancing exact CD-GraB ("exact") or the structured sketches ("sketch"); orders,
    losses, whole final parameters and the sampler's share saved to path.rankR. With "exact" also a checkpoint
    after step 3 (mid-epoch 1: Lightning's distributed checkpoint), and a second run resumed from it."""
    torchrun_environment(rank, port)
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from sorters import CDGraBSettings
    from sorters.lightning import CDGraBCallback
    settings = CDGraBSettings(sorter="CD-GraB", seed=SEED, exact_low_memory=how == "exact")
    try:
        module = lightning_module(settings)
        # the sketch's seed is not the sampler's: the callback takes the sketcher without settings
        callback = CDGraBCallback(settings=settings) if how == "exact" else CDGraBCallback(sketcher=module.sketcher)

        def trainer(*callbacks):
            return L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=2, use_distributed_sampler=False,
                             strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                             callbacks=list(callbacks), logger=False, enable_checkpointing=len(callbacks) > 1,
                             enable_progress_bar=False, enable_model_summary=False)
        saver = L.callbacks.ModelCheckpoint(dirpath=f"{path}-checkpoints", every_n_train_steps=3, save_top_k=-1,
                                            filename="mid-{step}")
        trainer(callback, *([saver] if how == "exact" else [])).fit(module)
        resumed = lightning_module(settings)
        if how == "exact":
            trainer(CDGraBCallback(settings=settings)).fit(resumed, ckpt_path=f"{path}-checkpoints/mid-step=3.ckpt")
        sorter, recorder = module.sampler.sorter, module.exact if how == "exact" else module.sketcher
        selected = dict(module.net.named_parameters())
        offsets = recorder.offsets if how == "exact" else recorder.layout.offsets  # by id(parameter)
        torch.save({"orders": module.orders, "losses": module.losses, "resumed": (resumed.orders, resumed.losses),
                    "params": [p.full_tensor() for p in module.net.parameters()],
                    "share": type(getattr(sorter, "share", None)).__name__, "sum_numel": sorter.running_sum.numel(),
                    "d": recorder.d, "recorded": [type(selected[name]).__name__ for name in recorder.names],
                    # the records' parameters are the sharded ones (no unsharded copy kept alive)
                    "current": all(id(selected[name]) in offsets for name in recorder.names),
                    "callback's": recorder is (callback.exact if how == "exact" else callback.sketcher)},
                   f"{path}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module", params=["exact", "sketch"])
def lightning_ranks(request, tmp_path_factory):
    pytest.importorskip("lightning")
    pytest.importorskip("torch.distributed.fsdp")
    path = tmp_path_factory.mktemp("lightning-fsdp") / "run"
    run_forked(lightning_rank, (free_port(), path, request.param), 2)
    return request.param, [torch.load(f"{path}.rank{r}") for r in range(2)], path


def test_lightning_model_parallel_gives_the_unsharded_orders_bit_for_bit(lightning_ranks):
    """Both processes' orders of every epoch equal one unsharded process's, bit for bit: exact CD-GraB against
    CDGraB on float64 per-example gradients (the own loop's oracle, tests/test_fsdp.py), the structured sketch
    against CDGraB on those gradients times the map as a dense matrix (tests/test_fsdp_sketch.py's); each
    replica's losses and the final parameters within float32 rounding. The callback rebuilt the ExactGradients
    (LayerSketch) over the sharded parameters (DTensors); exact CD-GraB's running sum holds this process's rows
    only (ShardedRows, about d / 2)."""
    how, lightning_ranks, path = lightning_ranks
    if how == "exact":
        orders, losses, params, _, _ = one_process(MLPCase)
    else:
        orders, losses, _, _, params = sketched_one_process("mlp")
    assert not torch.equal(orders[1], orders[2])  # the orders follow the gradients
    for rank, got in enumerate(lightning_ranks):
        assert len(got["orders"]) == EPOCHS
        for epoch, (mine, theirs) in enumerate(zip(got["orders"], orders)):
            assert torch.equal(mine, theirs), f"rank {rank} epoch {epoch}"
        torch.testing.assert_close(torch.cat(got["losses"]), torch.cat(losses[rank]), rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(got["params"], params):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        assert got["current"] and got["callback's"] and set(got["recorded"]) == {"DTensor"}
    if how == "sketch":
        assert lightning_ranks[0]["sum_numel"] == DIMS["mlp"]  # the sketches' running sum, (D,)
        return
    # the checkpoint: the callback's state names its rows, which the distributed checkpoint holds per parameter
    checkpoint = path.parent / f"{path.name}-checkpoints" / "mid-step=3.ckpt"
    states = [state for key, state in torch.load(checkpoint / "meta.pt", weights_only=False)["callbacks"].items()
              if key.startswith("CDGraBCallback")]
    assert len(states) == 1 and states[0]["sampler"] == {"sharded": "cdgrab_sampler"}
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    sums = [meta.size.numel() for key, meta in saved.items()
            if key.startswith("state_dict.cdgrab_sampler.running_sum.")]
    assert sum(sums) == lightning_ranks[0]["d"] and len(sums) == 6
    for got in lightning_ranks:  # resumed after step 3: epochs 1 and 2's orders, steps 4 to 6's losses, bit for bit
        resumed_orders, resumed_losses = got["resumed"]
        assert len(resumed_orders) == 2 and all(map(torch.equal, resumed_orders, got["orders"][1:]))
        assert len(resumed_losses) == 3 and all(map(torch.equal, resumed_losses, got["losses"][3:]))
    assert all(got["share"] == "ShardedRows" for got in lightning_ranks)
    sizes = [got["sum_numel"] for got in lightning_ranks]
    assert sum(sizes) == lightning_ranks[0]["d"] and min(sizes) > 0.3 * lightning_ranks[0]["d"]


def test_lightning_refuses_fsdp1_and_the_paths_that_need_whole_parameters(monkeypatch):
    """Lightning's own FSDPStrategy (FSDP1) needs CUDA: its message, quoted in docs/frameworks.md. Past it (the
    callback's hook called as Lightning would), the callback refuses FSDP1 and, on a sharded model, a balancing
    sorter without layer records, each in one line."""
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.strategies import FSDPStrategy

    import sorters.lightning as glue
    from sorters import CDGraBSampler
    with pytest.raises(ValueError) as refused:
        L.Trainer(strategy="fsdp", accelerator="cpu", devices=1)
    assert " ".join(str(refused.value).split()) in " ".join((REPO / "docs" / "frameworks.md").read_text().split())

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3, 1)
            self.sampler = CDGraBSampler(8, batch_size=2, d=4, num_replicas=1)

    class Trainer:
        strategy, world_size, datamodule = FSDPStrategy(), 1, None

    with pytest.raises(ValueError, match="FSDP1, whose flat parameters"):
        glue.CDGraBCallback().on_fit_start(Trainer(), Module())
    Trainer.strategy = None
    monkeypatch.setattr(glue, "_has_dtensors", lambda module: True)  # as after fully_shard
    with pytest.raises(ValueError, match=r"sharded \(fully_shard\).*exact_low_memory=True"):
        glue.CDGraBCallback().on_fit_start(Trainer(), Module())


# ---------------------------------------------------------------------------------- HF Trainer: Accelerate's FSDP2


FSDP_CONFIG = {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"], "state_dict_type": "SHARDED_STATE_DICT"}


def fsdp_on_cpu(cls, plugin_args=None):
    """`cls` with the Accelerator state that Accelerate's FSDP plugin gives on a GPU (distributed type FSDP, the
    plugin kept): on gloo CPU processes Accelerate 1.15 keeps MULTI_CPU and drops the plugin (accelerate/state.py
    enters FSDP for GPU-like distributed types only). Everything after the state is the frameworks' own code.
    plugin_args: the plugin's arguments, default those TrainingArguments' fsdp_config gives."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class FSDPOnCPU(cls):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            # the plugin dropped (or, for a second Trainer in the process, the state set for the first)
            assert state.distributed_type in (DistributedType.MULTI_CPU, DistributedType.NO, DistributedType.FSDP)
            self.cpu_state = state.distributed_type, getattr(state, "fsdp_plugin", None)  # shared by every Trainer
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**(plugin_args or self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True

    return FSDPOnCPU


def recorded(cls):
    """`cls` recording each micro-batch's example indices (rows of hf_trainer_tiny.token_rows()) and loss."""
    import tests.hf_trainer_tiny as hf

    class Recorded(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.index_of = {tuple(r.tolist()): i for i, r in enumerate(hf.token_rows())}
            self.batches, self.losses = [], []

        def training_step(self, model, inputs, *args, **kwargs):
            self.batches.append([self.index_of[tuple(r.tolist())] for r in inputs["input_ids"]])
            loss = super().training_step(model, inputs, *args, **kwargs)
            self.losses.append(loss.item())
            return loss

    return Recorded


# exact CD-GraB (the default for a causal LM); the structured sketch, every weight of 256 entries or more a block
HF_SETTINGS = {"exact": {}, "sketch": {"sketch_dim": 32, "structured": True, "min_numel": 256}}


def hf_rank(rank, port, out, how):
    """One of 2 forked processes: CDGraBTrainer (CD-GraB with HF_SETTINGS[how]) under Accelerate's FSDP2 over
    gloo, a checkpoint every 4 optimizer steps; micro-batches, losses, whole final parameters and the sampler's
    share saved to out.rankR. With "exact", also: first, without the GPU state, what Accelerate does with
    `fsdp` on the CPU and CDGraBTrainer's warning; last, a second Trainer resumed from checkpoint-4 (mid-epoch:
    the Trainer's sharded model and optimizer, the sampler's state), its micro-batches and losses."""
    torchrun_environment(rank, port)
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)  # the parent's one-process state, forked
    import tests.hf_trainer_tiny as hf
    from sorters import CDGraBSettings
    try:
        args = hf.training_args(out, ddp_backend="gloo", fsdp=True, fsdp_config=dict(FSDP_CONFIG),
                                save_strategy="steps", save_steps=4)
        warned, on_cpu = [], None
        if how == "exact":
            on_cpu = hf.CDGraBTrainer(model=hf.tiny_gpt2(), args=args, train_dataset=hf.examples(hf.token_rows()))
            handler = logging.Handler()
            handler.emit = lambda record: warned.append(record.getMessage())
            logging.getLogger("sorters.hf").addHandler(handler)
            on_cpu.check_settings()
            logging.getLogger("sorters.hf").removeHandler(handler)
        trainer = fsdp_on_cpu(recorded(hf.CDGraBTrainer))(model=hf.tiny_gpt2(), args=args,
                                                          cdgrab=CDGraBSettings(**HF_SETTINGS[how]),
                                                          train_dataset=hf.examples(hf.token_rows()))
        trainer.train()
        resumed = fsdp_on_cpu(recorded(hf.CDGraBTrainer))(model=hf.tiny_gpt2(), args=args,
                                                          cdgrab=CDGraBSettings(**HF_SETTINGS[how]),
                                                          train_dataset=hf.examples(hf.token_rows()))
        if how == "exact":
            resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
        sorter, records = trainer.cdgrab_sampler.sorter, trainer.cdgrab_grads
        selected = dict(trainer.model.named_parameters())
        offsets = records.offsets if how == "exact" else records.layout.offsets  # by id(parameter)
        torch.save({"batches": trainer.batches, "losses": trainer.losses,
                    "params": {n: p.full_tensor() for n, p in selected.items()},
                    "share": type(getattr(sorter, "share", None)).__name__, "sum_numel": sorter.running_sum.numel(),
                    "d": records.d, "exact": trainer.cdgrab_settings.exact_low_memory,
                    "resumed": (resumed.batches, resumed.losses),
                    "on_cpu": (on_cpu is not None and on_cpu.is_fsdp_enabled, warned),
                    "recorded": [type(selected[name]).__name__ for name in records.names],
                    # the records' parameters are the sharded ones (no unsharded copy kept alive)
                    "current": all(id(selected[name]) in offsets for name in records.names)}, f"{out}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import tests.hf_trainer_tiny as tiny
    return tiny


# the structured sketch (about 30 s more on this 2-core CPU): a release check (scripts/release_checks.py)
@pytest.mark.parametrize("how", ["exact", pytest.param("sketch", marks=release_check)])
def test_hf_trainer_under_accelerates_fsdp2_gives_one_process_orders(hf, tmp_path, how):
    """CDGraBTrainer under Accelerate's FSDP2 plugin (2 forked gloo processes, each one replica): each rank uses
    its replica's half of every micro-batch of one unsharded process hosting both replicas (so the same orders,
    bit for bit), balanced by sorters.CDGraB from the formed per-example gradients ("exact"), or from the
    unsharded structured sketches of the same map ("sketch"; tests/test_hf_trainer.py checks them against the
    map of each example's gradient). The ranks' losses average to its losses and both end with its
    parameters, within float32 rounding. The model was sharded (DTensors), the records taken from the sharded
    parameters, and exact CD-GraB's running sum holds each process's rows only."""
    from sorters import CDGraBSettings
    oracle = {"exact_low_memory": False} if how == "exact" else HF_SETTINGS[how]
    one = recorded(hf.CDGraBTrainer)(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path / "one"),
                                     train_dataset=hf.examples(hf.token_rows()),
                                     cdgrab=CDGraBSettings(num_replicas=hf.REPLICAS, **oracle))
    one.train()
    run_forked(hf_rank, (free_port(), tmp_path / "fsdp", how), 2)
    runs = [torch.load(tmp_path / f"fsdp.rank{r}") for r in range(2)]
    for r, run in enumerate(runs):
        assert run["batches"] == [b[r * hf.BATCH:(r + 1) * hf.BATCH] for b in one.batches], f"rank {r}"
        assert run["current"] and set(run["recorded"]) == {"DTensor"}
    assert not all(a == b for a, b in zip(runs[0]["losses"], runs[1]["losses"]))  # each rank's own examples
    averaged = [(a + b) / 2 for a, b in zip(runs[0]["losses"], runs[1]["losses"])]
    assert averaged == pytest.approx(one.losses, rel=1e-5)
    for name, p in one.model.named_parameters():  # atol: Adam scales a zero-up-to-rounding gradient up to ~lr
        torch.testing.assert_close(runs[0]["params"][name], p.detach(), rtol=1e-4, atol=1e-4)
    if how == "sketch":
        assert runs[0]["exact"] is False and runs[0]["sum_numel"] == HF_SETTINGS[how]["sketch_dim"]
        return
    assert all(run["exact"] is True and run["share"] == "ShardedRows" for run in runs)
    sizes = [run["sum_numel"] for run in runs]
    assert sum(sizes) == runs[0]["d"] and min(sizes) > 0.3 * runs[0]["d"]
    for run in runs:  # without the GPU state: unsharded (Accelerate's choice), and the glue says so in one warning
        enabled, warned = run["on_cpu"]
        assert not enabled and len(warned) == 1 and "did not enable FSDP" in warned[0]
    # optimizer step 4 (epoch 1's first): the sampler's state in a torch.distributed.checkpoint folder, the
    # running sum's rows per parameter (no tensor of d entries), which SAMPLER_FILE names
    checkpoint = tmp_path / "fsdp" / "checkpoint-4"
    folder = torch.load(checkpoint / hf.SAMPLER_FILE)["sampler"]["sharded"]
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(checkpoint / folder).read_metadata().state_dict_metadata
    sums = {key: value.size for key, value in saved.items() if key.startswith("sampler.running_sum.")}
    assert sum(size.numel() for size in sums.values()) == runs[0]["d"] and len(sums) > 1
    for run in runs:  # resumed there: the uninterrupted run's last 10 micro-batches and losses, bit for bit
        batches, losses = run["resumed"]
        assert len(batches) == 10 and batches == run["batches"][-10:] and losses == run["losses"][-10:]


@pytest.mark.parametrize("settings, message", [
    ({"version": 1}, r"FSDP1 flattens the parameters.*\{'version': 2\}"),
    ({"version": 2, "exact_low_memory": False}, "what layer records give"),
    ({"version": 2, "sketch_dim": 8}, "what layer records give"),
    ({"version": 2, "activation_checkpointing": True}, "activation checkpointing runs the layers. forward again"),
])
def test_hf_trainer_under_fsdp_refuses_what_needs_whole_parameters(hf, tmp_path, settings, message):
    """FSDP1, FSDP's activation checkpointing, and a balancing sorter on formed gradients or unstructured
    sketches, are refused in one line when train() starts, before any step (in one process: the check needs no
    process group)."""
    from sorters import CDGraBSettings
    settings = dict(settings)
    plugin = {"fsdp_version": settings.pop("version"),  # (the Trainer takes `fsdp` in distributed runs only)
              "activation_checkpointing": settings.pop("activation_checkpointing", False)}
    trainer = fsdp_on_cpu(hf.CDGraBTrainer, plugin)(model=hf.tiny_gpt2(), train_dataset=hf.examples(hf.token_rows()),
                                                    args=hf.training_args(tmp_path), cdgrab=CDGraBSettings(**settings))
    try:
        with pytest.raises(ValueError, match=message) as refused:
            trainer.train()
    finally:  # AcceleratorState is one per process: the next test's Trainer gets the CPU's state back
        state = trainer.accelerator.state
        state.distributed_type, state.fsdp_plugin = trainer.cpu_state
    assert "\n" not in str(refused.value)
    assert trainer.state.global_step == 0
