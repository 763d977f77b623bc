"""Speculative decoding (n-gram and grammar drafts): tokens/s with and without it, in the same run, on
three prompt sets the project writes from its own files.

- ``grounded``: input-grounded tasks (repeat, quote, reformat a given text or code) over the
  project's documentation and source files, where the answer copies from the prompt;
- ``structured``: JSON output under a schema that forces its keys (the grammar's forced tokens,
  keys, quotes and colons, are drafted, composed with the n-gram drafts);
- ``chat``: open-ended questions, whose answers seldom repeat the prompt.

One engine (``--speculative all``) serves both arms: each request says ``speculative="off"`` or
``"auto"`` (SamplingParams), so the arms share the model, the cache sizing and the start-up
step-cost table; they alternate (off, on, off, on) per set and batch size, prefix caching off so
that neither finds the other's prompts cached. Greedy, so the two arms
must give the same tokens: the table says whether they did. Per set and batch size (1 = one stream,
then ``--batches``): output tok/s off and on and their ratio (the whole requests, prefill
included), the same after each request's first token (per stream, 1 / TPOT: the part speculation
acts on; on this CPU a ~300-token prompt's prefill takes as long as ~30 plain decode steps), the
acceptance rate and mean accepted length. For the sets without a schema, at one stream, also the
bound of the n-gram drafter: what the speedup would be if every step verified exactly the drafts
that the outputs show would be kept (no draft wasted, none missed), at the measured step costs
(``oracle_decode_speedup``; ``oracle_speedup`` with the off arm's prefill time added to both).
``--peer llama.cpp`` then runs llama-server (the peers' build, ``make bench-peers``) on the bundled
GGUF, plain, one stream, on each set's single-stream prompts for the tokens kvserve gave each, and
prints kvserve's ratio to it with and without speculation.

    python -m kvserve.benchmarks.speculative [--dtype bfloat16] [--quantization int4]
        [--batches 1 8 32] [--sets grounded structured chat] [--max-tokens 128] [--rounds 2]
        [--peer llama.cpp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvserve.benchmarks import write_json
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.spec_decode.ngram import NgramIndex

ROOT = Path(__file__).resolve().parent.parent
MATERIAL = ["docs/design/architecture.md", "docs/serving/grpc.md", "docs/performance/tuning.md",
            "engine/core/scheduler.py", "engine/core/block_manager.py", "engine/spec_decode/ngram.py",
            "engine/sampling_params.py", "engine/tokenizer/detokenizer.py"]
GROUNDED_TASKS = ["Repeat the following text exactly, word for word.",
                  "Copy the following code, unchanged.",
                  "Quote the first paragraph of the following text.",
                  "Rewrite the following text as a Markdown bullet list, keeping its sentences."]
CHAT = ["Tell me a story about a lighthouse keeper.", "What should I pack for a week of hiking?",
        "Why is the sky blue?", "Give me three ideas for a birthday party.", "How do bees make honey?",
        "Write a short poem about autumn.", "What is a good way to learn a new language?",
        "Describe your ideal weekend."]
SCHEMA = json.dumps({
    "type": "object",
    "properties": {"title": {"type": "string"}, "summary": {"type": "string"},
                   "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                   "difficulty": {"type": "string", "enum": ["easy", "medium", "hard"]}},
    "required": ["title", "summary", "keywords", "difficulty"], "additionalProperties": False})


def _excerpts(count: int, chars: int = 900) -> list[str]:
    """``count`` excerpts of the project's own files, cycling through them."""
    texts = [(ROOT / path).read_text() for path in MATERIAL]
    return [texts[i % len(texts)][(i // len(texts)) * chars:][:chars] for i in range(count)]


def prompt_set(llm: LLM, name: str, count: int) -> tuple[list[list[int]], dict]:
    """(prompt ids, extra SamplingParams fields) of a set, rendered with the chat template."""
    def chat(text: str) -> list[int]:  # the text as it is where the model has no chat template
        if getattr(llm.tokenizer, "chat_template", None) is None:
            return llm.engine.encode_prompt(text)
        return llm.engine.apply_chat_template([{"role": "user", "content": text}])
    if name == "grounded":
        return [chat(f"{GROUNDED_TASKS[i % len(GROUNDED_TASKS)]}\n\n{text}")
                for i, text in enumerate(_excerpts(count))], {}
    if name == "structured":
        task = "Describe this file as JSON with a title, a summary, keywords and a difficulty."
        return [chat(f"{task}\n\n{text}") for text in _excerpts(count, 500)], {"json_schema": SCHEMA}
    return [chat(CHAT[i % len(CHAT)]) for i in range(count)], {}


def run_arm(llm: LLM, prompts: list[list[int]], batch: int,
            params: SamplingParams) -> tuple[list, float, dict, float]:
    """Generate ``prompts`` ``batch`` at a time; (token ids, seconds, spec counters' increase,
    seconds the requests spent after their first token, summed)."""
    before = llm.stats()
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    decoding = sum(max(0.0, o.times.finished - o.times.first_token) for o in outputs)
    grown = {k: getattr(after, k) - getattr(before, k) for k in keys}
    return [o.token_ids for o in outputs], seconds, grown, decoding


def measure(llm: LLM, sets: list[str], batches: list[int], max_tokens: int, requests: int,
            rounds: int = 2, singles: dict | None = None) -> list[dict]:
    """The rows; ``singles`` (when given) gets each set's single-stream prompts and the number of
    tokens each one gave, for the llama.cpp peer."""
    rows = []
    for name in sets:
        for batch in batches:
            prompts, extra = prompt_set(llm, name, max(requests, batch))
            # untimed: a structured set's first request compiles its schema's grammar (cached after)
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, **extra), use_tqdm=False)
            arms = {"off": [None, 0.0, None, 0.0], "auto": [None, 0.0, None, 0.0]}
            for _ in range(rounds):  # off, on, off, on: drift on a shared machine hits both arms
                for mode, arm in arms.items():
                    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative=mode, **extra)
                    ids, seconds, spec, decoding = run_arm(llm, prompts, batch, params)
                    arm[0], arm[1], arm[2], arm[3] = ids, arm[1] + seconds, spec, arm[3] + decoding
            (off_ids, off_s, _, off_decoding), (on_ids, on_s, spec, on_decoding) = arms["off"], arms["auto"]
            out_tokens = sum(map(len, on_ids))
            if batch == 1 and singles is not None:
                singles[name] = (prompts, [len(ids) for ids in on_ids])
            drafts, drafted, accepted = spec.values()
            if batch == 1 and not extra and off_decoding:  # n-gram drafts alone: their bound
                bound = oracle_decode_speedup(llm, prompts, on_ids)
                rows_bound = {"oracle_decode_speedup": bound,
                              "oracle_speedup": off_s / (off_s - off_decoding + off_decoding / bound)}
            else:
                rows_bound = {}
            after_first = rounds * (out_tokens - len(on_ids))  # tokens after each request's first
            rows.append({
                "set": name, "batch": batch, "requests": len(prompts), "output_tokens": out_tokens,
                "tok_s_off": rounds * sum(map(len, off_ids)) / off_s, "tok_s_on": rounds * out_tokens / on_s,
                "speedup": off_s / on_s * out_tokens / max(1, sum(map(len, off_ids))),
                # per stream after the first token (1 / TPOT), when both arms gave the same tokens
                "decode_tok_s_off": after_first / off_decoding if off_decoding else 0.0,
                "decode_tok_s_on": after_first / on_decoding if on_decoding else 0.0,
                "decode_speedup": off_decoding / on_decoding if on_decoding else 0.0,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
                "same_tokens": on_ids == off_ids, **rows_bound,
            })
            print(_line(rows[-1]), flush=True)
    return rows


def oracle_decode_speedup(llm: LLM, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """The most any choice of draft lengths could gain after the first token, one stream, with the
    engine's prompt-lookup drafter (its n-gram lengths and cap) and its step costs c(n): knowing
    the outputs, each step verifies exactly the drafts that will be kept, paying c(kept + 1) for
    kept + 1 tokens, where plain decoding pays c(1) a token."""
    spec = llm.engine.speculator
    cost = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        index, pos = NgramIndex(spec.min_n, spec.max_n), 1  # the first token comes with the prefill
        while pos < len(out):
            drafts, _ = index.propose(prompt + out[:pos], spec.max_drafts)
            kept = 0
            while kept < min(len(drafts), len(out) - pos - 1) and drafts[kept] == out[pos + kept]:
                kept += 1
            cost, pos = cost + spec.costs(kept + 1) / spec.costs(1), pos + kept + 1
    return sum(len(out) - 1 for out in outputs) / cost if cost else 0.0


def llama_single_stream(singles: dict, timeout: float = 900.0) -> dict[str, float]:
    """llama-server (the peers' build, ``make bench-peers``) on the bundled GGUF, on each set's
    single-stream prompts one at a time, greedy, each for as many tokens as kvserve gave it (EOS
    ignored): output tokens/s per set, prefill included as in kvserve's arms."""
    import asyncio

    from kvserve.benchmarks.peers import dialects, servers, setup
    from kvserve.benchmarks.serving.load import Request, drive
    from kvserve.benchmarks.serving.report import summarize
    from kvserve.engine.model_loader.source import resolve_model

    paths = setup.peers_dir()
    if lacking := setup.missing("llama.cpp", paths):
        raise SystemExit(f"--peer llama.cpp: missing {', '.join(lacking)}; set it up once with "
                         f"{setup.SETUP_HINT}")
    longest = max(len(p) for prompts, _ in singles.values() for p in prompts)
    most = max(n for _, lengths in singles.values() for n in lengths)
    server = servers.llama_server(paths.llama_server, resolve_model("default").gguf_path, 1,
                                  servers.slot_context(longest, most), timeout)
    rates = {}
    with server:
        def one(req):
            return dialects.stream_llama(server.host, server.port, req, 0.0)
        asyncio.run(one(Request(list(range(1000, 1008)), 2, 0.0)))  # warm-up
        for name, (prompts, lengths) in singles.items():
            work = [Request(p, n, 0.0) for p, n in zip(prompts, lengths, strict=True)]
            rates[name] = summarize(*asyncio.run(drive(work, 1, one)))["output_tokens_per_s"]
    return rates


def _line(r: dict) -> str:
    return (f"{r['set']:<11} batch {r['batch']:>3}: off {r['tok_s_off']:7.1f} tok/s, "
            f"on {r['tok_s_on']:7.1f} tok/s, {r['speedup']:.2f}x "
            f"(after the first token: {r['decode_speedup']:.2f}x, "
            f"{r['decode_tok_s_off']:.1f} -> {r['decode_tok_s_on']:.1f} tok/s per stream); "
            f"acceptance {r['acceptance_rate']:.2f}, "
            f"mean accepted length {r['mean_accepted_length']:.2f}; same tokens: {r['same_tokens']}"
            + (f"\n{'':<11} bound with these drafts and step costs: {r['oracle_decode_speedup']:.2f}x "
               f"after the first token, {r['oracle_speedup']:.2f}x whole" if "oracle_speedup" in r else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=("int8", "int4"))
    ap.add_argument("--sets", nargs="+", default=["grounded", "structured", "chat"],
                    choices=("grounded", "structured", "chat"))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=4, help="requests per set (at least the batch size)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2,
                    help="off/on rounds per set and batch size, alternating (more: less of a noisy "
                         "machine's drift in the ratios)")
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--speculative", default="all", choices=("ngram", "grammar", "all"),
                    help="the draft sources of the 'on' arm")
    ap.add_argument("--peer", default="none", choices=("llama.cpp", "none"),
                    help="also run llama-server's plain single stream on each set's batch-1 prompts (the "
                         "bundled model's GGUF; set up by make bench-peers)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.peer == "llama.cpp" and (args.model != "default" or 1 not in args.batches):
        ap.error("--peer llama.cpp: the bundled model (--model default) and a single stream "
                 "(--batches 1 ...)")
    # no prefix caching: the arms run the same prompts, and the second must not find them cached;
    # no step time bound: it splits prefills by measured step times, and a prompt token's attention
    # rounds by how its chunk is tiled, so the arms could differ at near-ties for that alone
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, speculative=args.speculative,
              num_speculative_tokens=args.num_speculative_tokens, max_num_seqs=max(args.batches),
              enable_prefix_caching=False, max_step_time_ms=0)
    try:
        print(f"step costs c(n): {llm.engine.speculator.costs.relative()}", flush=True)
        singles: dict = {}
        rows = measure(llm, args.sets, args.batches, args.max_tokens, args.requests, rounds=args.rounds,
                       singles=singles)
    finally:
        llm.shutdown()
    if args.peer == "llama.cpp":
        for name, rate in llama_single_stream(singles).items():
            row = next(r for r in rows if r["set"] == name and r["batch"] == 1)
            row["llamacpp_tok_s"], row["on_over_llamacpp"] = rate, row["tok_s_on"] / rate
            print(f"{name:<11} llama-server single stream {rate:7.1f} tok/s; kvserve with speculation "
                  f"{row['on_over_llamacpp']:.2f}x, without {row['tok_s_off'] / rate:.2f}x", flush=True)
    write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
