"""A shardlm checkpoint as lm-evaluation-harness's `shardlm` model (lm-eval 0.4.x, `shardlm[eval]`).

`ShardLM` implements the harness's three request types on a causal shardlm model:

    loglikelihood          (context, continuation) -> (log p(continuation), greedy?), batched; the
                           vocabulary-parallel cross-entropy and argmax score it, logits never gathered
    loglikelihood_rolling  a whole text's log-likelihood in disjoint windows of the model's full
                           context, each window starting from the end-of-text token, as the `hf` backend
    generate_until         the KV-cache generator (`shardlm.eval.generate`), greedy or sampled, stopping
                           at the end-of-text token, `max_gen_toks` or a stop string

Text is tokenized, and requests are sorted longest first and batched, exactly as the harness's `hf`
backend does, so a checkpoint converted from Hugging Face scores what the HF model scores there.
Forward passes go through `TensorParallelCalls`: under `shardlm eval harness --tensor-parallel N`
every TP rank joins each of them while only TP rank 0 runs the harness. Built from `model_args`
(`lm_eval --model shardlm --model_args checkpoint=PATH`), the model runs in this one process.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from shardlm.errors import UserError
from shardlm.eval.harness_calls import HarnessScorer, TensorParallelCalls

log = logging.getLogger(__name__)


def _batch_size(value) -> int:
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise UserError(f"batch_size={value!r} is not supported by the shardlm model; pass a number") from None
    if size < 1:
        raise UserError(f"batch_size={size} must be at least 1")
    return size


def load_calls(checkpoint: str, device: str | None = None) -> TensorParallelCalls:
    """Load `checkpoint` in this one process (TP=1) and wrap it for the adapter. device: "cpu",
    "cuda[:N]" or None/"auto"; lm-eval's command line passes "cuda" by default, so without a GPU
    "cuda" falls back to the CPU (with a warning)."""
    import torch

    from shardlm.eval.loading import load_for_evaluation

    choice = "auto" if device in (None, "", "auto") else "cuda" if str(device).startswith("cuda") else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        log.warning("device=%s but no CUDA device is available; the shardlm model runs on the CPU", device)
        choice = "cpu"
    ctx, model, tokenizer = load_for_evaluation(SimpleNamespace(checkpoint=checkpoint, tensor_parallel=1,
                                                                device=choice))
    return TensorParallelCalls(HarnessScorer(model, tokenizer), ctx)


@register_model("shardlm")
class ShardLM(TemplateLM):
    """The harness's view of a shardlm model: text requests in, scores and generations out.

    checkpoint: a checkpoint directory or consolidated file, loaded in this process; or `calls`: an
    already loaded model on its TP group (what `shardlm eval harness` passes on TP rank 0).
    batch_size: requests per forward pass; max_gen_toks: default generation budget of a request.
    """

    def __init__(self, checkpoint: str | None = None, batch_size: int | str = 8, max_batch_size=None,
                 device: str | None = None, max_gen_toks: int = 256, calls: TensorParallelCalls | None = None,
                 **unknown) -> None:
        super().__init__()
        if unknown:
            raise UserError(f"unknown shardlm model_args {sorted(unknown)}; use checkpoint, batch_size, max_gen_toks")
        if calls is None:
            if not checkpoint:
                raise UserError("the shardlm model needs a checkpoint: --model_args checkpoint=PATH")
            calls = load_calls(checkpoint, device)
        if not calls.is_leader:
            raise ValueError("ShardLM runs on TP rank 0; the other ranks call TensorParallelCalls.serve()")
        self.calls = calls
        self.model, self.tokenizer = calls.scorer.model, calls.scorer.tokenizer
        self.checkpoint = checkpoint
        self._batch_size = _batch_size(batch_size)
        self._max_gen_toks = int(max_gen_toks)
        self._device = calls.ctx.device

    # ----------------------------------------------------------------------------- harness API

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    @property
    def max_length(self) -> int:
        return self.model.cfg.seq_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"shardlm-{self.tokenizer.kind}-{self.tokenizer.vocab_size}"

    def get_model_info(self) -> dict:
        return {"checkpoint": self.checkpoint, "tensor_parallel": self.calls.ctx.tp_size,
                "num_parameters": self.model.num_parameters(), "seq_length": self.max_length}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids), scored in
        batches of the longest first (as the `hf` backend orders them), answers in request order."""
        order = sorted(range(len(requests)), key=lambda i: (-len(requests[i][1]) - len(requests[i][2]),
                                                            tuple(requests[i][1] + requests[i][2])))
        answers: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="shardlm loglikelihood")
        for first in range(0, len(order), self.batch_size):
            batch = order[first:first + self.batch_size]
            pairs = [(list(requests[i][1]), list(requests[i][2])) for i in batch]
            for i, (logprob, greedy) in zip(batch, self.calls("loglikelihood", pairs)):
                answers[i] = (logprob, greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answers[i])
            bar.update(len(batch))
        bar.close()
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-likelihood: disjoint windows of max_length predicted tokens, the
        first predicted from the end-of-text token, every later one from its full preceding window."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            rolling = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, scores):
            totals[index] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until a stop string (the text is cut before it), the end-of-text
        token or max_gen_toks. Requests are grouped by their generation settings and batched."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        outputs: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="shardlm generate_until")
        for indices in groups.values():
            gen_kwargs = requests[indices[0]].args[1]
            sampling, until = self._sampling(gen_kwargs)
            keep = self.max_length - min(sampling["max_new_tokens"], self.max_length // 2)
            prompts = {i: self.tok_encode(requests[i].args[0])[-keep:] for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            for first in range(0, len(order), self.batch_size):
                batch = order[first:first + self.batch_size]
                new_ids = self.calls("generate", [prompts[i] for i in batch], sampling, until)
                for i, ids in zip(batch, new_ids):
                    outputs[i] = postprocess_generated_text(self.tok_decode(ids), until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, outputs[i])
                bar.update(len(batch))
        bar.close()
        return outputs

    def _sampling(self, gen_kwargs: dict) -> tuple[dict, list[str]]:
        """(`SamplingConfig` fields, stop strings) of a request's generation settings: greedy unless
        do_sample (then temperature, top_k, top_p and seed apply); the end-of-text string always stops."""
        kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id]))
        sampling = {"max_new_tokens": int(kwargs.pop("max_gen_toks")), "stop_at_eod": True, "temperature": 0.0}
        settings = {key: kwargs.pop(key, None) for key in ("do_sample", "temperature", "top_k", "top_p", "seed")}
        if settings["do_sample"]:
            sampling.update(temperature=float(settings["temperature"] or 1.0), top_k=int(settings["top_k"] or 0),
                            top_p=float(settings["top_p"] or 1.0), seed=int(settings["seed"] or 0))
        if kwargs:
            log.warning("shardlm ignores the generation settings %s", sorted(kwargs))
        return sampling, until
