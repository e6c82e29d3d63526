"""titanlite as a model type of lm-evaluation-harness: a step-N folder (DCP, no export) or a
Hugging Face folder, scored by titanlite's own model code.

    python scripts/eval.py --checkpoint outputs/checkpoint/step-1000 --tasks hellaswag --batch_size 8

Importing this module registers the model as "titanlite" (lm-evaluation-harness 0.4.13 has no
plugin entry point for models: scripts/eval.py imports it, then runs lm-eval's own command
line). Requests are tokenized as lm-eval's Hugging Face backend tokenizes them for the
exported folder (whose tokenizer puts the BOS first, as training did), so that both give the
same numbers: the BOS before every context and every rolling text, the BOS token alone
before an empty context, the context's trailing spaces moved to the continuation;
``add_bos_token=false`` leaves the BOS out where a context is not empty.
"""

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from titanlite.downstream.evaluator import continuation_logprobs
from titanlite.downstream.tasks import IGNORE_INDEX, padded_batch, scored_row, split_pair


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("titanlite")
class TitanliteLM(LM):
    def __init__(
        self,
        checkpoint: str,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int | str = 8,
        max_length: int | None = None,
        tokenizer: str | None = None,
        add_bos_token: bool | str = True,
        use_ema: bool | str = False,
        **_ignored,
    ):
        """``checkpoint``: a step-N folder (a path or a URL) or a Hugging Face folder;
        ``tokenizer``: a tokenizer.json or its folder, instead of the one the run recorded;
        ``max_length``: the longest row scored (default: the model's RoPE length)."""
        super().__init__()
        from titanlite.checkpoint.load import load_model
        from titanlite.data.tokenizer import build_tokenizer
        from titanlite.dtypes import DTYPES

        if str(device).startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm-eval's command line asks for cuda unless told: as its hf backend, run where we can
        self.model, description = load_model(checkpoint, device=device, dtype=DTYPES[dtype], use_ema=_flag(use_ema))
        self.tokenizer = build_tokenizer(tokenizer or description.tokenizer_path)
        self._device = torch.device(device)
        self.batch_size = int(str(batch_size).split(":")[0]) if str(batch_size) != "auto" else 8
        self.max_length = int(max_length or description.args.max_seq_len)
        self.add_bos_token = _flag(add_bos_token)
        self.vocab_size = description.real_vocab_size
        self.prefix_id = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id

    # --- scoring rows ------------------------------------------------------------------

    def _scored(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of the last ``n`` tokens of each ``tokens`` row, in batches
        of rows of like length (longest first), returned in the rows' order."""
        order = sorted(range(len(rows)), key=lambda index: -len(rows[index][0]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chosen = order[start : start + self.batch_size]
            width = max(len(rows[index][0]) - 1 for index in chosen)
            inputs, labels = padded_batch([scored_row(*rows[index]) for index in chosen], width, self._device)
            with torch.no_grad():
                logits = self.model(inputs)[..., : self.vocab_size]
            logprobs = continuation_logprobs(logits, labels).tolist()
            greedy = ((logits.argmax(dim=-1) == labels) | (labels == IGNORE_INDEX)).all(dim=-1).tolist()
            for slot, index in enumerate(chosen):
                results[index] = (logprobs[slot], bool(greedy[slot]))
        return results

    def _row(self, context: str, continuation: str) -> tuple[list[int], int]:
        """The tokens of a (context, continuation) pair, cut from the left to max_length + 1,
        and how many of the last ones are the continuation's."""
        if context == "":
            context_ids, continuation_ids = [self.prefix_id], self.tokenizer.encode(continuation)
        else:
            context_ids, continuation_ids = split_pair(self.tokenizer, context, continuation)
            if self.add_bos_token and self.tokenizer.bos_id is not None:
                context_ids = [self.tokenizer.bos_id] + context_ids
        tokens = (context_ids + continuation_ids)[-(self.max_length + 1) :]
        return tokens, min(len(continuation_ids), len(tokens) - 1)

    # --- lm-evaluation-harness's three requests ----------------------------------------

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        results = self._scored([self._row(*request.args) for request in requests])
        for request, result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Each string's log-likelihood after the prefix token, scored in windows of max_length
        tokens that each predict new tokens only (lm-eval's rolling windows)."""
        totals = []
        for request in requests:
            (text,) = request.args
            bos = [self.tokenizer.bos_id] if self.add_bos_token and self.tokenizer.bos_id is not None else []
            windows = lm_utils.get_rolling_token_windows(
                token_list=bos + self.tokenizer.encode(text),
                prefix_token=self.prefix_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            rows = []
            for context, predicted in map(lm_utils.make_disjoint_window, windows):
                rows.append((context + predicted, len(predicted)))
            total = sum(logprob for logprob, _ in self._scored(rows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            totals.append(total)
        return totals

    def generate_until(self, requests) -> list[str]:
        """Greedy continuations, cut at the first of the request's ``until`` strings."""
        from titanlite.models.generate import generate

        outputs = []
        for request in requests:
            context, options = request.args
            until = options.get("until", []) or []
            until = [until] if isinstance(until, str) else list(until)
            new_tokens = int(options.get("max_gen_toks", 256))
            prompt = ([self.prefix_id] if self.add_bos_token or not context else []) + self.tokenizer.encode(context)
            prompt = prompt[-max(1, self.max_length - new_tokens) :]
            ids = generate(self.model, prompt, new_tokens, eos_id=self.tokenizer.eos_id, vocab_size=self.vocab_size)
            text = self.tokenizer.decode(ids)
            for stop in until:
                text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, options), text)
            outputs.append(text)
        return outputs
