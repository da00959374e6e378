"""A KV event subscriber as fleet routers write them: pyzmq (libzmq) sockets, and msgspec decoding
each payload strictly into vLLM's event schema (written out below from vLLM's field order: a field
missing, out of order or of the wrong type fails the decode).

Usage: vllm_subscriber.py PUB_ADDR REPLAY_ADDR TOPIC_PREFIX
PUB_ADDR "bind": the SUB socket binds a free loopback port instead (the publisher connects to it, as
llm-d's indexer has vLLM pods do), named in the first line; REPLAY_ADDR "-": no replay socket.
Prints one JSON line per batch received: {"seq", "topic", "ts", "rank", "events": [...]}, each event
a dict of vLLM's field names with its "type". Reads commands on stdin: "replay N" asks the replay
socket for every batch from N (printed with "replay": true, then {"replay_end": true}); "quit".
"""

import json
import sys
import threading

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
out_lock = threading.Lock()


def emit(obj):
    with out_lock:
        print(json.dumps(obj), flush=True)


def as_dict(batch, seq, topic, replay=False):
    events = []
    for e in batch.events:
        d = {f: getattr(e, f) for f in e.__struct_fields__}
        d["type"] = type(e).__name__
        events.append(d)
    return {"seq": seq, "topic": topic, "ts": batch.ts, "rank": batch.data_parallel_rank,
            "events": events, "replay": replay}


def main():
    pub_addr, replay_addr, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, prefix.encode())
    bound = None
    if pub_addr == "bind":
        sub.bind("tcp://127.0.0.1:*")
        bound = sub.getsockopt(zmq.LAST_ENDPOINT).decode().removeprefix("tcp://")
    else:
        sub.connect(f"tcp://{pub_addr}")

    def listen():
        while True:
            try:
                topic, seq, payload = sub.recv_multipart()
            except zmq.ContextTerminated:
                return
            try:
                batch = decoder.decode(payload)
            except msgspec.ValidationError as e:
                emit({"decode_error": str(e)})
                continue
            emit(as_dict(batch, int.from_bytes(seq, "big"), topic.decode()))

    threading.Thread(target=listen, daemon=True).start()
    emit({"subscribed": True, "bound": bound})
    replay = ctx.socket(zmq.DEALER)
    replay.setsockopt(zmq.RCVTIMEO, 10000)
    if replay_addr != "-":
        replay.connect(f"tcp://{replay_addr}")
    for line in sys.stdin:
        cmd = line.split()
        if cmd[:1] == ["quit"]:
            break
        if cmd[:1] == ["replay"]:
            replay.send_multipart([b"", int(cmd[1]).to_bytes(8, "big")])
            while True:
                empty, seq, payload = replay.recv_multipart()
                seq = int.from_bytes(seq, "big", signed=True)
                if seq == -1:
                    assert payload == b"" and empty == b""
                    emit({"replay_end": True})
                    break
                emit(as_dict(decoder.decode(payload), seq, None, replay=True))
    import os
    os._exit(0)


main()
