#!/usr/bin/env node
// kvserve from Node.js: streams a completion token by token, then prints usage and timing.
//
//   npm install
//   node client.js --target 127.0.0.1:50051 --prompt "Write a haiku about the sea." --max-tokens 32
//   node client.js --logprobs 2 ...   then one line per token: id, text, log probability, top 2
//   node client.js --cache-salt TEAM ...   share prefix-cache blocks only with requests of this salt
//   node client.js --speculative off --max-draft-tokens 4 ...   speculative decoding per request
//   node client.js --json ...    one JSON line per message (what tests read)
//   node client.js --stats       the Stats RPC
//   node client.js --tls-ca ca.pem [--tls-cert client.pem --tls-key client.key] ...   TLS / mutual TLS
//   node client.js --api-key KEY ...   (or KVSERVE_API_KEY) for a server run with --api-key
//
// The .proto is loaded at run time (no code generation): ../../proto/kvserve/v1/llm.proto.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO = path.join(__dirname, '..', '..', 'proto', 'kvserve', 'v1', 'llm.proto');

function parseArgs(argv) {
  const opts = {
    target: '127.0.0.1:50051', prompt: 'Hello!', maxTokens: 32, temperature: 0, json: false,
    apiKey: process.env.KVSERVE_API_KEY,
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--target') opts.target = argv[++i];
    else if (a === '--prompt') opts.prompt = argv[++i];
    else if (a === '--max-tokens') opts.maxTokens = Number(argv[++i]);
    else if (a === '--temperature') opts.temperature = Number(argv[++i]);
    else if (a === '--logprobs') opts.logprobs = Number(argv[++i]);
    else if (a === '--cache-salt') opts.cacheSalt = argv[++i];
    else if (a === '--speculative') opts.speculative = argv[++i];
    else if (a === '--max-draft-tokens') opts.maxDraftTokens = Number(argv[++i]);
    else if (a === '--json') opts.json = true;
    else if (a === '--stats') opts.stats = true;
    else if (a === '--tls') opts.tls = true;
    else if (a === '--tls-ca') opts.tlsCa = argv[++i];
    else if (a === '--tls-cert') opts.tlsCert = argv[++i];
    else if (a === '--tls-key') opts.tlsKey = argv[++i];
    else if (a === '--api-key') opts.apiKey = argv[++i];
    else throw new Error(`unknown argument ${a}`);
  }
  return opts;
}

function loadService() {
  const definition = protoLoader.loadSync(PROTO, {
    keepCase: true, // field names as in the .proto: max_tokens, token_ids, finish_reason
    longs: Number,
    enums: String, // finish_reason arrives as "STOP", "LENGTH", ...
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).kvserve.v1.LLMService;
}

// TLS when any --tls* flag is given (the CA file, else the system roots; a client certificate
// for mutual TLS), plaintext otherwise.
function credentials(opts) {
  if (!(opts.tls || opts.tlsCa || opts.tlsCert || opts.tlsKey)) return grpc.credentials.createInsecure();
  const read = (file) => (file ? fs.readFileSync(file) : null);
  return grpc.credentials.createSsl(read(opts.tlsCa), read(opts.tlsKey), read(opts.tlsCert));
}

// The API key travels as call metadata: authorization: Bearer <key>.
function metadata(opts) {
  const md = new grpc.Metadata();
  if (opts.apiKey) md.set('authorization', `Bearer ${opts.apiKey}`);
  return md;
}

function stats(client, opts) {
  client.Stats({}, metadata(opts), (err, reply) => {
    if (err) fail(err);
    console.log(JSON.stringify(reply));
    client.close();
  });
}

// The table `kvserve generate --logprobs` prints: per token its id, its text (TokenLogprob.token:
// the token decoded alone, as a JSON string), its log probability and the top alternatives (id,
// text and log probability each).
function logprobTable(rows) {
  const quoted = (token) => JSON.stringify(token);
  const lines = [`${'id'.padStart(7)} ${'token'.padEnd(16)} ${'logprob'.padStart(8)}   top alternatives`];
  for (const lp of rows) {
    const top = lp.top.map((t) => `${t.token_id} ${quoted(t.token)} ${t.logprob.toFixed(3)}`).join(', ');
    lines.push(`${String(lp.token_id).padStart(7)} ${quoted(lp.token).padEnd(16)} ` +
      `${lp.logprob.toFixed(3).padStart(8)}   ${top}`);
  }
  return lines.join('\n');
}

function stream(client, opts) {
  const sampling = { temperature: opts.temperature, max_tokens: opts.maxTokens };
  if (opts.logprobs !== undefined) sampling.logprobs = opts.logprobs;
  if (opts.cacheSalt !== undefined) sampling.cache_salt = opts.cacheSalt;
  if (opts.speculative !== undefined) sampling.speculative = opts.speculative;
  if (opts.maxDraftTokens !== undefined) sampling.max_draft_tokens = opts.maxDraftTokens;
  const call = client.Stream({ prompt: opts.prompt, sampling }, metadata(opts));
  const logprobs = [];
  call.on('data', (msg) => {
    if (opts.json) {
      console.log(JSON.stringify(msg));
    } else {
      process.stdout.write(msg.text);
      logprobs.push(...msg.logprobs);
      if (msg.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
        const u = msg.usage;
        const t = msg.timing;
        console.error(`\n[${msg.finish_reason}: ${u.prompt_tokens} prompt + ${u.completion_tokens} ` +
          `completion tokens, ${u.accepted_draft_tokens}/${u.draft_tokens} drafts accepted, ` +
          `ttft ${t.ttft_ms.toFixed(0)} ms, total ${t.total_ms.toFixed(0)} ms]`);
      }
    }
  });
  call.on('error', fail);
  call.on('end', () => {
    if (opts.logprobs && !opts.json) console.log(`\n${logprobTable(logprobs)}`);
    client.close();
  });
}

function fail(err) {
  // err.code is a grpc.status number; err.details the server's message (it names the field).
  console.error(`kvserve error ${grpc.status[err.code]}: ${err.details}`);
  process.exit(1);
}

function main() {
  const opts = parseArgs(process.argv.slice(2));
  const LLMService = loadService();
  const client = new LLMService(opts.target, credentials(opts));
  if (opts.stats) stats(client, opts);
  else stream(client, opts);
}

main();
