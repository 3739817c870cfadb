"""A KV-aware router's view of one replica, written against vLLM's published KV event
format only (ZeroMQ + MessagePack; it knows nothing of kvpage): it subscribes to the
PUB socket, folds BlockStored / BlockRemoved / AllBlocksCleared into the multiset of
cached block hashes, and on a gap in the batch sequence numbers asks the replay socket
for everything since the first missing batch.

Driven by tests/kv_events_zmq.rs:

    python3 kv_events_subscriber.py PUB_ENDPOINT REPLAY_ENDPOINT FORMAT DROP

FORMAT is "map" (vLLM's current tagged maps) or "array" (the older positional arrays).
DROP is a comma-separated list of batch sequence numbers to ignore as if the network
had lost them (forcing replay requests), or "-". It prints "ready" once subscribed,
then reads one JSON line from stdin: {"last_seq": N, "hashes": [...]}, the test's
expected final state. It consumes batches until it has applied batch N, prints a
summary line and exits 0 when its multiset of hashes equals the expected one, 1
otherwise.

Needs: pip install pyzmq msgpack
"""

import collections
import json
import sys
import threading
import time

import msgpack
import zmq


def events_of(batch, fmt):
    """The events of a decoded batch, each as (tag, fields dict)."""
    if fmt == "map":
        assert isinstance(batch, dict), batch
        assert isinstance(batch["ts"], float) and isinstance(batch["data_parallel_rank"], int)
        for e in batch["events"]:
            yield e["type"], e
    else:
        assert isinstance(batch, list) and len(batch) == 3, batch
        ts, events, rank = batch
        assert isinstance(ts, float) and isinstance(rank, int)
        names = {
            "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
            "BlockRemoved": ["block_hashes", "medium"],
            "AllBlocksCleared": [],
        }
        for e in events:
            tag = e[0]
            yield tag, dict(zip(names[tag], e[1:]))


class Router:
    def __init__(self, fmt):
        self.fmt = fmt
        self.blocks = collections.Counter()
        self.next_seq = 0
        self.replays = 0
        self.stored = 0
        self.removed = 0
        self.cleared = 0

    def apply(self, seq, payload):
        """Applies batch `seq` if it is the next one; returns False on a gap."""
        if seq < self.next_seq:
            return True  # a duplicate (a replay overlapping live traffic)
        if seq > self.next_seq:
            return False
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        for tag, e in events_of(batch, self.fmt):
            if tag == "BlockStored":
                assert len(e["token_ids"]) == e["block_size"] * len(e["block_hashes"])
                for h in e["block_hashes"]:
                    self.blocks[h] += 1
                self.stored += 1
            elif tag == "BlockRemoved":
                for h in e["block_hashes"]:
                    assert self.blocks[h] > 0, "removal of a block never stored"
                    self.blocks[h] -= 1
                    if self.blocks[h] == 0:
                        del self.blocks[h]
                self.removed += 1
            elif tag == "AllBlocksCleared":
                self.blocks.clear()
                self.cleared += 1
            else:
                raise AssertionError("unknown event " + repr(tag))
        self.next_seq = seq + 1
        return True

    def replay(self, sock):
        """Asks for everything since the next batch and applies the answer."""
        self.replays += 1
        sock.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            frames = sock.recv_multipart()
            assert len(frames) == 3 and frames[0] == b"", frames
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == -1:
                return
            assert self.apply(seq, frames[2]), "replay answered out of order"


def main():
    pub, replay_at, fmt, drop = sys.argv[1:5]
    drop = set() if drop == "-" else {int(s) for s in drop.split(",")}
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(replay_at)
    time.sleep(0.3)  # let the subscription reach the publisher
    print("ready", flush=True)

    expected = {}
    reader = threading.Thread(target=lambda: expected.update(json.loads(sys.stdin.readline())))
    reader.start()
    router = Router(fmt)
    deadline = time.time() + 60
    while time.time() < deadline:
        if "last_seq" in expected and router.next_seq > expected["last_seq"]:
            break
        if sub.poll(50):
            topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq in drop:
                drop.discard(seq)
                continue
            if not router.apply(seq, payload):
                router.replay(replay)
                router.apply(seq, payload)
        elif "last_seq" in expected and router.next_seq <= expected["last_seq"]:
            # The last batches were dropped or missed: nothing more will come live.
            router.replay(replay)
    reader.join(timeout=1)
    want = collections.Counter(expected.get("hashes", []))
    ok = router.blocks == want and router.next_seq == expected.get("last_seq", -2) + 1
    print(
        "%s: %d cached blocks (want %d), batches %d, replays %d, stored %d, removed %d, cleared %d"
        % ("OK" if ok else "MISMATCH", sum(router.blocks.values()), sum(want.values()),
           router.next_seq, router.replays, router.stored, router.removed, router.cleared),
        flush=True,
    )
    sub.close(0)
    replay.close(0)
    ctx.term()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
