"""A plain gRPC server that streams a file in 1 MiB messages: the baseline
for bench/fetch.py. Usage: python bench/_plain_server.py PORT FILE"""

from __future__ import annotations

import sys
from concurrent import futures

import grpc


def main() -> None:
    port, path = int(sys.argv[1]), sys.argv[2]

    def stream(request: bytes, context):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                yield chunk

    handler = grpc.method_handlers_generic_handler(
        "bench.Plain", {"Stream": grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=None, response_serializer=None)})
    server = grpc.server(futures.ThreadPoolExecutor(4),
                         options=[("grpc.max_send_message_length", 8 << 20)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
