"""The `kiln` command line: pull, run, serve, bench."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time

from kiln.bench.cli import add_bench_parser
from kiln.runtime.drafting.config import SpeculativeConfig
from kiln.runtime.store.catalogue import CATALOGUE, DEFAULT_MODEL

DTYPES = ("auto", "float32", "bfloat16", "float16")  # runtime.backends.DTYPES, without torch

DTYPE_HELP = ("auto (default): bfloat16 on a GPU; on the CPU, kiln's CPU kernels on the GGUF's "
              "own blocks with the linear layers on 8-bit activations (--int8-activations) "
              "and an fp16 KV cache. float32 on the CPU: the same kernels with fp32 products "
              "and KV cache (logits match transformers'); bfloat16 the linear layers in bf16 "
              "through oneDNN (a CPU with AMX or AVX-512-BF16; not bit-exact). On CUDA: "
              "weights, KV cache and attention in that dtype (float16 on CUDA only)")


INT8_HELP = ("CPU: the linear layers multiply 8-bit integers (each run of 16 inputs rounded "
             "to 8 bits; VNNI dot products on the GGUF's own quants), as llama.cpp does with "
             "runs of 32: faster, logits within that rounding of fp32 (closer than "
             "llama.cpp's; bench/README.md). A request's bits still do not depend on its "
             "batch. Default: on with --dtype auto; --no-int8-activations or --dtype float32 "
             "for fp32 products")


def _dtype_refusal(args) -> str | None:
    import torch

    from kiln.runtime.backends import dtype_refusal, resolve_dtype

    cuda = torch.cuda.is_available()
    if args.int8_activations and (cuda or resolve_dtype(args.dtype, cuda) != "float32"):
        return "--int8-activations is for the CPU kernels' products, in place of float32 ones"
    return dtype_refusal(args.dtype, cuda)


def speculative_config(args):
    """--speculative and its flags (None: no drafting); a bad value is a ValueError."""
    if args.speculative is None:
        return None
    return SpeculativeConfig(args.speculative, args.num_speculative_tokens, args.ngram_min,
                             args.ngram_max, args.speculative_disable_by_batch_size)


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=["ngram"], default=None,
                   help="draft tokens and check them in the same forward: ngram drafts what "
                        "followed the last place the text's end occurred before (prompt "
                        "lookup). Off by default: it changes sampled replies (drafted tokens "
                        "the model agrees with skip the sampler)")
    spec = SpeculativeConfig()
    p.add_argument("--num-speculative-tokens", type=int, default=spec.num_speculative_tokens,
                   help="with --speculative: the most tokens drafted for one step")
    p.add_argument("--ngram-min", type=int, default=spec.ngram_min,
                   help="with --speculative ngram: the shortest text end matched, in tokens")
    p.add_argument("--ngram-max", type=int, default=spec.ngram_max,
                   help="with --speculative ngram: the longest, tried first; a draft is at "
                        "most as many tokens as the match that proposed it")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="with --speculative: greedy requests without penalties (whose "
                        "replies drafting cannot change) do not draft while more than this "
                        "many requests run; others draft whatever the load. "
                        "Default: 8 on the CPU (past it a step is bound by compute), no limit "
                        "on CUDA; 0: no limit")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def engine_options(args):
    """The engine options of `kiln run` or `kiln serve` (run has no batching flags)."""
    from kiln.runtime.engine.bootstrap import EngineOptions

    return EngineOptions(ctx_len=args.ctx_len, speculative=speculative_config(args),
                         prefill_chunk_len=getattr(args, "prefill_chunk_len", None),
                         kv_cache_tokens=getattr(args, "kv_cache_tokens", None),
                         max_num_seqs=getattr(args, "max_num_seqs", None),
                         max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
                         dtype=args.dtype,
                         int8_activations=args.int8_activations,
                         gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
                         enforce_eager=getattr(args, "enforce_eager", False),
                         async_scheduling=getattr(args, "async_scheduling", False),
                         batch_invariant=getattr(args, "batch_invariant", True))


def cmd_pull(args) -> int:
    from kiln.runtime.store.pull import PullError, ensure_model

    try:
        path = ensure_model(args.model)
    except PullError as exc:
        print(f"kiln pull: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def cmd_run(args) -> int:
    from kiln.runtime.engine.bootstrap import build_engine
    from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions
    from kiln.runtime.errors import KilnError
    from kiln.runtime.sampling.settings import SamplingFields, SamplingSettings
    from kiln.runtime.store.gguf_file import ModelLoadError
    from kiln.runtime.store.pull import PullError
    from kiln.runtime.text.detokenizer import IncrementalDetokenizer

    try:
        loaded, engine = build_engine(args.model, engine_options(args))
    except (PullError, ModelLoadError) as exc:
        print(f"kiln run: {exc}", file=sys.stderr)
        return 1
    if loaded.chat_template is None:
        print(f"kiln run: {args.model} has no chat template", file=sys.stderr)
        return 1
    settings = SamplingSettings(loaded.defaults)
    sampling = settings.admit(SamplingFields(temperature=args.temperature, seed=args.seed))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    ids = loaded.chat_prompt_ids(messages)
    try:
        req = engine.make_request("run-0", EngineRequest(
            ids, sampling, RequestOptions(max_tokens=args.max_tokens)))
    except KilnError as exc:
        print(f"kiln run: {exc.message}", file=sys.stderr)
        return 1
    engine.add_request(req)
    detok = IncrementalDetokenizer(loaded.tokenizer, skip_special_tokens=True)
    t0 = time.perf_counter()
    t_first = None
    while engine.has_unfinished():
        for out in engine.step():
            if t_first is None:
                t_first = time.perf_counter()
            for tok in out.new_token_ids:
                if tok not in req.stop_token_ids:
                    sys.stdout.write(detok.feed(tok))
            sys.stdout.flush()
    sys.stdout.write(detok.finish() + "\n")
    sys.stdout.flush()
    t1 = time.perf_counter()
    n = req.num_output_tokens
    decode = (n - 1) / (t1 - t_first) if n > 1 and t_first else 0.0
    drafts = f", {req.num_accepted_tokens} of {req.num_drafted_tokens} drafted tokens kept" \
        if engine.drafter is not None else ""
    print(f"[kiln]  {len(ids)} prompt tokens in {(t_first or t1) - t0:.2f} s "
          f"({len(ids) / ((t_first or t1) - t0):.1f} tok/s), {n} tokens at {decode:.1f} tok/s"
          f"{drafts}", file=sys.stderr)
    return 0


def cluster_options(args):
    """--replicas or --ray-address: the engines run on Ray Serve (kiln.cluster)."""
    if args.replicas is None and args.ray_address is None:
        return None
    from kiln.cluster.options import ClusterOptions

    return ClusterOptions(replicas=args.replicas or 1, ray_address=args.ray_address)


def cmd_serve(args) -> int:
    from pathlib import Path

    from kiln.api.access import AccessPolicy
    from kiln.api.server import serve
    from kiln.api.state import ServeOptions
    from kiln.runtime.store.model_dirs import default_models_dir

    if args.deterministic:
        logging.getLogger("kiln").info(
            "[kiln]  --deterministic: kiln's CPU kernels give the same bits by default")
    dirs = tuple(Path(d.strip()).expanduser() for arg in args.models_dir or ()
                 for d in arg.split(",") if d.strip()) or (default_models_dir(),)
    if args.max_request_bytes is not None and args.max_request_bytes < 1024:
        print("kiln serve: --max-request-bytes must be at least 1024", file=sys.stderr)
        return 2
    cluster = cluster_options(args)
    if cluster is not None and importlib.util.find_spec("ray") is None:
        print("kiln serve: --replicas runs on Ray Serve, which is not installed: "
              "pip install 'kiln[cluster]'", file=sys.stderr)
        return 2
    options = ServeOptions(engine_options(args), per_request_sampling=args.per_request_sampling,
                           shutdown_timeout=args.shutdown_timeout, models_dirs=dirs,
                           max_request_bytes=args.max_request_bytes,
                           access=AccessPolicy.from_flags(args.api_key, args.allowed_origins),
                           cluster=cluster, webui=not args.no_webui)
    return serve(args.model, options, args.host, args.port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="A small LLM inference server.")
    sub = p.add_subparsers(dest="command", required=True)
    models = ", ".join(CATALOGUE)

    pull = sub.add_parser("pull", help="fetch a catalogue model into the model cache")
    pull.add_argument("model", help=f"catalogue tag ({models})")
    pull.set_defaults(func=cmd_pull)

    run = sub.add_parser("run", help="answer one prompt, streamed to the terminal")
    run.add_argument("model_or_prompt", nargs="+", metavar="[MODEL] PROMPT")
    run.add_argument("--max-tokens", type=int, default=None)
    run.add_argument("--temperature", type=float, default=None)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--system", default=None)
    run.add_argument("--ctx-len", type=int, default=None)
    run.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    run.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, help=INT8_HELP)
    add_speculative_flags(run)
    run.set_defaults(func=cmd_run)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                       help=f"catalogue tag ({models}) or a .gguf path")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=52625)
    serve.add_argument("--ctx-len", type=int, default=None,
                       help="context length (raised to 512, capped at the model's)")
    serve.add_argument("--prefill-chunk-len", type=int, default=None,
                       help="prefill chunk length (raised to 512, rounded up to a power of 2)")
    serve.add_argument("--kv-cache-tokens", type=int, default=None,
                       help="KV cache capacity in tokens (default: 4 contexts, at least 16384)")
    serve.add_argument("--max-num-seqs", type=int, default=None,
                       help="most requests decoded together in one step (default 64 on the "
                            "CPU, 256 on CUDA, at most what the KV cache holds)")
    serve.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                       help="most tokens computed in one step, prompts' chunks and decode rows "
                            "together (default 8192 on CUDA; on the CPU a prefill chunk and a "
                            "token per request; never less than that)")
    serve.add_argument("--per-request-sampling", action="store_true",
                       help="sampling settings do not stick: each request starts from the "
                            "model defaults")
    serve.add_argument("--deterministic", action="store_true",
                       help="accepted for scripts written for older kiln: on the CPU a seeded "
                            "or greedy request gives the same bits alone, batched, or from "
                            "the prefix cache by default")
    serve.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    serve.add_argument("--int8-activations", action=argparse.BooleanOptionalAction,
                       help=INT8_HELP)
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="CUDA: the fraction of the GPU's memory kiln may use; the KV cache "
                            "gets what the weights and a step's activations leave of it "
                            "(unless --kv-cache-tokens says)")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run every step eagerly, without the CUDA graphs captured "
                            "at load (decode, and the pieces of steps with a prompt)")
    serve.add_argument("--async-scheduling", action="store_true",
                       help="launch each step before reading the last one's tokens, so the "
                            "host schedules and stages while the GPU computes (vLLM's flag; "
                            "steps with drafts or a grammar still wait; no gain on "
                            "the CPU, where the host computes the step)")
    serve.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                       help="CUDA: products whose reduction order never follows the batch "
                            "(kiln's Triton matmul), so a seeded or greedy reply has the same "
                            "bits alone or beside others (default); --no-batch-invariant: "
                            "cuBLAS's, which picks its kernel by the batch's size")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds running requests may take to finish before "
                            "they are ended (finish_reason \"abort\"); new requests get 503")
    serve.add_argument("--max-request-bytes", type=int, default=None,
                       help="the largest request body taken, in bytes; a larger one is a 413 "
                            "before it is read (default: 64 prompts of a whole context at 8 "
                            "bytes a token, plus 4 MiB)")
    serve.add_argument("--api-key", default=os.environ.get("KILN_API_KEY"),
                       help="every route but /health needs 'Authorization: Bearer KEY' "
                            "(default: $KILN_API_KEY; none: no key needed)")
    serve.add_argument("--allowed-origins", default=None,
                       help="comma-separated origins whose browser pages may call the API "
                            "besides localhost's (http(s)://localhost, 127.0.0.1, [::1], any "
                            "port); '*' lets every origin in")
    serve.add_argument("--no-webui", action="store_true",
                       help="serve no chat page at / (by default / is a chat page that "
                            "calls this server's API)")
    serve.add_argument("--models-dir", action="append", default=None, metavar="DIR",
                       help="a directory whose .gguf files requests may name by file name or "
                            "stem (repeatable or comma-separated; default: the model cache, "
                            "where kiln pull puts files); requests never name a path")
    serve.add_argument("--replicas", type=int, default=None,
                       help="run N engine replicas on Ray Serve (each its own process and KV "
                            "cache) behind this one endpoint, each request routed to the "
                            "replica holding the longest cached prefix of its prompt (needs "
                            "the `cluster` extra: pip install 'kiln[cluster]')")
    serve.add_argument("--ray-address", default=None,
                       help="with --replicas: attach to this running Ray cluster (e.g. "
                            "ray://head:10001 or auto) instead of starting one on this machine")
    add_speculative_flags(serve)
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper() if
                        hasattr(args, "log_level") else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    if args.command == "run":
        words = args.model_or_prompt
        if len(words) > 2:
            print("kiln run: give the prompt as one quoted argument", file=sys.stderr)
            return 2
        args.model, args.prompt = (words if len(words) == 2 else [DEFAULT_MODEL, words[0]])
    if hasattr(args, "dtype") and (refusal := _dtype_refusal(args)):
        print(f"kiln {args.command}: {refusal}", file=sys.stderr)
        return 2
    if hasattr(args, "speculative"):
        try:
            speculative_config(args)
        except ValueError as exc:
            print(f"kiln {args.command}: {exc}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
