"""Drive the stock rocketmq-client-cpp 1.0.1 (bundled in PyPI's `rocketmq` 0.4.4 wheel) in its own process.

    python tests/support/cpp_client.py NAMESRV batch TOPIC N       -> one JSON line {"status", "msg_id", "offset"}
    python tests/support/cpp_client.py NAMESRV delay TOPIC LEVEL   -> one JSON line {"status", "msg_id", "sent_ms"}

Its own process because the native client owns threads and signal handlers, and may crash at exit.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    namesrv, action, topic, arg = sys.argv[1:5]
    from rocketmq.client import Message, Producer

    producer = Producer(f"PG_cpp_{action}", timeout=10_000)
    producer.set_namesrv_addr(namesrv)
    producer.start()
    try:
        if action == "batch":
            msgs = []
            for i in range(int(arg)):
                m = Message(topic)
                m.set_keys(f"cpp-key-{i}")
                m.set_tags(f"T{i % 3}")
                m.set_body(f"cpp-batch-{i}".encode())
                m.set_property("seq", str(i))
                msgs.append(m)
            result = producer.send_batch(msgs)
            out = {"status": int(result.status), "msg_id": result.msg_id, "offset": result.offset}
        elif action == "delay":
            m = Message(topic)
            m.set_keys(f"cpp-delay-{arg}")
            m.set_body(f"delayed level {arg}".encode())
            m.set_delay_time_level(int(arg))
            sent = int(time.time() * 1000)
            result = producer.send_sync(m)
            out = {"status": int(result.status), "msg_id": result.msg_id, "sent_ms": sent}
        else:
            raise SystemExit(f"unknown action {action}")
        print(json.dumps(out), flush=True)
    finally:
        producer.shutdown()
    os._exit(0)             # skip the native client's static destructors


if __name__ == "__main__":
    main()
