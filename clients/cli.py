"""`python -m clients PROMPT`: send one request to the Triton service and stream the answer as it arrives.

    python -m clients "Write a haiku about GPUs" --num-draft-tokens 4
    python -m clients --chat "Hello!" --tokenizer out/default/engines/target   # chat template applied
    python -m clients "def add(a, b):" --protocol http --url localhost:8000 --no-stream

Generated text goes to stdout; a stats line (tokens, latency, time to first token, acceptance)
goes to stderr. Any failure prints one line `error: ...` and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clients.chat import ChatTemplate, ChatTemplateError
from clients.client import (DEFAULT_URLS, ClientError, Completion, GenerateRequest, SamplingParams, TritonClient,
                            tokenizer_dir_of)


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the client CLI."""
    p = argparse.ArgumentParser(prog="python -m clients", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", help="prompt text (with --chat: the user message)")
    p.add_argument("--url", help=f"Triton host:port (default {DEFAULT_URLS['grpc']} for grpc, {DEFAULT_URLS['http']} for http)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--model", default="ensemble", help="ensemble or tensorrt_llm_bls")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float,
                   help="samples only with --top-k or --top-p (NVIDIA's rule: neither set decodes greedily)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--num-draft-tokens", type=int, help="K draft tokens per round (0 = no speculation; default: the server's)")
    p.add_argument("--use-draft-logits", action=argparse.BooleanOptionalAction, default=None,
                   help="lossless rejection sampling with the draft's probabilities")
    p.add_argument("--stop", action="append", default=[], help="stop word (repeatable)")
    p.add_argument("--bad-word", action="append", default=[], help="word never to generate (repeatable)")
    p.add_argument("--request-id", default="")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before the request is abandoned")
    p.add_argument("--no-stream", action="store_true", help="wait for the whole answer instead of streaming")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--tokenizer", help="tokenizer directory holding the chat template (default: the server's "
                   "preprocessing tokenizer_dir when it exists here, else ChatML)")
    return p


def chat_template_for(client: TritonClient, tokenizer: str | None) -> ChatTemplate:
    """The chat template of `tokenizer`, else of the server's tokenizer when it is on this machine, else ChatML."""
    if tokenizer is None:
        tokenizer = tokenizer_dir_of(client.model_config("preprocessing"))
        if tokenizer is None or not Path(tokenizer).is_dir():
            return ChatTemplate()
    return ChatTemplate.from_tokenizer_dir(tokenizer)


def request_from_args(args: argparse.Namespace, client: TritonClient) -> GenerateRequest:
    """The GenerateRequest the arguments describe (chat template applied with --chat)."""
    prompt, stops = args.prompt, list(args.stop)
    if args.chat:
        template = chat_template_for(client, args.tokenizer)
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        prompt = template.render(messages)
        stops += [w for w in template.stop_words if w not in stops]
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    return GenerateRequest(prompt=prompt, max_tokens=args.max_tokens, sampling=sampling,
                           num_draft_tokens=args.num_draft_tokens, use_draft_logits=args.use_draft_logits,
                           stop_words=stops, bad_words=args.bad_word, request_id=args.request_id)


def stats_line(done: Completion) -> str:
    """A one-line summary of a finished request."""
    tokens = "?" if done.num_output_tokens is None else done.num_output_tokens
    line = f"[{tokens} tokens in {done.latency_s:.2f} s, first after {done.ttft_s * 1000:.0f} ms, {done.finish_reason}"
    if done.total_draft_tokens:
        line += (f", acceptance {done.acceptance_rate:.0%} ({done.total_accepted_draft_tokens}/"
                 f"{done.total_draft_tokens} draft tokens)")
    return line + f", id {done.request_id}]"


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    deltas = []
    try:
        with TritonClient(args.url, args.protocol, args.model, timeout_s=args.timeout) as client:
            request = request_from_args(args, client)
            if args.no_stream:
                done = client.generate(request)
                sys.stdout.write(done.text)
            else:
                for delta in client.stream(request):
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    deltas.append(delta)
                done = Completion.from_deltas(request, deltas, deltas[-1].time_s if deltas else 0.0)
    except (ClientError, ChatTemplateError, OSError) as exc:
        print(f"{chr(10) if deltas else ''}error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted (request cancelled)", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    print(stats_line(done), file=sys.stderr)
    return 0
