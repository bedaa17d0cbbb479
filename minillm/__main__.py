"""Command line: python -m minillm {generate, bench, demo, serve, figures, lab, quiz} ...  (`--help` on each)."""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

# Each subcommand imports what it needs when it runs: `lab list` imports neither torch nor the engine.


def _generate(args) -> None:
    from . import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    with LLM(model=args.model, dtype=args.dtype, device=args.device, tensor_parallel_size=args.tensor_parallel_size,
             pipeline_parallel_size=args.pipeline_parallel_size,
             expert_parallel_size=args.expert_parallel_size) as llm:        # under torchrun only rank 0 gets here
        for prompt in args.prompt:
            if args.chat:
                prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt}])
            for piece in llm.stream(prompt, params):
                print(piece, end="", flush=True)
            print()


def _bench(args) -> None:
    from minillm.course import benchmarks
    from minillm.course.benchmarks.common import format_table, write_json

    module = benchmarks.load(args.name)
    kwargs = {}
    accepted = inspect.signature(module.run).parameters
    if args.dtype is not None:
        if "dtype" not in accepted:
            raise SystemExit(f"bench {args.name} has no --dtype (it measures its own list of dtypes)")
        kwargs["dtype"] = args.dtype
    if args.workload is not None:
        if "workload" not in accepted:
            raise SystemExit(f"bench {args.name} has no --workload (it measures one workload)")
        kwargs["workload"] = args.workload
    if args.part is not None:
        if "part" not in accepted:
            raise SystemExit(f"bench {args.name} has no --part (it runs as one piece)")
        kwargs["part"] = args.part
    if args.json and "json_path" in accepted:                     # it puts its figure next to its JSON
        kwargs["json_path"] = args.json
    doc = module.run(quick=args.quick, **kwargs)
    print(format_table(doc["results"]))
    print(json.dumps(doc["summary"], indent=2, default=float))
    if args.json:
        print(f"wrote {write_json(doc, args.json)}")


def _demo(args) -> None:
    from minillm.course.demo import main

    main(model=args.model, dtype=args.dtype, max_tokens=args.max_tokens)


def _serve(args) -> None:
    from . import LLM
    from minillm.serving.server import serve

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enable_chunked_prefill=not args.no_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
              kv_cache_dtype=args.kv_cache_dtype, prefix_cache=args.prefix_cache, quantization=args.quantization,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              expert_parallel_size=args.expert_parallel_size, speculative_method=args.speculative_method,
              num_speculative_tokens=args.num_speculative_tokens, speculative_policy=args.speculative_policy,
              speculative_model=args.speculative_model)
    name = args.served_model_name or args.model
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1 (OpenAI-compatible)", flush=True)
    limits = {key: getattr(args, key) for key in ("max_waiting", "max_body_bytes", "stall_timeout_s")
              if getattr(args, key) is not None}          # None: build_app's default
    serve(llm, host=args.host, port=args.port, served_model_name=name, api_key=args.api_key, **limits)


def _figures(args) -> None:
    from minillm.course.figures import draw_all

    for path in draw_all(args.out, quick=args.quick):
        print(f"wrote {path}")


def _quiz(args) -> None:
    from minillm.course.quiz import BANK, run

    run(lesson=args.lesson, seed=args.seed, lang=args.lang, bank=args.bank or BANK)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p):
        p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or an HF folder")
        p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")

    def parallel_args(p):                   # minillm/parallel, lesson 11; works under torchrun too
        p.add_argument("--tensor-parallel-size", type=int, default=1, help="split every layer over N processes")
        p.add_argument("--pipeline-parallel-size", type=int, default=1, help="split the layers into N stages")
        p.add_argument("--expert-parallel-size", type=int, default=1,
                       help="split a mixture of experts' routed experts over N processes (lesson 13)")

    g = sub.add_parser("generate", help="stream a completion for each PROMPT")
    model_args(g)
    g.add_argument("--device", default="auto")
    parallel_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("prompt", nargs="+")
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="run one benchmark, print a table, optionally write JSON")
    b.add_argument("name")
    b.add_argument("--quick", action="store_true", help="small sizes, for CI and a first look")
    b.add_argument("--json", default=None, help="write the result document here")
    b.add_argument("--dtype", default=None, help="for benchmarks that take one (batching): float32 | bfloat16")
    b.add_argument("--workload", default=None, help="for benchmarks that take one (batching): main | held-out")
    b.add_argument("--part", default=None, help="for benchmarks in parts (quant: weights | activations; default both)")
    b.set_defaults(func=_bench)

    d = sub.add_parser("demo", help="chat with SmolLM2, streamed, then report tokens/s")
    d.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or an HF folder")
    d.add_argument("--dtype", default="auto", help="auto (time fp32 and bf16 here, chat in the faster) | "
                                                   "float32 | bfloat16 | float16")
    d.add_argument("--max-tokens", type=int, default=96)
    d.set_defaults(func=_demo)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    model_args(s)
    s.add_argument("--device", default="auto")
    parallel_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the name clients pass as model (default: --model)")
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--max-num-seqs", type=int, default=64, help="requests in one batch at most")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one step at most")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    s.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: 1 GiB of K/V)")
    s.add_argument("--no-chunked-prefill", action="store_true", help="prefill each prompt in one step")
    s.add_argument("--enable-prefix-caching", action="store_true", help="reuse KV blocks of shared prefixes")
    s.add_argument("--prefix-cache", default="hash", choices=("hash", "radix"),
                   help="the index of cached blocks with --enable-prefix-caching: hash (vLLM's chained block "
                        "hashes) | radix (SGLang's radix tree)")
    s.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) | int8 | fp8")
    s.add_argument("--quantization", default=None,
                   help="quantise the weights at start-up (lesson 04): int8 | int4 | nf4 | gptq | awq | w8a8 | fp8")
    s.add_argument("--speculative-method", default=None, choices=("ngram", "draft", "layerskip", "eagle"),
                   help="verify draft tokens inside the batch (lesson 08)")
    s.add_argument("--num-speculative-tokens", type=int, default=5, help="drafts per request and step at most")
    s.add_argument("--speculative-model", default=None,
                   help="eagle: the trained head's file (default: the one `bench eagle` saves)")
    s.add_argument("--speculative-policy", default="adaptive", choices=("adaptive", "always"),
                   help="adaptive: only the drafts that pay at the step's batch size")
    s.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or os.environ.get("MINILLM_API_KEY"),
                   help="/v1/* wants 'Authorization: Bearer KEY' (default: $VLLM_API_KEY, as vLLM, "
                        "or $MINILLM_API_KEY; none: open)")
    s.add_argument("--max-waiting", type=int, default=None,
                   help="requests without a first token beyond which new ones get 429 (default 256)")
    s.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 1 MiB)")
    s.add_argument("--stall-timeout-s", type=float, default=None,
                   help="/health answers 503 after this long without an engine step while requests wait "
                        "(keep it above the longest step: one prefill of --max-num-batched-tokens; default 60)")
    s.set_defaults(func=_serve)

    f = sub.add_parser("figures", help="redraw the lessons' concept figures (lessons/figures/*.png)")
    f.add_argument("--out", default=None, help="folder to write them to (default: lessons/figures)")
    f.add_argument("--quick", action="store_true", help="a tiny random model for the speculative run")
    f.set_defaults(func=_figures)

    from minillm.course.labs import add_lab_parser
    add_lab_parser(sub)                     # lab {list, make, grade}: minillm/course/labs/

    q = sub.add_parser("quiz", help="interview drill: a question, Enter, its answer with the numbers behind it")
    q.add_argument("--lesson", type=int, default=None, help="only this lesson's questions (default: all)")
    q.add_argument("--seed", type=int, default=None, help="shuffle with this seed (default: lesson order)")
    q.add_argument("--lang", default="en", choices=("en", "zh"),
                   help="zh: the article's Chinese question, where there is one")
    q.add_argument("--bank", default=None, help="another question bank in minillm/course/quiz_bank.toml's format")
    q.set_defaults(func=_quiz)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
