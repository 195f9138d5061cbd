"""One process of tests/test_aot.py's lapsed-lease check: compile a real TPU
program (compile-only) ahead of time through compilecast while its compile
lease lapses, as on a host starved of CPU, and print the outcome as JSON.

Usage: aot_lapse_proc.py COORDINATOR TTL_S [other]

The client renews nothing and its first publish starts TTL_S + 3 s late (a
holder that missed its renewals). With `other`, another process's client takes
the free key in that time and publishes first.
"""

import hashlib
import json
import sys
import time

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity
from compilecast.worker.jaxdoor import aot

coordinator, ttl = sys.argv[1], float(sys.argv[2])
other = len(sys.argv) > 3 and sys.argv[3] == "other"


class Starved(CacheClient):
    late = True

    def keep_lease(self, key: str, lease: pb.Lease) -> None:
        pass  # no renewals: the lease lapses after its TTL

    def publish(self, key, lease, data, compile_time_s, recipe=None):
        self.sent = data  # what this process compiled
        if self.late:
            self.late = False
            time.sleep(ttl + 3.0)
            if other:  # the key is free: another process compiles and publishes
                rival = CacheClient(coordinator, identity=Identity(job="rival", process_id=0))
                got = rival.acquire(key)
                assert got.decision == pb.COMPILE, got
                rival.publish(key, got.lease, b"the rival's executable", 1.0)
        return super().publish(key, lease, data, compile_time_s, recipe)


client = Starved(coordinator, timeout_s=30.0)
(program, *_) = aot.entry_programs("compilecast.demo.step:aot_programs", aot.parse_target("v5e:2x2"))
out = aot.compile_and_share(client, program, fetch=True)
_, published = client.fetch(out.key)  # verified against its digest
print(json.dumps({"status": out.status, "key": out.key,
                  "published": hashlib.sha256(published).hexdigest(),
                  "compiled": hashlib.sha256(client.sent).hexdigest()}))
