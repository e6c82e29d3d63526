"""Autoregressive sampling from a decoder, for evaluation.

There is no KV cache: every step runs the whole prefix again (cut to the model's
max_seq_len, keeping the most recent tokens), so a step costs a full forward pass. This
is meant for looking at a model's output, not for serving.
"""

import torch
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
) -> list[int]:
    """The new token ids (not the prompt) that follow prompt_ids.

    temperature 0 picks the most likely token (greedy); otherwise the next token is drawn
    from softmax(logits / temperature), restricted to the top_k most likely when top_k is
    given, with a CPU generator seeded by `seed` (fresh randomness when seed is None).
    Stops after max_new_tokens tokens or once eos_id is drawn (eos_id is included).
    vocab_size (default: all the logits) is how many ids are tokens: a padded vocabulary's
    rows past them are never picked.
    """
    prompt_ids = [int(i) for i in prompt_ids]
    if not prompt_ids:
        raise ValueError("generate: the prompt is empty (give at least one token, e.g. BOS)")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens {max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"generate: temperature {temperature} must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k {top_k} must be >= 1")
    device = next(model.parameters()).device
    max_len = getattr(getattr(model, "args", None), "max_seq_len", None)
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    tokens = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = tokens[-max_len:] if max_len else tokens
        logits = model(torch.tensor([window], device=device))[0, -1, :vocab_size].float().cpu()
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            scaled = logits / temperature
            if top_k is not None and top_k < scaled.numel():
                kth = torch.topk(scaled, top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            probs = torch.softmax(scaled, dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=generator))
        tokens.append(next_id)
        new.append(next_id)
        if eos_id is not None and next_id == eos_id:
            break
    return new
