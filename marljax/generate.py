"""`python -m marljax.generate --model M --prompt "..." [--chat] [--max-new-tokens N]`: print a completion."""
from __future__ import annotations

if __name__ == "__main__":  # the CLI keeps freed host memory: before anything imports jax
    from marljax.core import host_memory
    host_memory.opt_in("marljax.generate")

import argparse
import sys

from marljax.core import compile_cache
from marljax.models import ChatCodec, load_model, load_tokenizer
from marljax.sampling import SamplingParams, generate


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m marljax.generate", description=__doc__.split(":")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="preset name, HF checkpoint dir, or .gguf file")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    compile_cache.enable()
    model = load_model(args.model, dtype=args.dtype)
    codec = ChatCodec(load_tokenizer(args.model))
    if args.chat:
        prompts = [codec.render([{"role": "user", "content": p}]) for p in args.prompt]
    else:
        prompts = [codec.encode(p) for p in args.prompt]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, stop_token_ids=codec.stop_token_ids, seed=args.seed)
    out = generate(model, prompts, params)
    for prompt, tokens in zip(args.prompt, out.tokens):
        if len(args.prompt) > 1:
            print(f"### {prompt}")
        sys.stdout.write(codec.decode(tokens) + "\n")


if __name__ == "__main__":
    main()
