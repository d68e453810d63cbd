#!/usr/bin/env node
'use strict';
/*
 * Checks ../ali_ons_roundtrip.js against ./stub_server.js (no real broker
 * needed): the happy path, the driver's fail-fast paths, and the ali-ons
 * behaviours docs/ali-ons-notes.md relies on (each stub variant returns one
 * deliberately wrong reply). Loopback only; about 20 s.
 *
 *   node selftest/run_selftest.js        (from tests/integration/js)
 *
 * Ends with the line "N passed, N failed"; exit status 1 if any failed.
 */
const path = require('path');
const { spawn } = require('child_process');

const DRIVER = path.join(__dirname, '..', 'ali_ons_roundtrip.js');
const STUB = path.join(__dirname, 'stub_server.js');

function startStub(variant, topics) {
  return new Promise((resolve, reject) => {
    const env = Object.assign({}, process.env, { STUB_VARIANT: variant || '', STUB_TOPICS: topics || '' });
    const child = spawn(process.execPath, [ STUB ], { env, stdio: [ 'ignore', 'pipe', 'pipe' ] });
    let out = '';
    let err = '';
    const timer = setTimeout(() => { child.kill('SIGKILL'); reject(new Error('stub did not start')); }, 5000);
    child.stdout.on('data', d => {
      out += d;
      const nl = out.indexOf('\n');
      if (nl >= 0) {
        clearTimeout(timer);
        resolve({
          addrs: JSON.parse(out.slice(0, nl)),
          stop: () => new Promise(r => {
            child.once('exit', () => {
              const m = /codes seen (\[.*\])/.exec(err);
              r(m ? JSON.parse(m[1]) : null);
            });
            child.kill('SIGTERM');
          }),
        });
      }
    });
    child.stderr.on('data', d => { err += d; });
    child.once('error', reject);
  });
}

function runDriver(args, env) {
  return new Promise(resolve => {
    const t0 = Date.now();
    const child = spawn(process.execPath, [ DRIVER ].concat(args), {
      env: Object.assign({}, process.env, env || {}),
      stdio: [ 'ignore', 'pipe', 'pipe' ],
    });
    let out = '';
    let err = '';
    child.stdout.on('data', d => { out += d; });
    child.stderr.on('data', d => { err += d; });
    const killer = setTimeout(() => child.kill('SIGKILL'), 60000);
    child.once('exit', code => {
      clearTimeout(killer);
      const lines = [];
      for (const l of out.split('\n')) {
        if (!l.trim()) continue;
        try { lines.push(JSON.parse(l)); } catch (_) { lines.push({ unparsable: l }); }
      }
      resolve({ code, lines, final: lines[lines.length - 1] || {}, stderr: err, ms: Date.now() - t0, stdout: out });
    });
  });
}

const cases = [
  {
    name: 'round trip of 20 messages succeeds',
    topics: 'T1',
    args: [ '--topic', 'T1', '--count', '20', '--timeout-ms', '20000' ],
    check: r => r.code === 0 && r.final.ok === true && r.final.sent === 20 && r.final.received.length === 20 &&
      r.lines.filter(l => l.event === 'send' && l.ok).length === 20 &&
      r.lines.filter(l => l.event === 'receive' && l.tags === 'TagA').length === 20,
  },
  {
    name: 'unknown topic: name server code 17 fails the first send (no TBW102 fallback)',
    args: [ '--topic', 'T2', '--count', '2', '--timeout-ms', '10000' ],
    check: (r, codes) => r.code === 1 && r.final.error && r.final.error.code === 17 &&
      JSON.stringify(codes) === '[105]',
  },
  {
    name: '--create-topic creates the topic through the TBW102 route, then round trip',
    args: [ '--topic', 'T3', '--count', '3', '--create-topic', '--timeout-ms', '10000' ],
    check: (r, codes) => r.code === 0 && r.final.ok === true && codes.includes(17),
  },
  {
    name: 'code 0 with empty route body: producer falls back to TBW102, consumer gets no queues',
    variant: 'emptyroute',
    args: [ '--topic', 'T4', '--count', '2', '--timeout-ms', '4000' ],
    check: r => r.code === 1 && r.final.sent === 2 && r.final.received.length === 0 &&
      r.final.error && r.final.error.name === 'Timeout',
  },
  {
    name: 'ROCKETMQ (binary) reply header: ali-ons cannot parse it and drops the connection',
    variant: 'binary',
    topics: 'T5',
    args: [ '--topic', 'T5', '--count', '1', '--timeout-ms', '6000' ],
    check: r => r.code === 1 && r.final.sent === 0 && /SyntaxError/.test(r.stderr),
  },
  {
    name: 'reply without the response flag bit is not matched: request times out (3 s)',
    variant: 'noflag',
    topics: 'T6',
    args: [ '--topic', 'T6', '--count', '1', '--timeout-ms', '8000' ],
    check: r => r.code === 1 && r.final.error && r.final.error.name === 'ResponseTimeoutError',
  },
  {
    name: 'PULL code 0 with no body: ali-ons errors and retries every 3 s, never consumes',
    variant: 'emptyfound',
    topics: 'T7',
    args: [ '--topic', 'T7', '--count', '2', '--timeout-ms', '4000' ],
    check: r => r.code === 1 && r.final.sent === 2 && r.final.received.length === 0 &&
      /reading 'length'/.test(r.stderr),
  },
  {
    name: 'wrong MAGICCODE and BODYCRC in records: ali-ons does not check them',
    variant: 'badmagic',
    topics: 'T8',
    args: [ '--topic', 'T8', '--count', '3', '--timeout-ms', '10000' ],
    check: r => r.code === 0 && r.final.ok === true,
  },
  {
    name: 'non-loopback broker address in a route is refused, never dialled',
    variant: 'nonloop',
    topics: 'T9',
    args: [ '--topic', 'T9', '--count', '1', '--timeout-ms', '6000' ],
    check: r => r.code === 1 && r.final.error && r.final.error.name === 'NonLoopbackAddressError',
  },
  {
    name: 'no name server listening: fails fast',
    noStub: true,
    args: [ '--namesrv', '127.0.0.1:1', '--timeout-ms', '10000' ],
    check: r => r.code === 1 && r.final.error && r.final.error.name === 'NameServerUnreachable' && r.ms < 5000,
  },
  {
    name: 'tx mode reports unsupported (exit 2)',
    noStub: true,
    args: [ '--mode', 'tx' ],
    check: r => r.code === 2 && r.final.unsupported === true,
  },
  {
    name: '--help exits 0',
    noStub: true,
    args: [ '--help' ],
    check: r => r.code === 0 && /usage:/.test(r.stdout),
  },
];

(async () => {
  let passed = 0;
  let failed = 0;
  for (const c of cases) {
    let stub = null;
    let codes = null;
    let r;
    try {
      let args = c.args;
      if (!c.noStub) {
        stub = await startStub(c.variant, c.topics);
        args = [ '--namesrv', stub.addrs.namesrv ].concat(args);
      }
      r = await runDriver(args);
      if (stub) codes = await stub.stop();
      if (c.check(r, codes || [])) {
        passed++;
        process.stdout.write(`ok - ${c.name} (${r.ms} ms)\n`);
        continue;
      }
    } catch (err) {
      r = r || { code: null, final: { harness_error: String(err) }, stderr: '' };
      if (stub && !codes) await stub.stop().catch(() => {});
    }
    failed++;
    process.stdout.write(`not ok - ${c.name}\n  exit=${r.code} final=${JSON.stringify(r.final)}\n` +
      `  stub codes=${JSON.stringify(codes)}\n  stderr tail: ${String(r.stderr).slice(-800)}\n`);
  }
  process.stdout.write(`${passed} passed, ${failed} failed\n`);
  process.exit(failed ? 1 : 0);
})();
