#!/usr/bin/env node
'use strict';
/*
 * Sends N messages with the stock ali-ons 3.12.0 Producer and reports each, for the failover tests.
 *
 * usage: node ali_ons_sender.js --namesrv HOST:PORT --topic T --count N [--pause-after K]
 *                               [--producer-group G] [--poll-ms MS] [--deliver-at-ms MS]
 *
 * stdout: one JSON line per send {"event":"send","i","ok","brokerName","queueId","error"}; with
 * --pause-after K, after the K-th acknowledged send one {"event":"paused"} line, then nothing is sent
 * until a line arrives on stdin (the test kills a broker meanwhile); last {"event":"done","ok","failed"}.
 * --deliver-at-ms: each message asks to be delivered at that wall-clock time (msg.setStartDeliverTime).
 * A failed send is reported and the run goes on (ali-ons has already retried it on another broker).
 * Only loopback is ever connected to (every TCP connect is checked); ali-ons' HTTP name-server lookup
 * is refused. Exit 0 when every send succeeded, 1 otherwise, 2 on bad arguments.
 */
const net = require('net');
const readline = require('readline');

function isLoopback(host) {
  return host === 'localhost' || host === '::1' || /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(host);
}

const realConnect = net.connect;
function guardedConnect(...args) {
  let opts = args[0];
  if (typeof opts !== 'object' || opts === null) opts = { port: args[0], host: args[1] };
  if (!opts.path && !isLoopback(opts.host || 'localhost')) {
    throw new Error(`refusing to connect to non-loopback address ${opts.host}:${opts.port}`);
  }
  return realConnect.apply(net, args);
}
net.connect = guardedConnect;
net.createConnection = guardedConnect;

function parseArgs(argv) {
  const o = { namesrv: '', topic: '', count: 0, pauseAfter: 0, producerGroup: 'PID_txmq_failover', pollMs: 30000,
    deliverAtMs: 0 };
  const keys = { '--namesrv': 'namesrv', '--topic': 'topic', '--count': 'count', '--pause-after': 'pauseAfter',
    '--producer-group': 'producerGroup', '--poll-ms': 'pollMs', '--deliver-at-ms': 'deliverAtMs' };
  for (let i = 0; i < argv.length; i++) {
    const k = keys[argv[i]];
    if (!k || argv[i + 1] === undefined) throw new Error(`bad argument ${argv[i]}`);
    o[k] = argv[++i];
  }
  for (const k of [ 'count', 'pauseAfter', 'pollMs', 'deliverAtMs' ]) o[k] = Number(o[k]);
  const host = o.namesrv.split(':')[0];
  if (!isLoopback(host) || !o.topic || !(o.count > 0)) throw new Error('need a loopback --namesrv, --topic and --count');
  return o;
}

function out(obj) {
  process.stdout.write(JSON.stringify(obj) + '\n');
}

async function main() {
  let opts;
  try {
    opts = parseArgs(process.argv.slice(2));
  } catch (err) {
    process.stderr.write(`error: ${err.message}\n`);
    process.exit(2);
  }
  const lines = readline.createInterface({ input: process.stdin });
  const nextLine = () => new Promise(resolve => lines.once('line', resolve));
  const ons = require('ali-ons');
  const quiet = () => {};
  const producer = new ons.Producer({
    httpclient: { async request() { throw new Error('HTTP name-server lookup refused'); } },
    nameSrv: opts.namesrv,
    producerGroup: opts.producerGroup,
    clientIP: '127.0.0.1',
    connectTimeout: 3000,
    pollNameServerInteval: opts.pollMs,
    logger: { info: quiet, debug: quiet, warn: quiet, error: (...a) => process.stderr.write(a.join(' ') + '\n') },
  });
  producer.on('error', err => process.stderr.write(`[producer error] ${err && err.message}\n`));
  await producer.ready();
  let ok = 0;
  let failed = 0;
  for (let i = 0; i < opts.count; i++) {
    const msg = new ons.Message(opts.topic, 'TagA', `failover-${i}`);
    if (opts.deliverAtMs) msg.setStartDeliverTime(opts.deliverAtMs);
    try {
      const r = await producer.send(msg);
      const good = r.sendStatus === 'SEND_OK';
      good ? ok++ : failed++;
      out({ event: 'send', i, ok: good, brokerName: r.messageQueue.brokerName, queueId: r.messageQueue.queueId });
    } catch (err) {
      failed++;
      out({ event: 'send', i, ok: false, error: String(err && err.message) });
    }
    if (opts.pauseAfter && ok === opts.pauseAfter && i + 1 < opts.count && !opts.paused) {
      opts.paused = true;
      out({ event: 'paused', i });
      await nextLine();
    }
  }
  out({ event: 'done', ok, failed });
  lines.close();
  await Promise.race([ producer.close(), new Promise(r => setTimeout(r, 5000)) ]);
  process.exit(failed ? 1 : 0);
}

main().catch(err => {
  out({ event: 'done', ok: 0, failed: -1, error: String(err && err.message) });
  process.exit(1);
});
