"""The transformers side of tests/test_hf_trainer.py, imported by its `hf` fixture (importing the Trainer
takes seconds, and every pytest-xdist worker collects every test module)."""
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from sorters.hf import SAMPLER_FILE, CDGraBTrainer, CDGraBTrainerMixin  # noqa: F401 (the tests use them from here)

REPLICAS, BATCH, N, T, ACCUM, EPOCHS = 2, 2, 24, 8, 2, 3  # m = 12: 6 micro-batches, 3 optimizer steps an epoch
MICRO_BATCHES = N // (REPLICAS * BATCH)

transformers.logging.set_verbosity_error()  # the tiny vocabulary makes it warn about the special tokens


def tiny_gpt2(attn_implementation="eager", dropout=0.0) -> GPT2LMHeadModel:
    """GPT-2 with 1 layer of width 16 and a vocabulary of 64, the same initial weights every call."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=T, n_embd=16, n_layer=1, n_head=2, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.set_attn_implementation(attn_implementation)
    return model


def gpt2_tokenizer(data_dir):
    """The GPT-2 tokenizer from the data folder's vocab.json and merges.txt (TRL wants one for its padding)."""
    folder = data_dir / "gpt2-tokenizer"
    tokenizer = transformers.GPT2TokenizerFast(vocab_file=str(folder / "vocab.json"), merges_file=str(folder / "merges.txt"))
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def token_rows(n=N) -> torch.Tensor:
    """(n, T) distinct random token sequences: a batch's rows name its examples."""
    return torch.randint(0, 64, (n, T), generator=torch.Generator().manual_seed(1))


def examples(rows: torch.Tensor, mask=False) -> list[dict]:
    return [{"input_ids": r, "labels": r, **({"attention_mask": torch.ones_like(r)} if mask else {})} for r in rows]


def training_args(out, cls=TrainingArguments, **kwargs) -> TrainingArguments:
    settings = dict(output_dir=str(out), use_cpu=True, per_device_train_batch_size=BATCH,
                    gradient_accumulation_steps=ACCUM, num_train_epochs=EPOCHS, learning_rate=1e-2, seed=0,
                    report_to=[], disable_tqdm=True, logging_strategy="no", save_strategy="no")
    return cls(**{**settings, **kwargs})


class Recording:
    """Mixed into a trainer: records each micro-batch's example indices (N rows of token_rows()), loss, the
    gradients its sampler's step() got, and an independent gradient of the micro-batch's first example."""

    def __init__(self, *args, rows=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.index_of = {tuple(r.tolist()): i for i, r in enumerate(token_rows() if rows is None else rows)}
        self.batches, self.losses, self.grads, self.first_grads = [], [], [], []

    def training_step(self, model, inputs, *args, **kwargs):
        self.batches.append([self.index_of[tuple(r.tolist())] for r in inputs["input_ids"]])
        sampler = getattr(self, "cdgrab_sampler", None)
        if sampler is not None and sampler.uses_grads:
            self.first_grads.append(backward_of_one(self.model, inputs, self.cdgrab_grads.names))
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.losses.append(loss.item())
        return loss

    def _get_train_sampler(self, train_dataset=None):
        sampler = super()._get_train_sampler(train_dataset)
        if not hasattr(sampler, "step"):  # a plain Trainer's
            return sampler
        step = sampler.step

        def recording_step(grads):
            self.grads.append(None if grads is None else grads.clone())
            step(grads)

        sampler.step = recording_step
        return sampler


def backward_of_one(model, inputs, names) -> torch.Tensor:
    """The oracle: the gradient (d,) of `names` for the batch's first example, by an ordinary backward pass."""
    named = dict(model.named_parameters())
    loss = model(**{key: value[:1] for key, value in inputs.items()}).loss
    grads = torch.autograd.grad(loss, [named[name] for name in names])
    return torch.cat([g.reshape(-1) for g in grads])


class RecordingTrainer(Recording, CDGraBTrainer):
    pass


class RecordingPlainTrainer(Recording, Trainer):
    pass


def tiny_gpt2_classifier(num_labels: int) -> transformers.GPT2ForSequenceClassification:
    """The tiny GPT-2 with a sequence-classification head (the last non-pad token's logits; pad id 63)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=T, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=63, num_labels=num_labels)
    model = transformers.GPT2ForSequenceClassification(config)
    model.set_attn_implementation("eager")
    return model


def tiny_gpt2_token_classifier(num_labels: int = 5) -> transformers.GPT2ForTokenClassification:
    """The tiny GPT-2 with a token-classification head (each token's logits over num_labels tags), dropout off."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=T, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, num_labels=num_labels, classifier_dropout=0.0)
    model = transformers.GPT2ForTokenClassification(config)
    model.set_attn_implementation("eager")
    return model


def tagged(rows: torch.Tensor, num_labels: int = 5) -> list[dict]:
    """Examples of a token classifier: a tag per token, about a quarter of them -100 (ignored), so that the
    examples have different numbers of labelled tokens."""
    generator = torch.Generator().manual_seed(3)
    tags = torch.randint(0, num_labels, rows.shape, generator=generator)
    tags[torch.rand(rows.shape, generator=generator) < 0.25] = -100
    return [{"input_ids": r, "labels": y} for r, y in zip(rows, tags)]


def labelled(rows: torch.Tensor, num_labels: int) -> list[dict]:
    """Examples of a classifier: the rows as input ids, a class each (num_labels 1: a real number, regression)."""
    generator = torch.Generator().manual_seed(2)
    labels = torch.randn(len(rows), generator=generator) if num_labels == 1 else \
        torch.randint(0, num_labels, (len(rows),), generator=generator)
    return [{"input_ids": r, "labels": y} for r, y in zip(rows, labels)]
