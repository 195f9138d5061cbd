"""The per-host worker daemon: its gRPC services, host cache, routes' servers and gates."""
