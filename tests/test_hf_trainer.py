"""CDGraBTrainer (sorters/hf.py): CD-GraB orders inside the Hugging Face Trainer, checked against the library
sorter fed the same gradients, an ordinary backward pass, an uninterrupted run, and a plain Trainer."""
import os
import runpy
import shutil
import sys

import pytest
import torch

from sorters import build_sorter
from tests.helpers import DATA_DIR, REPO, check_ok, needs_data, run_forked, run_python, run_script
from tests.test_lightning import assert_same

EXAMPLE = "examples/hf_trainer_gpt2.py"


@pytest.fixture(scope="module")
def hf():
    """tests/hf_trainer_tiny.py (the tests are skipped where transformers is not installed)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import tests.hf_trainer_tiny as tiny
    return tiny


@pytest.fixture(scope="module")
def uninterrupted(hf, tmp_path_factory):
    """3 epochs of CD-GraB, 2 replicas in one process, 2 micro-batches per optimizer step, a checkpoint
    every 2 optimizer steps (mid-epoch at 2 and 4, at epoch 1's end at 6); the formed gradients' path
    (exact_low_memory=False), whose step() gets the (B, d) gradients."""
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(out, save_strategy="steps", save_steps=2),
                                  train_dataset=hf.examples(hf.token_rows()), num_replicas=hf.REPLICAS,
                                  exact_low_memory=False)
    trainer.train()
    return trainer


def epoch_orders(hf, batches) -> list[torch.Tensor]:
    """Micro-batches of example indices (replica 0's BATCH, then replica 1's) -> each epoch's (REPLICAS, m)."""
    per_epoch = []
    for e in range(0, len(batches), hf.MICRO_BATCHES):
        steps = torch.tensor(batches[e:e + hf.MICRO_BATCHES]).view(hf.MICRO_BATCHES, hf.REPLICAS, hf.BATCH)
        per_epoch.append(steps.permute(1, 0, 2).reshape(hf.REPLICAS, -1))
    return per_epoch


def test_orders_equal_the_library_sorter_fed_the_same_gradients(hf, uninterrupted):
    orders = assert_orders_are_the_sorters(hf, uninterrupted, hf.EPOCHS)
    assert not torch.equal(orders[1], orders[2])  # the orders follow the gradients, epoch by epoch


def assert_orders_are_the_sorters(hf, trainer, epochs) -> list[torch.Tensor]:
    """Every epoch's orders are CD-GraB's for the gradients step() got, each example used once per epoch, and
    those gradients are the examples' own (an ordinary backward pass at the same parameters)."""
    m = hf.N // hf.REPLICAS
    assert len(trainer.batches) == len(trainer.grads) == epochs * hf.MICRO_BATCHES  # one step() per micro-batch
    orders = epoch_orders(hf, trainer.batches)
    sorter = build_sorter("CD-GraB", hf.REPLICAS, m, trainer.cdgrab_grads.d, seed=0)
    grads = iter(trainer.grads)
    for epoch, used in enumerate(orders):
        assert sorted(used.reshape(-1).tolist()) == list(range(hf.N))  # each example once: none lost, none twice
        assert torch.equal(sorter.sort() + torch.arange(hf.REPLICAS)[:, None] * m, used), f"epoch {epoch}"
        for t in range(0, m, hf.BATCH):
            sorter.step(next(grads).view(hf.REPLICAS, hf.BATCH, -1), range(t, t + hf.BATCH))
    for step, first in enumerate(trainer.first_grads):
        torch.testing.assert_close(trainer.grads[step][0], first, rtol=1e-4, atol=1e-6)
    return orders


def test_under_bf16_autocast_the_gradients_are_the_examples_own(hf, uninterrupted, tmp_path):
    """Mixed precision (Accelerate's autocast around the model's forward) reaches the per-example pass too:
    its gradients are an ordinary backward pass's under the same autocast, to bfloat16's precision (the
    batched kernels round differently once the biases are no longer 0), and not float32's."""
    trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path, bf16=True, max_steps=2),
                                  train_dataset=hf.examples(hf.token_rows()), num_replicas=hf.REPLICAS,
                                  exact_low_memory=False)
    trainer.train()
    assert len(trainer.first_grads) == 2 * hf.ACCUM
    for step, first in enumerate(trainer.first_grads):
        bf16_resolution = 2 ** -7 * first.abs().max().item()
        torch.testing.assert_close(trainer.grads[step][0], first, rtol=0, atol=bf16_resolution)
    float32 = uninterrupted.grads[0][0]  # the same first micro-batch at the same initial weights
    assert trainer.batches[0] == uninterrupted.batches[0] and (trainer.grads[0][0] - float32).abs().max() > 1e-4


def test_the_mixin_composes_with_trl_sft_trainer(hf, tmp_path):
    """TRL's SFTTrainer (its own collator, compute_loss and training_step) with the mixin first in the bases."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    class CDGraBSFTTrainer(hf.Recording, hf.CDGraBTrainerMixin, trl.SFTTrainer):
        pass

    args = hf.training_args(tmp_path, cls=trl.SFTConfig, num_train_epochs=2, activation_checkpointing=False, bf16=False,
                            dataset_kwargs={"skip_prepare_dataset": True})  # the rows are token ids already
    trainer = CDGraBSFTTrainer(model=hf.tiny_gpt2(), args=args, processing_class=hf.gpt2_tokenizer(DATA_DIR),
                               train_dataset=datasets.Dataset.from_dict({"input_ids": hf.token_rows().tolist()}),
                               num_replicas=hf.REPLICAS)
    trainer.train()
    assert_orders_are_the_sorters(hf, trainer, 2)


# optimizer step 4: epoch 1 after 1 of its 3 steps (the Trainer replays it and skips 2 micro-batches);
# step 6: epoch 1's end
@pytest.mark.parametrize("checkpoint", [4, 6])
def test_resume_gives_the_uninterrupted_orders_losses_and_state(hf, uninterrupted, checkpoint, tmp_path):
    saved = tmp_path / f"checkpoint-{checkpoint}"
    shutil.copytree(uninterrupted.args.output_dir + f"/checkpoint-{checkpoint}", saved)
    state = torch.load(saved / hf.SAMPLER_FILE)["sampler"]
    assert state["position"] == (checkpoint * hf.ACCUM * hf.BATCH - 1) % (hf.N // hf.REPLICAS) + 1
    resumed = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path / "out"),
                                  train_dataset=hf.examples(hf.token_rows()), num_replicas=hf.REPLICAS,
                                  exact_low_memory=False)
    resumed.train(resume_from_checkpoint=str(saved))
    done = checkpoint * hf.ACCUM  # micro-batches before the checkpoint
    assert resumed.batches == uninterrupted.batches[done:]
    assert resumed.losses == uninterrupted.losses[done:]  # bit for bit
    assert_same(resumed.cdgrab_sampler.state_dict(), uninterrupted.cdgrab_sampler.state_dict())


def test_a_checkpoint_without_the_sampler_state_is_refused_before_the_first_step(hf, uninterrupted, tmp_path):
    saved = tmp_path / "checkpoint-4"
    shutil.copytree(uninterrupted.args.output_dir + "/checkpoint-4", saved)
    (saved / hf.SAMPLER_FILE).unlink()  # as a plain Trainer's checkpoint
    resumed = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path / "out"),
                                  train_dataset=hf.examples(hf.token_rows()), num_replicas=hf.REPLICAS,
                                  exact_low_memory=False)
    with pytest.raises(ValueError, match=f"has no {hf.SAMPLER_FILE}") as refused:
        resumed.train(resume_from_checkpoint=str(saved))
    assert "\n" not in str(refused.value) and resumed.batches == []


def test_a_fixed_order_is_bitwise_a_plain_trainer_on_the_data_in_that_order(hf, tmp_path):
    """D-SO draws one permutation per replica; a plain Trainer reading the data sequentially in the order
    the sampler yields it must give the same losses and weights, bit for bit: the mixin adds no
    arithmetic and draws no random numbers."""
    m = hf.N // hf.REPLICAS
    orders = build_sorter("D-SO", hf.REPLICAS, m, 1, seed=0).sort() + torch.arange(hf.REPLICAS)[:, None] * m
    steps = orders.view(hf.REPLICAS, -1, hf.BATCH).permute(1, 0, 2).reshape(-1)  # the sampler's yield order
    rows = hf.token_rows()
    ours = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path / "a"),
                               train_dataset=hf.examples(rows), sorter="D-SO", num_replicas=hf.REPLICAS)
    ours.train()
    plain = hf.RecordingPlainTrainer(model=hf.tiny_gpt2(), train_dataset=hf.examples(rows[steps]),
                                     args=hf.training_args(tmp_path / "b", train_sampling_strategy="sequential",
                                                           per_device_train_batch_size=hf.REPLICAS * hf.BATCH))
    plain.train()
    assert ours.batches == plain.batches and len(ours.batches) == hf.EPOCHS * hf.MICRO_BATCHES
    assert ours.losses == plain.losses
    for a, b in zip(ours.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)


REFUSALS = {  # a setting the trainer cannot honour -> what its one line says
    "activation checkpointing": (dict(args=dict(activation_checkpointing=True)), "gradient checkpointing"),
    "group_by_length": (dict(args=dict(train_sampling_strategy="group_by_length")), "train_sampling_strategy"),
    "ragged tail": (dict(n=25), "dataloader_drop_last=True"),
    "iterable dataset": (dict(iterable=True, args=dict(max_steps=4)), "map-style"),  # the Trainer's own need
    "sdpa with a mask": (dict(model=dict(attn_implementation="sdpa"), mask=True), "eager"),
    "dropout": (dict(model=dict(dropout=0.1)), "Dropout"),
    "label smoothing": (dict(args=dict(label_smoothing_factor=0.1)), "model's own loss"),
    "no labels": (dict(no_labels=True), "labels"),
    "ignore_data_skip": (dict(args=dict(ignore_data_skip=True), resume=True), "ignore_data_skip"),
    "auto batch size": (dict(args=dict(auto_find_batch_size=True)), "auto_find_batch_size"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_what_it_cannot_honour_is_refused_in_one_line_before_the_first_step(hf, case, tmp_path):
    setting, says = REFUSALS[case]
    rows = hf.token_rows(setting.get("n", hf.N))
    data = hf.examples(rows, mask=setting.get("mask", False))
    if setting.get("no_labels"):
        data = [{"input_ids": example["input_ids"]} for example in data]
    if setting.get("iterable"):
        data = ListStream(data)
    trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(**setting.get("model", {})), rows=rows, train_dataset=data,
                                  args=hf.training_args(tmp_path, **setting.get("args", {})),
                                  exact_low_memory=False)  # the formed path's refusals
    with pytest.raises(ValueError, match=says) as refused:
        trainer.train(resume_from_checkpoint=str(tmp_path) if setting.get("resume") else None)
    assert "\n" not in str(refused.value)
    assert trainer.batches == []


class ListStream(torch.utils.data.IterableDataset):
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


@needs_data("wikitext-103/wiki.valid.tokens", "wikitext-103/wiki.test.tokens", "gpt2-tokenizer")
def test_example_under_two_gloo_processes_equals_one_process_and_every_rank_holds_the_same_state(hf, tmp_path,
                                                                                               monkeypatch):
    """examples/hf_trainer_gpt2.py under torchrun (the Trainer's DDP over gloo) against both replicas in one
    process (run here, where transformers is imported already): the same orders, losses to rounding."""
    tiny = ["--max-train-examples", "32", "--block-size", "16", "--batch-size", "4", "--epochs", "2"]
    multi = run_script(EXAMPLE, *tiny, "--out", tmp_path / "ddp", "--save-orders", tmp_path / "ddp.pt", nproc=2)
    check_ok(multi)
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", [EXAMPLE, *tiny, "--replicas", "2", "--out", str(tmp_path / "one"),
                                    "--save-orders", str(tmp_path / "one.pt"), "--data-dir", str(DATA_DIR)])
        patch.setattr(sys, "path", list(sys.path))  # the example adds the repo root
        runpy.run_path(str(REPO / EXAMPLE), run_name="__main__")
    a, b = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "one.pt")
    assert len(a["orders"]) == 2 and all(torch.equal(x, y) for x, y in zip(a["orders"], b["orders"]))
    assert not torch.equal(a["orders"][0], a["orders"][1])
    assert len(a["losses"]) == 8 and a["losses"] == pytest.approx(b["losses"], rel=1e-5)
    states = [torch.load(tmp_path / f"ddp.pt.rank{r}") for r in (0, 1)]
    assert states[0]["position"] == states[0]["config"]["m"] == 16  # the whole last epoch stepped
    assert_same(states[0], states[1])


# ------------------------------------------------------------------ structured=True: sketches from the records


def structured_trainer(hf, out, **kwargs):
    args = kwargs.pop("args", {})
    return hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(out, **args),
                               train_dataset=hf.examples(hf.token_rows()), num_replicas=hf.REPLICAS,
                               structured=True, sketch_min_numel=1, **kwargs)


def test_structured_with_the_identity_map_is_the_exact_trainer(hf, uninterrupted, tmp_path):
    """D >= d: the records give each example's whole gradient, so the orders are exact CD-GraB's (the
    uninterrupted run's) and the losses, computed here from the logits, the model's own to rounding."""
    trainer = structured_trainer(hf, tmp_path, sketch_dim=10**6)
    trainer.train()
    assert trainer.cdgrab_grads.sketch.is_identity
    assert trainer.batches == uninterrupted.batches
    assert trainer.losses == pytest.approx(uninterrupted.losses, rel=1e-5)
    for ours, exact in zip(trainer.grads, uninterrupted.grads):
        torch.testing.assert_close(ours, exact, rtol=1e-4, atol=1e-6)


def test_structured_sketches_are_the_map_of_each_examples_gradient_and_resume_checks_the_setting(hf, tmp_path):
    """D < d with every weight a TensorSketch block: the sampler gets the map of each example's own
    gradient (an ordinary backward of the first example, then the map); a checkpoint of this run is
    refused by a trainer with structured=False."""
    trainer = structured_trainer(hf, tmp_path / "run", sketch_dim=32,
                                 args=dict(save_strategy="steps", save_steps=2, num_train_epochs=2))
    trainer.train()
    sketch = trainer.cdgrab_grads.sketch
    assert len(sketch.blocks) >= 3 and trainer.grads[0].shape == (hf.REPLICAS * hf.BATCH, 32)
    assert len(trainer.grads) == len(trainer.first_grads) == 2 * hf.MICRO_BATCHES
    for step, first in enumerate(trainer.first_grads):
        expected = sketch(first[None].double()).float()[0]
        torch.testing.assert_close(trainer.grads[step][0], expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    m = hf.N // hf.REPLICAS
    sorter = build_sorter("CD-GraB", hf.REPLICAS, m, 32, seed=0)
    grads = iter(trainer.grads)
    for used in epoch_orders(hf, trainer.batches):
        assert torch.equal(sorter.sort() + torch.arange(hf.REPLICAS)[:, None] * m, used)
        for t in range(0, m, hf.BATCH):
            sorter.step(next(grads).view(hf.REPLICAS, hf.BATCH, -1), range(t, t + hf.BATCH))
    exact = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path / "out"), sketch_dim=32,
                                train_dataset=hf.examples(hf.token_rows()), num_replicas=hf.REPLICAS)
    with pytest.raises(ValueError, match="structured=True \\(now False\\)") as refused:
        exact.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert "\n" not in str(refused.value) and exact.batches == []


def test_causal_lm_losses_are_the_models_own_loss_of_each_example_and_of_the_batch(hf):
    from sorters.hf import _causal_lm_losses
    model = hf.tiny_gpt2().double()
    ids = hf.token_rows(3)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt left out of the loss
    labels[2, 5:] = -100
    losses, counts = _causal_lm_losses(model(input_ids=ids).logits, labels)
    assert counts.tolist() == [hf.T - 3, hf.T - 1, 4]  # token t predicts labels[t + 1]
    for i in range(3):
        alone = model(input_ids=ids[i:i + 1], labels=labels[i:i + 1]).loss
        torch.testing.assert_close(losses[i].float(), alone, rtol=1e-6, atol=0)  # transformers: float32
    batch = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(((losses * counts).sum() / counts.sum()).float(), batch, rtol=1e-6, atol=0)


def test_the_settings_object_and_the_keyword_arguments_are_one_door(hf, tmp_path):
    """cdgrab=CDGraBSettings(...) and the old keyword arguments give the same settings (seed None: args.seed);
    both at once, or bad settings, are one line before the Trainer is built."""
    from sorters import CDGraBSettings

    def make(**kwargs):
        return hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path, seed=7),
                                   train_dataset=hf.examples(hf.token_rows()), **kwargs)
    settings = CDGraBSettings(sorter="D-RR", grad_params=[r"\.h\.0\."], sketch_dim=8, num_replicas=2)
    by_object = make(cdgrab=settings).cdgrab_settings
    by_keywords = make(sorter="D-RR", grad_params=[r"\.h\.0\."], sketch_dim=8, num_replicas=2).cdgrab_settings
    assert by_object == by_keywords == CDGraBSettings(sorter="D-RR", seed=7, grad_params=(r"\.h\.0\.",),
                                                      sketch_dim=8, num_replicas=2)
    assert make(sorter_seed=3, sketch_min_numel=5).cdgrab_settings.seed == 3
    with pytest.raises(TypeError, match="not both"):
        make(cdgrab=settings, sorter="D-RR")
    with pytest.raises(TypeError, match="must be a sorters.CDGraBSettings"):
        make(cdgrab={"sorter": "D-RR"})
    with pytest.raises(ValueError, match="min_numel must be >= 1"):
        make(sketch_min_numel=0)


def test_structured_needs_a_sketch_and_labels(hf, tmp_path):
    with pytest.raises(ValueError, match="sketch_dim > 0"):
        structured_trainer(hf, tmp_path)
    trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path), num_replicas=hf.REPLICAS,
                                  train_dataset=[{"input_ids": r} for r in hf.token_rows()], structured=True,
                                  sketch_dim=8)
    with pytest.raises(ValueError, match="labels"):
        trainer.train()


@pytest.fixture(scope="module")
def example_blocks():
    """The example's blocks (--block-size 32) of WikiText-103's valid and test splits, in the token cache it
    reads (load_blocks' default place). A run that finds them missing tokenizes first and says so on stderr, a
    line before its error: without this, the one-line checks below passed or failed by whether some earlier
    run on this machine (tests/test_gpt2_wiki103.py's, on another pytest worker) had filled the cache."""
    from data.wikitext103 import load_blocks

    for split in ("valid", "test"):
        load_blocks(DATA_DIR, split, 32)


WIKITEXT_103 = needs_data("wikitext-103/wiki.valid.tokens", "wikitext-103/wiki.test.tokens", "gpt2-tokenizer")


@pytest.mark.parametrize("args,message", [
    (["--data-dir", "no-such-folder"], "no-such-folder/wikitext-103"),  # the data set
    # the sorter's settings, refused before any data is read: no data folder is needed to see it
    (["--data-dir", "no-such-folder", "--structured"], "needs sketch_dim > 0"),
    pytest.param(["--data-dir", DATA_DIR, "--max-train-examples", "3"], "3 examples are too few",  # the sampler
                 marks=WIKITEXT_103),
])
def test_example_bad_input_gets_one_line_and_exit_2(request, tmp_path, args, message):
    if DATA_DIR in args:
        request.getfixturevalue("example_blocks")
    result = run_python([sys.executable, REPO / EXAMPLE, *args, "--block-size", "32", "--out", tmp_path / "out"],
                        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


@pytest.fixture(scope="module")
def exact_low_memory(hf, uninterrupted, tmp_path_factory):
    """CDGraBSettings(exact_low_memory=True), 2 replicas in one process, gradient accumulation 2."""
    from sorters import CDGraBSettings
    trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path_factory.mktemp("exact")),
                                  train_dataset=hf.examples(hf.token_rows()),
                                  cdgrab=CDGraBSettings(num_replicas=hf.REPLICAS, exact_low_memory=True))
    trainer.train()
    return trainer


def test_exact_low_memory_gives_the_exact_trainers_orders_and_losses(exact_low_memory, uninterrupted):
    """CDGraBSettings(exact_low_memory=True): the products of the examples' gradients from the Trainer's own
    forward and backward (sorters/exact.py) give the orders of the exact run (2 replicas in one process,
    gradient accumulation 2: the running sum's update from the records alone), to the step."""
    from sorters.exact import ExactCDGraB
    trainer = exact_low_memory
    assert isinstance(trainer.cdgrab_sampler.sorter, ExactCDGraB)
    assert trainer.batches == uninterrupted.batches
    assert trainer.losses == pytest.approx(uninterrupted.losses, rel=1e-5)
    assert trainer.cdgrab_sampler.sorter.near_ties == 0


def exact_rank(rank, port, out, find_unused):
    """One of 2 forked processes: the Trainer's DDP over gloo (Accelerate reads the torchrun variables),
    exact_low_memory; its batches, losses, final parameters and sampler state saved to out.rankR."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)  # the parent's one-process state, forked
    import tests.hf_trainer_tiny as hf
    from sorters import CDGraBSettings
    trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(f"{out}-{rank}", ddp_backend="gloo",
                                                                           ddp_find_unused_parameters=find_unused,
                                                                           save_strategy="steps", save_steps=4),
                                  train_dataset=hf.examples(hf.token_rows()),
                                  cdgrab=CDGraBSettings(exact_low_memory=True))
    try:
        assert trainer.args.world_size == 2
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        sorter = trainer.cdgrab_sampler.sorter
        assert type(sorter).__name__ == "ExactCDGraB" and sorter.near_ties == 0
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        torch.save({"batches": trainer.batches, "losses": trainer.losses, "params": params,
                    "state": trainer.cdgrab_sampler.state_dict()}, f"{out}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("find_unused", [None, False])
def test_exact_low_memory_under_two_gloo_processes_equals_one_process_and_the_exact_trainer(
        hf, exact_low_memory, uninterrupted, tmp_path, find_unused):
    """exact_low_memory under DDP (2 forked gloo processes, each one replica, the records all-gathered by the
    sampler): each rank uses its replica's half of every micro-batch of one process hosting both replicas and
    of the formed-gradient exact Trainer (so the same orders), the ranks' losses average to theirs, and both
    ranks end with one process's parameters (.grad is the processes' mean, as DDP makes it) and one state.
    find_unused: the Trainer's default (DDP looks for unused parameters), or DDP told every one is used."""
    import socket
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run_forked(exact_rank, (port, tmp_path / "run", find_unused), 2)
    runs = [torch.load(tmp_path / f"run.rank{r}") for r in range(2)]
    for one in (exact_low_memory, uninterrupted):
        for r, run in enumerate(runs):
            assert run["batches"] == [b[r * hf.BATCH:(r + 1) * hf.BATCH] for b in one.batches], f"rank {r}"
        averaged = [(a + b) / 2 for a, b in zip(runs[0]["losses"], runs[1]["losses"])]
        assert averaged == pytest.approx(one.losses, rel=1e-5)
    assert not all(a == b for a, b in zip(runs[0]["losses"], runs[1]["losses"]))  # each rank's own examples
    # atol: the attention's key bias has a zero gradient up to rounding, which Adam scales up to ~lr a step
    for name, p in exact_low_memory.model.named_parameters():
        assert torch.equal(runs[0]["params"][name], runs[1]["params"][name]), name
        torch.testing.assert_close(runs[0]["params"][name], p.detach(), rtol=1e-4, atol=1e-4)
    assert_same(runs[0]["state"], runs[1]["state"])
    # each rank updated its share of the running sum (ParameterShare): state_dict(), on every rank (also in
    # the checkpoints, which rank 0 wrote), sums the shares into one process's running sum
    one = exact_low_memory.cdgrab_sampler.state_dict()["sorter"]["running_sum"]
    torch.testing.assert_close(runs[0]["state"]["sorter"]["running_sum"], one, rtol=1e-4, atol=1e-5)
    saved = torch.load(tmp_path / "run-0" / "checkpoint-8" / hf.SAMPLER_FILE)["sampler"]  # 8 of 12, mid-epoch
    assert saved["position"] == 8 and not (tmp_path / "run-1" / "checkpoint-8" / hf.SAMPLER_FILE).exists()
    from sorters.exact import ExactGradients
    exact = ExactGradients(hf.tiny_gpt2())
    for name, p in zip(exact.names, exact.params):  # no parameter's share left out of the checkpoint
        start = exact.offsets[id(p)]
        assert bool(saved["sorter"]["running_sum"][start:start + p.numel()].ne(0).any()), name


# ------------------------------------------------------------------ exact_low_memory None: the default picks the path


def test_by_default_cd_grab_is_exact_low_memory_for_a_causal_lm_and_the_checkpoint_says_so(hf, exact_low_memory,
                                                                                          uninterrupted, tmp_path):
    """CDGraBSettings() (exact_low_memory None) on a causal LM with the Trainer's own loss: the records' path
    (an ExactCDGraB; the settings resolved to True, also in every checkpoint's record), with
    exact_low_memory=True's batches and losses, and the formed-gradient run's orders."""
    from sorters import CDGraBSettings
    from sorters.exact import ExactCDGraB
    trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path, save_strategy="steps",
                                                                               save_steps=3),
                                  train_dataset=hf.examples(hf.token_rows()), cdgrab=CDGraBSettings(num_replicas=hf.REPLICAS))
    assert trainer.cdgrab_settings.exact_low_memory is None
    trainer.train()
    assert isinstance(trainer.cdgrab_sampler.sorter, ExactCDGraB) and trainer.cdgrab_settings.exact_low_memory is True
    assert trainer.grads == [] and trainer.batches == exact_low_memory.batches == uninterrupted.batches
    assert trainer.losses == exact_low_memory.losses
    assert torch.load(tmp_path / "checkpoint-3" / hf.SAMPLER_FILE)["gradients"]["exact_low_memory"] is True


@pytest.mark.parametrize("model, kind", [("classifier 3", "single_label_classification"),
                                         ("classifier 1", "regression"), ("token classifier", "token_classification")])
def test_by_default_a_classifier_balances_from_the_records_with_cd_grabs_orders(hf, tmp_path, model, kind):
    """A GPT-2 sequence classifier (3 classes: cross-entropy; 1 output: regression, mean squared error) or
    token classifier (a tag per token, some ignored: each example's mean cross-entropy over its tagged tokens,
    unshifted) takes the records' path by default too (its own loss is the records' per-example loss): its
    orders are those of CD-GraB fed every example's gradient of its own loss by an ordinary backward (the
    oracle, taken before each micro-batch). torch.func cannot form them for the sequence classifier (its
    pooling indexes by the input's values), so the records are the only exact path there."""
    from sorters import CDGraBSettings
    from sorters.exact import ExactCDGraB

    class Oracle(hf.RecordingTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            self.grads.append(torch.stack([hf.backward_of_one(self.model, {key: value[i:i + 1] for key, value in inputs.items()},
                                                              self.cdgrab_grads.names)
                                           for i in range(len(inputs["input_ids"]))]))
            return super().training_step(model, inputs, *args, **kwargs)

    if model == "token classifier":
        network, dataset = hf.tiny_gpt2_token_classifier(), hf.tagged(hf.token_rows())
    else:
        num_labels = int(model.split()[1])
        network, dataset = hf.tiny_gpt2_classifier(num_labels), hf.labelled(hf.token_rows(), num_labels)
    trainer = Oracle(model=network, args=hf.training_args(tmp_path), train_dataset=dataset,
                     cdgrab=CDGraBSettings(num_replicas=hf.REPLICAS))
    trainer.train()
    assert isinstance(trainer.cdgrab_sampler.sorter, ExactCDGraB) and trainer.cdgrab_settings.exact_low_memory is True
    assert trainer.cdgrab_sampler.sorter.near_ties == 0 and trainer._cdgrab_loss_kind == kind
    orders = assert_orders_are_the_sorters(hf, trainer, hf.EPOCHS)
    assert not torch.equal(orders[1], orders[2])  # the orders follow the gradients


def test_each_examples_loss_is_the_classifiers_own_loss_of_that_example_alone(hf):
    """_example_losses against transformers' own loss of each example alone, for the three problem types."""
    from sorters.hf import _example_losses, _loss_kind
    rows = hf.token_rows(4)
    for num_labels, problem, labels in [(3, None, torch.tensor([0, 2, 1, 2])), (1, None, torch.randn(4)),
                                        (2, "regression", torch.randn(4, 2)),
                                        (3, "multi_label_classification", (torch.rand(4, 3) > 0.5).float())]:
        model = hf.tiny_gpt2_classifier(num_labels)
        model.config.problem_type = problem
        with torch.no_grad():
            logits = model(input_ids=rows).logits
            kind = _loss_kind(model, logits, labels)
            losses, counts = _example_losses(kind, logits, labels)
            model.config.problem_type = kind  # what transformers inferred for the batch: fixed for single examples
            own = [model(input_ids=rows[i:i + 1], labels=labels[i:i + 1]).loss for i in range(4)]
        assert kind == problem or problem is None
        torch.testing.assert_close(losses, torch.stack(own), rtol=1e-5, atol=1e-6)
        assert torch.equal(counts, torch.ones(4))


def test_each_examples_token_classification_loss_is_the_models_own_loss_of_that_example_alone(hf):
    """_example_losses("token_classification") against transformers' own loss of each example alone (its tagged
    tokens' mean cross-entropy), and the batch's loss from them against the model's loss of the batch."""
    from sorters.hf import _example_losses, _loss_kind
    rows, model = hf.token_rows(4), hf.tiny_gpt2_token_classifier()
    tags = torch.stack([example["labels"] for example in hf.tagged(rows)])
    with torch.no_grad():
        logits = model(input_ids=rows).logits
        kind = _loss_kind(model, logits, tags)
        losses, counts = _example_losses(kind, logits, tags)
        own = [model(input_ids=rows[i:i + 1], labels=tags[i:i + 1]).loss for i in range(4)]
        batch = model(input_ids=rows, labels=tags).loss
    assert kind == "token_classification" and _loss_kind(hf.tiny_gpt2(), logits, tags) == "causal_lm"
    torch.testing.assert_close(losses, torch.stack(own), rtol=1e-5, atol=1e-6)
    assert counts.tolist() == (tags != -100).sum(1).tolist() and len(set(counts.tolist())) > 1
    torch.testing.assert_close((losses * counts).sum() / counts.sum(), batch, rtol=1e-5, atol=1e-6)


class UnshiftedLM(torch.nn.Module):
    """A GPT-2 LM whose own loss is NOT the causal LM loss: token t's logits scored against labels[t]."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids=None, labels=None, position_ids=None):
        out = self.model(input_ids=input_ids, position_ids=position_ids)
        if labels is not None:
            out.loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
        return out


def test_by_default_the_formed_gradients_serve_what_the_records_cannot(hf, tmp_path):
    """exact_low_memory None picks the formed gradients (a CDGraB, settings resolved to False) for a
    parameter outside every layer rule, a loss the records do not compute (a model's own unshifted loss, a
    subclass's compute_loss), a sketch, and a sorter that balances nothing; True stays a refusal."""
    def chosen(model=None, cls=hf.RecordingTrainer, **settings):
        trainer = cls(model=model or hf.tiny_gpt2(), args=hf.training_args(tmp_path),
                      train_dataset=hf.examples(hf.token_rows()), **settings)
        sampler = trainer._get_train_sampler()
        return trainer.cdgrab_settings.exact_low_memory, type(sampler.sorter).__name__

    assert chosen() == (True, "ExactCDGraB")  # the control: the same set-up otherwise
    bare = hf.tiny_gpt2()
    bare.register_parameter("bias_without_layer", torch.nn.Parameter(torch.zeros(3)))
    assert chosen(bare) == (False, "CDGraB")
    assert chosen(UnshiftedLM(hf.tiny_gpt2())) == (False, "CDGraB")

    class OwnLoss(hf.RecordingTrainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)
    assert chosen(cls=OwnLoss) == (False, "CDGraB")

    class LossTrainer(hf.Trainer):  # a Trainer subclass behind the mixin (as TRL's SFTTrainer) with its own loss
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    class Behind(hf.Recording, hf.CDGraBTrainerMixin, LossTrainer):
        pass
    assert chosen(cls=Behind) == (False, "CDGraB")
    assert chosen(sketch_dim=8) == (False, "CDGraB")
    assert chosen(sorter="D-RR")[0] is False
    with pytest.raises(ValueError, match="own loss") as refused:
        chosen(UnshiftedLM(hf.tiny_gpt2()), exact_low_memory=True)
    assert "\n" not in str(refused.value)
