"""The reference the rollout engine's output is checked against: the decoder's uncached forward pass (the
training path: no KV cache, no pages, no decode loop) over prompt + output, and float64 log-softmax."""
import jax
import jax.numpy as jnp
import numpy as np

from marljax.sampling import SampleOutput

_forward = jax.jit(lambda model, tokens_bt: model(tokens_bt))


def uncached_logits(model, seqs: list[list[int]]) -> list[np.ndarray]:
    """Each sequence's logits [len(seq), V] (float32 values, as float64) from one uncached forward pass over
    the right-padded batch (causal: no real position sees the padding)."""
    padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    logits = np.asarray(_forward(model, jnp.asarray(padded)), np.float64)
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


def log_softmax64(logits):
    """log_softmax over the last axis in float64."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def check_greedy(model, prompts: list[list[int]], out: SampleOutput, max_new: int, stops=(), atol: float = 1e-5):
    """Greedy output `out` against the uncached forward pass over each prompt + its output: every generated
    token is the (first) argmax of the uncached logits before it, so a greedy loop that recomputed the full
    uncached forward at every step would emit exactly these tokens; each sequence ends at its first stop
    token (finished) or after `max_new` tokens; its logprobs equal the float64 log_softmax of those logits
    within `atol`."""
    seqs = [p + t for p, t in zip(prompts, out.tokens)]
    for i, (p, toks, lps, fin, logits) in enumerate(zip(prompts, out.tokens, out.logprobs, out.finished,
                                                          uncached_logits(model, seqs))):
        before = logits[len(p) - 1: len(p) - 1 + len(toks)]  # the logits each token was chosen from
        assert toks == np.argmax(before, axis=-1).tolist(), i
        stopped = [j for j, t in enumerate(toks) if t in stops]
        assert fin == bool(stopped) and len(toks) == (stopped[0] + 1 if stopped else max_new), i
        np.testing.assert_allclose(lps, log_softmax64(before)[np.arange(len(toks)), toks], atol=atol, err_msg=str(i))


def results(run, requests) -> SampleOutput:
    """A stream's results of `requests` (ids) as one SampleOutput."""
    tokens, logprobs, finished = zip(*(run.result(r) for r in requests))
    return SampleOutput(list(tokens), list(logprobs), list(finished))
