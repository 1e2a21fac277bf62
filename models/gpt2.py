"""Tiny GPT-2 language model (docs/benchmarks.md), built from a config only: nothing is downloaded.

GPT-2 defaults (GELU-new, LayerNorm eps 1e-5, N(0, 0.02) init with scaled residual projections,
lm_head tied to wte) with n_embd=128, n_layer=2, n_head=2, n_positions=128 and all dropout off.
d = 6,846,080 with the tied wte/lm_head matrix counted once: wte 6,432,896 + wpe 16,384
+ 2 blocks x 198,272 + ln_f 256.
"""
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def build_gpt2(vocab_size: int = 50257, n_embd: int = 128, n_layer: int = 2, n_head: int = 2,
               n_positions: int = 128) -> GPT2LMHeadModel:
    """A freshly initialised GPT2LMHeadModel in eval() mode.

    Dropout is 0 everywhere (the original relied on eval() for embd_pdrop; we set it too).
    Eager attention: the fused SDPA kernels do not work under torch.func.vmap, which computes
    the per-example gradients.
    """
    config = GPT2Config(vocab_size=vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        n_positions=n_positions, n_inner=None,  # None -> 4 * n_embd
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, summary_first_dropout=0.0,
                        tie_word_embeddings=True, attn_implementation="eager")
    model = GPT2LMHeadModel(config)
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise RuntimeError("GPT-2 lm_head is not tied to wte")  # would silently double d
    return model.eval()


def causal_mask(length: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The additive causal attention mask (1, 1, T, T) for T = length positions, to pass as
    `attention_mask`: 0 where query i may attend to key j (j <= i), torch.finfo(dtype).min above the
    diagonal. These are the values transformers' eager attention adds for a block without padding,
    so the logits are the same as with an all-ones (b, T) mask. Its top-left (1, 1, t, t) corner is
    the mask for t positions.

    Given a 4-D mask, transformers uses it as it is: it builds no mask per forward (transformers 5.17
    made a scalar tensor on the device there, a host synchronisation per forward on a GPU) and does
    not read position_ids on the host to look for packed sequences. dtype: the model's (the mask is
    added to its attention scores). Build it once, outside torch.func transforms (a tensor made
    inside one belongs to that transform), and reuse it: it broadcasts over the batch and the heads,
    so one mask serves batches of any size and single examples under torch.func.vmap.
    """
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()  # (T, T): key j <= query i
    mask = torch.zeros(length, length, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def lm_loss(model_or_logits, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal-LM loss: cross-entropy of logits[:, :-1] against input_ids[:, 1:], mean over tokens.

    model_or_logits: a model returning `.logits` (b, T, V) when called on input_ids (b, T),
    or those logits themselves. Returns a scalar.
    """
    logits = model_or_logits if torch.is_tensor(model_or_logits) else model_or_logits(input_ids=input_ids).logits
    V = logits.size(-1)
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), input_ids[:, 1:].reshape(-1))
