// llama.cpp (through node-llama-cpp) as the single-stream peer of benchmarks/single_stream.py:
// requests one at a time, greedy, a fixed number of new tokens each, on the CPU, with the thread
// count the kvserve run used. Prints one JSON line of results on stdout.
//
//   node single_stream.mjs MODEL.gguf --threads N [--requests FILE] < requests.json
//
// Requests (FILE, or stdin when no FILE is given):
//   {"requests": [{"prompt": [token ids] | "text", "max_tokens": N}, ...]}
// Token ids go in as they are (no BOS added, as kvserve takes a list of ids); a text prompt is
// tokenized by the model's tokenizer with its special tokens.
//
// What is timed: each request from handing its prompt to llama.cpp until its last new token
// (prefill included, as kvserve's figure is), not the model load, the context creation, one
// warm-up request, or clearing the sequence between requests. End-of-generation tokens do not
// stop a request: `yieldEogToken` makes llama.cpp hand them out and decode on from them, as
// kvserve's ignore_eos does, so every request makes exactly max_tokens tokens.
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";

import { getLlama, LlamaLogLevel } from "node-llama-cpp";

const WARMUP = { prompt: [1, 2, 3], max_tokens: 4 };

function fail(message) {
    process.stderr.write(`single_stream.mjs: ${message}\n`);
    process.exit(2);
}

function parseCommandLine(argv) {
    const { values, positionals } = parseArgs({
        args: argv,
        allowPositionals: true,
        options: { threads: { type: "string" }, requests: { type: "string" } },
    });
    if (positionals.length !== 1) fail("expected exactly one argument, the GGUF file");
    const threads = Number(values.threads);
    if (!Number.isInteger(threads) || threads < 1) fail(`--threads must be an integer >= 1, got ${values.threads}`);
    const text = readFileSync(values.requests ?? 0, "utf8"); // fd 0: stdin
    return { modelPath: positionals[0], threads, requests: checkRequests(JSON.parse(text).requests) };
}

function checkRequests(requests) {
    if (!Array.isArray(requests) || requests.length === 0) fail("'requests' must be a non-empty list");
    requests.forEach((r, i) => {
        const idsOk = Array.isArray(r.prompt) && r.prompt.length > 0 && r.prompt.every(Number.isInteger);
        const textOk = typeof r.prompt === "string" && r.prompt.length > 0;
        if (!idsOk && !textOk) fail(`requests[${i}].prompt must be a non-empty list of token ids or a string`);
        if (!Number.isInteger(r.max_tokens) || r.max_tokens < 1) fail(`requests[${i}].max_tokens must be an integer >= 1`);
    });
    return requests;
}

// One request on a cleared sequence: its new tokens and when the first and the last came.
async function generate(sequence, prompt, maxTokens) {
    await sequence.clearHistory();
    const tokens = [];
    const start = performance.now();
    let firstAt = start;
    for await (const token of sequence.evaluate(prompt, { temperature: 0, yieldEogToken: true })) {
        if (tokens.length === 0) firstAt = performance.now();
        tokens.push(token);
        if (tokens.length === maxTokens) break;
    }
    return { tokens, start, firstAt, end: performance.now() };
}

async function main() {
    const { modelPath, threads, requests } = parseCommandLine(process.argv.slice(2));
    // maxThreads 0: the context's thread count is then the count used, not a hint under a cap
    // that defaults to max(cpuMathCores, 4). build "never": use the prebuilt binary, never
    // download or compile llama.cpp.
    const llama = await getLlama({ gpu: false, build: "never", maxThreads: 0, logLevel: LlamaLogLevel.error });
    const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
    const prompts = requests.map((r) => (typeof r.prompt === "string" ? model.tokenize(r.prompt, true) : r.prompt));
    const longest = Math.max(...prompts.map((p, i) => p.length + requests[i].max_tokens));
    const context = await model.createContext({ contextSize: longest + 16, sequences: 1, threads });
    const sequence = context.getSequence();
    await generate(sequence, WARMUP.prompt, WARMUP.max_tokens);

    const runs = [];
    for (const [i, prompt] of prompts.entries()) runs.push(await generate(sequence, prompt, requests[i].max_tokens));
    const seconds = runs.reduce((s, r) => s + (r.end - r.start), 0) / 1000;
    const decodeSeconds = runs.reduce((s, r) => s + (r.end - r.firstAt), 0) / 1000;
    const outputTokens = runs.reduce((s, r) => s + r.tokens.length, 0);
    const packageJson = new URL("./node_modules/node-llama-cpp/package.json", import.meta.url);
    const result = {
        engine: "llama.cpp",
        node_llama_cpp: JSON.parse(readFileSync(packageJson, "utf8")).version,
        llama_cpp_release: llama.llamaCppRelease.release,
        build: llama.buildType,
        system_info: llama.systemInfo,
        model: modelPath,
        threads: context.currentThreads,
        requests: runs.length,
        prompt_tokens: prompts.reduce((s, p) => s + p.length, 0),
        output_tokens: outputTokens,
        seconds,
        output_tok_s: outputTokens / seconds,
        // after each request's first token: the decode steps alone, llama-bench's "tg" figure
        decode_tok_s: decodeSeconds > 0 ? (outputTokens - runs.length) / decodeSeconds : null,
        token_ids: runs.map((r) => r.tokens),
    };
    process.stdout.write(JSON.stringify(result) + "\n");
    await context.dispose();
    await model.dispose();
    await llama.dispose();
}

main().catch((error) => fail(error?.stack ?? String(error)));
