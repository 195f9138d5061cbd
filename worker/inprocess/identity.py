"""Who a client process is, as a Requester tells the coordinator."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from compilecast.v1 import cache_pb2 as pb


def default_client_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class Identity:
    """Who this process is: see compilecast.v1.Requester."""

    job: str = ""
    process_id: int = 0
    designated_process: int = 0
    client: str = ""

    def requester(self) -> pb.Requester:
        return pb.Requester(job=self.job, process_id=self.process_id,
                            designated_process=self.designated_process,
                            client=self.client or default_client_name())
