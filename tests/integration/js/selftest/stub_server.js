'use strict';
/*
 * SELF-TEST STUB ONLY - not a reference broker and not the txmq design.
 *
 * The smallest name server + broker that lets ali-ons 3.12.0 send and
 * consume, written from the reply requirements in docs/ali-ons-notes.md,
 * so that ../ali_ons_roundtrip.js can be checked without a real broker and
 * the notes' claims can be re-checked (STUB_VARIANT selects one deliberately
 * wrong reply). In-memory, single broker "stub-b", 2 queues per topic,
 * 127.0.0.1 only, ephemeral ports: prints {"namesrv":..,"broker":..} on
 * stdout once listening. SIGTERM prints the request codes seen to stderr.
 *
 * STUB_TOPICS   comma list of topics the name server knows (TBW102 always)
 * STUB_VARIANT  '' | binary | noflag | emptyfound | badmagic | emptyroute | nonloop
 */
const net = require('net');
let NS_PORT = 0;
let BR_PORT = 0;
const VARIANT = process.env.STUB_VARIANT || '';
const TOPICS = new Set([ 'TBW102' ].concat((process.env.STUB_TOPICS || '').split(',').filter(Boolean)));
const QUEUES = 2;
const log = (...a) => process.stderr.write('[stub] ' + a.join(' ') + '\n');

const queues = new Map(); // topic:qid -> [record buffers with offsets]
const offsets = new Map(); // group:topic:qid -> offset
const groups = new Map(); // group -> Set(clientId)
let commitLog = 0;
const waiters = new Set();
const seen = [];

function frame(header, body) {
  const h = Buffer.from(JSON.stringify(header));
  const b = body || Buffer.alloc(0);
  const out = Buffer.alloc(8 + h.length + b.length);
  out.writeInt32BE(4 + h.length + b.length, 0);
  out.writeInt32BE(h.length, 4);
  h.copy(out, 8);
  b.copy(out, 8 + h.length);
  return out;
}
function reply(sock, req, code, ext, body, remark) {
  if (req.flag & 2) return; // oneway
  const hdr = { code, flag: VARIANT === 'noflag' ? 0 : 1, opaque: req.opaque, language: 'JAVA', version: 373, extFields: ext || {} };
  if (remark !== undefined) hdr.remark = remark;
  sock.write(frame(hdr, body));
}
function serve(handler, onListening) {
  const srv = net.createServer(sock => {
    let buf = Buffer.alloc(0);
    sock.on('data', d => {
      buf = Buffer.concat([ buf, d ]);
      while (buf.length >= 4) {
        const len = buf.readInt32BE(0);
        if (buf.length < 4 + len) break;
        const f = buf.slice(4, 4 + len);
        buf = buf.slice(4 + len);
        const hl = f.readInt32BE(0) & 0xffffff;
        const req = JSON.parse(f.slice(4, 4 + hl).toString());
        const body = f.slice(4 + hl);
        seen.push(req.code);
        handler(sock, req, body);
      }
    });
    sock.on('error', () => {});
  });
  srv.listen(0, '127.0.0.1', () => onListening(srv.address().port));
  return srv;
}

function route(topic) {
  const q = topic.startsWith('%RETRY%') ? 1 : QUEUES;
  // unquoted integer key, as the Java name server emits
  return `{"brokerDatas":[{"brokerAddrs":{0:"127.0.0.1:${BR_PORT}"},"brokerName":"stub-b","cluster":"c"}],` +
    `"filterServerTable":{},"queueDatas":[{"brokerName":"stub-b","perm":6,"readQueueNums":${q},"topicSynFlag":0,"writeQueueNums":${q}}]}`;
}

let listening = 0;
function ready() {
  if (++listening === 2) process.stdout.write(JSON.stringify({ namesrv: `127.0.0.1:${NS_PORT}`, broker: `127.0.0.1:${BR_PORT}` }) + '\n');
}

serve((sock, req) => {
  if (req.code === 105) {
    const t = req.extFields.topic;
    if (VARIANT === 'nonloop' && t !== 'TBW102') return reply(sock, req, 0, {}, Buffer.from(route(t).replace('127.0.0.1', '10.255.255.1')));
    if (TOPICS.has(t)) return reply(sock, req, 0, {}, Buffer.from(route(t)));
    if (VARIANT === 'emptyroute') return reply(sock, req, 0, {}, null);
    return reply(sock, req, 17, {}, null, `No topic route info in name server for the topic: ${t}`);
  }
  reply(sock, req, 3, {}, null, 'unsupported');
}, p => { NS_PORT = p; ready(); });

function encodeRecord(topic, qid, qoff, body, props, sysFlag, flag, born) {
  const t = Buffer.from(topic);
  const p = Buffer.from(props);
  const size = 4 + 4 + 4 + 4 + 4 + 8 + 8 + 4 + 8 + 8 + 8 + 8 + 4 + 8 + 4 + body.length + 1 + t.length + 2 + p.length;
  const b = Buffer.alloc(size);
  let o = 0;
  b.writeInt32BE(size, o); o += 4;
  b.writeInt32BE(VARIANT === 'badmagic' ? 0x12345678 : -626843481, o); o += 4; // 0xdaa320a7
  b.writeInt32BE(VARIANT === 'badmagic' ? 42 : 0, o); o += 4; // body crc (not checked)
  b.writeInt32BE(qid, o); o += 4;
  b.writeInt32BE(flag, o); o += 4;
  b.writeBigInt64BE(BigInt(qoff), o); o += 8;
  const phys = commitLog; commitLog += size;
  b.writeBigInt64BE(BigInt(phys), o); o += 8;
  b.writeInt32BE(sysFlag, o); o += 4;
  b.writeBigInt64BE(BigInt(born), o); o += 8;
  Buffer.from([ 127, 0, 0, 1 ]).copy(b, o); o += 4; b.writeInt32BE(40000, o); o += 4;
  b.writeBigInt64BE(BigInt(Date.now()), o); o += 8;
  Buffer.from([ 127, 0, 0, 1 ]).copy(b, o); o += 4; b.writeInt32BE(BR_PORT, o); o += 4;
  b.writeInt32BE(0, o); o += 4; // reconsume
  b.writeBigInt64BE(0n, o); o += 8; // prepared tx offset
  b.writeInt32BE(body.length, o); o += 4; body.copy(b, o); o += body.length;
  b.writeInt8(t.length, o); o += 1; t.copy(b, o); o += t.length;
  b.writeInt16BE(p.length, o); o += 2; p.copy(b, o); o += p.length;
  return { buf: b, phys };
}
function q(topic, qid) {
  const k = `${topic}:${qid}`;
  if (!queues.has(k)) queues.set(k, []);
  return queues.get(k);
}

function doPull(sock, req, deadline) {
  const e = req.extFields;
  const list = q(e.topic, Number(e.queueId));
  const off = Number(e.queueOffset);
  const max = list.length;
  if (VARIANT === 'emptyfound') return reply(sock, req, 0, { nextBeginOffset: String(off), minOffset: '0', maxOffset: String(max), suggestWhichBrokerId: '0' }, null);
  if (off < max) {
    const recs = list.slice(off, off + Number(e.maxMsgNums));
    return reply(sock, req, 0, { nextBeginOffset: String(off + recs.length), minOffset: '0', maxOffset: String(max), suggestWhichBrokerId: '0' },
      Buffer.concat(recs.map(r => r.buf)));
  }
  if ((Number(e.sysFlag) & 2) && Date.now() < deadline) {
    const w = () => { waiters.delete(w); doPull(sock, req, deadline); };
    waiters.add(w);
    setTimeout(() => { if (waiters.has(w)) w(); }, Math.max(0, deadline - Date.now()));
    return;
  }
  reply(sock, req, 19, { nextBeginOffset: String(off), minOffset: '0', maxOffset: String(max), suggestWhichBrokerId: '0' });
}

serve((sock, req, body) => {
  const e = req.extFields || {};
  if (VARIANT === 'binary' && req.code === 310) {
    // ROCKETMQ (binary) serialized header: type byte 1 in the length word
    const h = Buffer.alloc(4 + 2 + 1 + 4 + 4 + 4 + 4 + 4);
    let o = 0; h.writeInt16BE(0, o); o += 2; h.writeInt8(0, o); o += 1; h.writeInt16BE(373, o); o += 2;
    h.writeInt32BE(req.opaque, o); o += 4; h.writeInt32BE(1, o); o += 4; h.writeInt32BE(0, o); o += 4; h.writeInt32BE(0, o);
    const out = Buffer.alloc(8 + h.length);
    out.writeInt32BE(4 + h.length, 0); out.writeInt32BE((1 << 24) | h.length, 4); h.copy(out, 8);
    return sock.write(out);
  }
  switch (req.code) {
    case 310: {
      const list = q(e.b, Number(e.e));
      const qoff = list.length;
      const r = encodeRecord(e.b, Number(e.e), qoff, body, e.i || '', Number(e.f), Number(e.h), Number(e.g));
      list.push(r);
      for (const w of [ ...waiters ]) w();
      const msgId = Buffer.concat([ Buffer.from([ 127, 0, 0, 1 ]), Buffer.from([ 0, 0, BR_PORT >> 8, BR_PORT & 255 ]), (() => { const x = Buffer.alloc(8); x.writeBigInt64BE(BigInt(r.phys)); return x; })() ]).toString('hex').toUpperCase();
      return reply(sock, req, 0, { msgId, queueId: String(e.e), queueOffset: String(qoff) });
    }
    case 34: {
      const hb = JSON.parse(body.toString());
      for (const c of hb.consumerDataSet) {
        if (!groups.has(c.groupName)) groups.set(c.groupName, new Set());
        groups.get(c.groupName).add(hb.clientID);
        TOPICS.add('%RETRY%' + c.groupName);
      }
      return reply(sock, req, 0, {});
    }
    case 38: {
      const ids = [ ...(groups.get(e.consumerGroup) || []) ];
      return reply(sock, req, 0, {}, Buffer.from(JSON.stringify({ consumerIdList: ids })));
    }
    case 14: {
      const k = `${e.consumerGroup}:${e.topic}:${e.queueId}`;
      if (offsets.has(k)) return reply(sock, req, 0, { offset: String(offsets.get(k)) });
      return reply(sock, req, 22, {}, null, 'Not found, maybe this group consumer boot first');
    }
    case 15: {
      const c = Number(e.commitOffset);
      if (c >= 0) offsets.set(`${e.consumerGroup}:${e.topic}:${e.queueId}`, c);
      return reply(sock, req, 0, {});
    }
    case 30: return reply(sock, req, 0, { offset: String(q(e.topic, Number(e.queueId)).length) });
    case 11: return doPull(sock, req, Date.now() + Math.min(Number(e.suspendTimeoutMillis) || 0, 15000));
    case 35: return reply(sock, req, 0, {});
    case 17: TOPICS.add(e.topic); return reply(sock, req, 0, {});
    case 36: return reply(sock, req, 0, {});
    default: return reply(sock, req, 3, {}, null, `code ${req.code} not supported`);
  }
}, p => { BR_PORT = p; ready(); });
process.on('SIGTERM', () => { log('codes seen', JSON.stringify(seen)); process.exit(0); });
