#!/usr/bin/env node
'use strict';
/*
 * Round trip through a txmq name server + broker with the stock npm client
 * ali-ons 3.12.0 (pure JavaScript RocketMQ 4.x remoting client).
 *
 * Sends N messages (tag TagA, distinct keys and bodies) with an ali-ons
 * Producer, then consumes them with an ali-ons push Consumer
 * (CONSUME_FROM_FIRST_OFFSET, subscription '*') until every body has been
 * seen or the deadline passes.
 *
 * stdout: JSON lines only. One {"event":"send",...} line per send, one
 * {"event":"receive",...} line per message of this run, then one final line
 * {"sent":N,"received":[bodies],"ok":bool,...}. Diagnostics go to stderr.
 *
 * Exit status: 0 ok; 1 failure or timeout; 2 bad arguments or an
 * unsupported mode (`tx`: ali-ons 3.12.0 has no transactional producer).
 *
 * Only loopback addresses are ever connected to: the name server address
 * must be loopback, ali-ons' HTTP name-server lookup (Aliyun address server)
 * is never used because `nameSrv` is set and the `httpclient` handed to
 * ali-ons refuses every request, and every TCP connect is checked, so a
 * broker address advertised by the name server that is not loopback aborts
 * the run instead of being dialled.
 *
 * Run `node ali_ons_roundtrip.js --help` for options.
 */

const net = require('net');
const util = require('util');

const USAGE = `usage: node ali_ons_roundtrip.js [options]

  --mode MODE            roundtrip (default) | tx                [ONS_MODE]
  --namesrv HOST:PORT    name server, loopback only (127.0.0.1:9876)
                                                                 [ONS_NAMESRV]
  --topic NAME           topic (TxmqJsRoundtrip)                 [ONS_TOPIC]
  --producer-group NAME  producer group (PID_txmq_js)   [ONS_PRODUCER_GROUP]
  --consumer-group NAME  consumer group (CID_txmq_js_<run id>, new each run,
                         so consumption starts at offset 0)
                                                        [ONS_CONSUMER_GROUP]
  --count N              messages to send (10)                   [ONS_COUNT]
  --timeout-ms MS        deadline for the whole run (60000); closing the
                         clients afterwards is bounded by 5000 more
                                                            [ONS_TIMEOUT_MS]
  --create-topic         before sending, ask each master broker in the
                         TBW102 route to create the topic (UPDATE_AND_CREATE_
                         TOPIC, code 17) and wait for the name server to know
                         it; ali-ons never falls back to TBW102 itself
                                                  [ONS_CREATE_TOPIC=1]
  --queues N             queue count for --create-topic (4)     [ONS_QUEUES]
  --verbose              also print ali-ons' info/debug log to stderr
                                                          [ONS_VERBOSE=1]
  -h, --help             this text

ONS_ACCESS_KEY / ONS_SECRET_KEY: sign every request with these credentials (broker ACL).
Environment variables are read first; command-line options override them.
Exit status: 0 ok, 1 failure or timeout, 2 bad arguments / unsupported mode.
For record-decoding problems also set DEBUG=mq:decoder (ali-ons drops a
record it cannot decode silently and logs it only there).`;

// ---------------------------------------------------------------- arguments

function parseArgs(argv, env) {
  const o = {
    mode: env.ONS_MODE || 'roundtrip',
    namesrv: env.ONS_NAMESRV || '127.0.0.1:9876',
    topic: env.ONS_TOPIC || 'TxmqJsRoundtrip',
    producerGroup: env.ONS_PRODUCER_GROUP || 'PID_txmq_js',
    consumerGroup: env.ONS_CONSUMER_GROUP || '',
    count: env.ONS_COUNT || '10',
    timeoutMs: env.ONS_TIMEOUT_MS || '60000',
    createTopic: env.ONS_CREATE_TOPIC === '1' || env.ONS_CREATE_TOPIC === 'true',
    queues: env.ONS_QUEUES || '4',
    verbose: env.ONS_VERBOSE === '1' || env.ONS_VERBOSE === 'true',
    help: false,
  };
  const valued = {
    '--mode': 'mode',
    '--namesrv': 'namesrv',
    '--topic': 'topic',
    '--producer-group': 'producerGroup',
    '--consumer-group': 'consumerGroup',
    '--count': 'count',
    '--timeout-ms': 'timeoutMs',
    '--queues': 'queues',
  };
  for (let i = 0; i < argv.length; i++) {
    let a = argv[i];
    let inline = null;
    const eq = a.indexOf('=');
    if (a.startsWith('--') && eq > 0) {
      inline = a.slice(eq + 1);
      a = a.slice(0, eq);
    }
    if (a === '-h' || a === '--help') {
      o.help = true;
    } else if (a === '--create-topic') {
      o.createTopic = true;
    } else if (a === '--verbose') {
      o.verbose = true;
    } else if (valued[a]) {
      const v = inline !== null ? inline : argv[++i];
      if (v === undefined) throw new UsageError(`${a} needs a value`);
      o[valued[a]] = v;
    } else {
      throw new UsageError(`unknown argument: ${argv[i]}`);
    }
  }
  if (o.help) return o;

  if (!/^(roundtrip|tx)$/.test(o.mode)) throw new UsageError(`--mode must be roundtrip or tx, not ${o.mode}`);
  o.count = toInt(o.count, '--count', 1, 100000);
  o.timeoutMs = toInt(o.timeoutMs, '--timeout-ms', 1000, 3600000);
  o.queues = toInt(o.queues, '--queues', 1, 1024);
  const m = /^([^:]+):(\d{1,5})$/.exec(o.namesrv);
  if (!m) throw new UsageError(`--namesrv must be host:port (ali-ons splits on ':', so no IPv6), not ${o.namesrv}`);
  if (!isLoopback(m[1])) throw new UsageError(`--namesrv must be a loopback address, not ${m[1]}`);
  o.namesrvHost = m[1];
  o.namesrvPort = Number(m[2]);
  for (const k of [ 'topic', 'producerGroup' ]) {
    if (!/^[%|a-zA-Z0-9_-]{1,127}$/.test(o[k])) throw new UsageError(`bad ${k}: ${o[k]}`);
  }
  if (o.consumerGroup && !/^[%|a-zA-Z0-9_-]{1,127}$/.test(o.consumerGroup)) {
    throw new UsageError(`bad consumerGroup: ${o.consumerGroup}`);
  }
  return o;
}

class UsageError extends Error {}

function toInt(v, name, min, max) {
  const n = Number(v);
  if (!Number.isInteger(n) || n < min || n > max) throw new UsageError(`${name} must be an integer in [${min}, ${max}], not ${v}`);
  return n;
}

function isLoopback(host) {
  return host === 'localhost' || host === '::1' || /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(host);
}

// ------------------------------------------------------------------ output

const startedAt = Date.now();
let finished = false;

function out(obj) {
  process.stdout.write(JSON.stringify(obj) + '\n');
}

function diag(msg, extra) {
  const line = { t_ms: Date.now() - startedAt, msg };
  if (extra) Object.assign(line, extra);
  process.stderr.write('[ali_ons_roundtrip] ' + JSON.stringify(line) + '\n');
}

function errInfo(err) {
  if (!err) return null;
  const e = { name: err.name, message: String(err.message) };
  if (err.code !== undefined) e.code = err.code;
  return e;
}

function makeLogger(verbose) {
  // ali-ons logs printf-style ('%s', '%j', '%d'); Errors are shortened.
  const fmt = args => util.format(...args.map(a => (a instanceof Error ? `${a.name}: ${a.message}` : a)));
  return {
    info(...args) { if (verbose) process.stderr.write('[ali-ons info] ' + fmt(args) + '\n'); },
    debug(...args) { if (verbose) process.stderr.write('[ali-ons debug] ' + fmt(args) + '\n'); },
    warn(...args) { process.stderr.write('[ali-ons warn] ' + fmt(args) + '\n'); },
    error(...args) { process.stderr.write('[ali-ons error] ' + fmt(args) + '\n'); },
  };
}

// ------------------------------------------------------- loopback-only guard

let guardViolation = null;
let onGuardViolation = () => {};
const realConnect = net.connect;

function guardedConnect(...args) {
  let opts = args[0];
  if (typeof opts !== 'object' || opts === null) opts = { port: args[0], host: args[1] };
  if (!opts.path) {
    const host = opts.host || 'localhost';
    if (!isLoopback(host)) {
      const err = new Error(`refusing to connect to non-loopback address ${host}:${opts.port} ` +
        '(advertised by the name server?); this driver only talks to loopback');
      err.name = 'NonLoopbackAddressError';
      if (!guardViolation) {
        guardViolation = err;
        setImmediate(() => onGuardViolation(err));
      }
      throw err;
    }
  }
  return realConnect.apply(net, args);
}
net.connect = guardedConnect;
net.createConnection = guardedConnect;

// ali-ons asserts an httpclient is given even when nameSrv is set; it is
// only used to fetch name-server addresses from an HTTP address server,
// which must never happen here.
const refusingHttpClient = {
  async request(url) {
    const err = new Error(`ali-ons tried an HTTP name-server lookup (${url}); refused`);
    err.name = 'HttpLookupRefused';
    throw err;
  },
};

function probeTcp(host, port, timeoutMs) {
  return new Promise(resolve => {
    const sock = realConnect.call(net, { host, port });
    const done = err => {
      clearTimeout(timer);
      sock.removeAllListeners();
      sock.on('error', () => {});
      sock.destroy();
      resolve(err);
    };
    const timer = setTimeout(() => done(new Error(`connect timeout after ${timeoutMs}ms`)), timeoutMs);
    sock.once('connect', () => done(null));
    sock.once('error', err => done(err));
  });
}

function withTimeout(promise, ms, what) {
  let timer;
  return Promise.race([
    promise,
    new Promise((_, reject) => {
      timer = setTimeout(() => {
        const err = new Error(`${what} did not finish within ${ms}ms`);
        err.name = 'StepTimeout';
        reject(err);
      }, ms);
    }),
  ]).finally(() => clearTimeout(timer));
}

function sleep(ms) {
  return new Promise(r => setTimeout(r, ms));
}

// -------------------------------------------------------------------- main

async function main() {
  let opts;
  try {
    opts = parseArgs(process.argv.slice(2), process.env);
  } catch (err) {
    if (!(err instanceof UsageError)) throw err;
    process.stderr.write(`error: ${err.message}\n\n${USAGE}\n`);
    process.exit(2);
  }
  if (opts.help) {
    process.stdout.write(USAGE + '\n');
    process.exit(0);
  }

  if (opts.mode === 'tx') {
    const reason = 'ali-ons 3.12.0 has no transactional producer: it never sends END_TRANSACTION (37) ' +
      'and does not answer CHECK_TRANSACTION_STATE (39) or any other broker-initiated request ' +
      '(see docs/ali-ons-notes.md)';
    process.stderr.write(`tx mode unsupported: ${reason}\n`);
    out({ mode: 'tx', ok: false, unsupported: true, reason });
    process.exit(2);
  }

  const runId = `${process.pid.toString(36)}${Date.now().toString(36)}`;
  const consumerGroup = opts.consumerGroup || `CID_txmq_js_${runId}`;
  const deadline = startedAt + opts.timeoutMs;
  const logger = makeLogger(opts.verbose);
  const clientErrors = [];
  const sendResults = [];
  const expected = new Map(); // body -> key
  const received = []; // bodies of this run, first arrival order
  const receivedSet = new Set();
  const mismatches = [];
  let duplicates = 0;
  let foreign = 0;
  let producer = null;
  let consumer = null;

  const bodyPrefix = `txmq-js-${runId}-`;
  for (let i = 0; i < opts.count; i++) expected.set(`${bodyPrefix}${i}`, `key-${runId}-${i}`);

  // Final report + exit; runs once.
  async function finish(ok, error) {
    if (finished) return;
    finished = true;
    clearTimeout(watchdog);
    // A refused non-loopback connect explains whatever failed after it.
    if (guardViolation) {
      ok = false;
      error = guardViolation;
    }
    const closeErrors = [];
    // Close consumer first: producer and consumer share one ali-ons MQClient
    // (same clientId ip@pid), which closes its sockets when the last one goes.
    for (const [ name, client ] of [ [ 'consumer', consumer ], [ 'producer', producer ] ]) {
      if (!client) continue;
      try {
        await withTimeout(client.close(), 5000, `${name}.close()`);
      } catch (err) {
        closeErrors.push(Object.assign({ client: name }, errInfo(err)));
      }
    }
    const allSent = sendResults.length === opts.count && sendResults.every(r => r.ok);
    const allReceived = received.length === opts.count;
    const closedCleanly = closeErrors.length === 0;
    const verdict = Boolean(ok && allSent && allReceived && mismatches.length === 0 && closedCleanly);
    const missing = [];
    for (const body of expected.keys()) if (!receivedSet.has(body)) missing.push(body);
    out({
      sent: sendResults.filter(r => r.ok).length,
      received,
      ok: verdict,
      count: opts.count,
      topic: opts.topic,
      producer_group: opts.producerGroup,
      consumer_group: consumerGroup,
      missing,
      mismatches,
      duplicates,
      foreign_messages: foreign,
      closed_cleanly: closedCleanly,
      close_errors: closeErrors,
      client_errors: clientErrors.length,
      error: error ? errInfo(error) : null,
      elapsed_ms: Date.now() - startedAt,
    });
    process.exit(verdict ? 0 : 1);
  }

  const watchdog = setTimeout(() => {
    const err = new Error(`timeout after ${opts.timeoutMs}ms (received ${received.length}/${opts.count})`);
    err.name = 'Timeout';
    finish(false, err);
  }, opts.timeoutMs);

  onGuardViolation = err => finish(false, err);
  process.on('unhandledRejection', err => {
    diag('unhandled rejection', { error: errInfo(err) });
    finish(false, err);
  });
  process.on('uncaughtException', err => {
    diag('uncaught exception', { error: errInfo(err) });
    if (finished) process.exit(1);
    finish(false, err);
  });

  const onClientError = source => err => {
    // ali-ons reports many recoverable things as 'error' events (route
    // lookup failures, QUERY_CONSUMER_OFFSET code 22, pull errors).
    // Log them; the verdict is decided by what was sent and received.
    const info = errInfo(err && err.error ? err.error : err) || { message: String(err) };
    clientErrors.push(info);
    diag(`${source} error event`, { error: info });
  };

  try {
    await run();
  } catch (err) {
    await finish(false, err);
  }

  async function run() {
    // 1. Fail fast if the name server does not accept TCP connections at all.
    const probeErr = await probeTcp(opts.namesrvHost, opts.namesrvPort, Math.min(3000, opts.timeoutMs));
    if (probeErr) {
      const err = new Error(`name server ${opts.namesrv} is not reachable: ${probeErr.message}`);
      err.name = 'NameServerUnreachable';
      diag(err.message);
      return finish(false, err);
    }

    const ons = require('ali-ons');
    const common = {
      httpclient: refusingHttpClient,
      nameSrv: opts.namesrv,
      logger,
      clientIP: '127.0.0.1',
      connectTimeout: 3000,
    };
    // ACL credentials (AclClientRPCHook-style signing is built into ali-ons' channel).
    if (process.env.ONS_ACCESS_KEY) {
      common.accessKeyId = process.env.ONS_ACCESS_KEY;
      common.accessKeySecret = process.env.ONS_SECRET_KEY || '';
    }

    // 2. Producer.
    producer = new ons.Producer(Object.assign({}, common, { producerGroup: opts.producerGroup }));
    producer.on('error', onClientError('producer'));
    await withTimeout(producer.ready(), Math.max(1000, deadline - Date.now()), 'producer start');
    diag('producer started', { namesrv: opts.namesrv, group: opts.producerGroup });

    if (opts.createTopic) {
      await createTopicViaDefaultRoute(producer, opts, deadline);
    }

    // 3. Send N messages, one JSON line per result. Stop at the first failure:
    // the run has failed and waiting for the deadline would only slow CI down.
    let i = 0;
    for (const [ body, key ] of expected) {
      const msg = new ons.Message(opts.topic, 'TagA', body);
      msg.keys = [ key ];
      const t0 = Date.now();
      try {
        const r = await producer.send(msg);
        const line = {
          event: 'send',
          i,
          ok: r.sendStatus === 'SEND_OK',
          sendStatus: r.sendStatus,
          msgId: r.msgId === undefined ? null : r.msgId,
          brokerName: r.messageQueue && r.messageQueue.brokerName,
          queueId: r.messageQueue ? r.messageQueue.queueId : null,
          queueOffset: Number.isNaN(r.queueOffset) ? null : r.queueOffset,
          key,
          body,
          rt_ms: Date.now() - t0,
        };
        sendResults.push(line);
        out(line);
        if (!line.ok) return finish(false, new Error(`send ${i} returned ${r.sendStatus}`));
      } catch (err) {
        const line = { event: 'send', i, ok: false, error: errInfo(err), key, body, rt_ms: Date.now() - t0 };
        sendResults.push(line);
        out(line);
        if (err && err.name === 'MQClientException' && err.code === 17) {
          diag(`name server answered TOPIC_NOT_EXIST (17) for ${opts.topic}; ali-ons does not fall back ` +
            'to TBW102 on 17, so the topic must exist first (create it, or pass --create-topic)');
        }
        return finish(false, err);
      }
      i++;
    }

    // 4. Consumer from the first offset; collect until every body is seen.
    let resolveAll;
    const allSeen = new Promise(r => { resolveAll = r; });
    consumer = new ons.Consumer(Object.assign({}, common, {
      consumerGroup,
      consumeFromWhere: 'CONSUME_FROM_FIRST_OFFSET',
    }));
    consumer.on('error', onClientError('consumer'));
    consumer.subscribe(opts.topic, '*', async msg => {
      const body = msg.body ? msg.body.toString('utf8') : '';
      if (!expected.has(body)) {
        foreign++;
        return;
      }
      if (receivedSet.has(body)) {
        duplicates++;
        return;
      }
      receivedSet.add(body);
      received.push(body);
      const wantKey = expected.get(body);
      const line = {
        event: 'receive',
        body,
        msgId: msg.msgId,
        topic: msg.topic,
        tags: msg.tags === undefined ? null : msg.tags,
        keys: msg.keys === undefined ? null : msg.keys,
        queueId: msg.queueId,
        queueOffset: msg.queueOffset,
        reconsumeTimes: msg.reconsumeTimes,
      };
      out(line);
      if (msg.tags !== 'TagA' || msg.keys !== wantKey || msg.topic !== opts.topic) {
        mismatches.push({ body, tags: line.tags, keys: line.keys, topic: msg.topic });
      }
      if (received.length === opts.count) resolveAll();
    });
    await withTimeout(consumer.ready(), Math.max(1000, deadline - Date.now()), 'consumer start');
    diag('consumer started', { group: consumerGroup, topic: opts.topic });

    await allSeen;
    diag('all messages received', { count: opts.count });
    return finish(true, null);
  }
}

// Ask each master broker of the TBW102 route to create the topic, then wait
// until the name server returns a route for it. Uses ali-ons' own request
// encoders (MQClientAPI.getDefaultTopicRouteInfoFromNameServer/createTopic);
// these are internal methods, reached through the producer's MQClient.
async function createTopicViaDefaultRoute(producer, opts, deadline) {
  const api = producer._mqClient;
  const route = await api.getDefaultTopicRouteInfoFromNameServer('TBW102', 3000);
  if (!route || !route.brokerDatas || !route.brokerDatas.length) {
    throw new Error('name server returned no TBW102 route; cannot find a broker to create the topic on');
  }
  const topicConfig = {
    topicName: opts.topic,
    readQueueNums: opts.queues,
    writeQueueNums: opts.queues,
    perm: 6,
    topicFilterType: 'SINGLE_TAG',
    topicSysFlag: 0,
    order: false,
  };
  for (const bd of route.brokerDatas) {
    const addr = bd.brokerAddrs && bd.brokerAddrs[0];
    if (!addr) continue;
    await api.createTopic(addr, 'TBW102', topicConfig, 3000);
    diag('topic created', { broker: bd.brokerName, addr, topic: opts.topic, queues: opts.queues });
  }
  let lastErr = null;
  while (Date.now() < deadline) {
    try {
      const r = await api.getTopicRouteInfoFromNameServer(opts.topic, 3000);
      if (r && r.queueDatas && r.queueDatas.length) return;
    } catch (err) {
      lastErr = err;
    }
    await sleep(200);
  }
  throw lastErr || new Error(`name server never returned a route for ${opts.topic}`);
}

main().catch(err => {
  diag('fatal', { error: errInfo(err) });
  if (!finished) {
    finished = true;
    out({ sent: 0, received: [], ok: false, error: errInfo(err), elapsed_ms: Date.now() - startedAt });
  }
  process.exit(1);
});
