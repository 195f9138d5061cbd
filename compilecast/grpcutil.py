"""The one edge where compilecast errors become gRPC statuses, plus channel
helpers shared by servers and clients."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import grpc

from compilecast.errors import CompilecastError

log = logging.getLogger(__name__)

# Chunks of 1 MiB; messages up to 8 MiB leave room for headers.
MAX_MESSAGE = 8 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


async def _abort(context: grpc.aio.ServicerContext, exc: CompilecastError, name: str) -> None:
    log.info("%s refused: %s: %s", name, exc.code.name, exc)
    await context.abort(exc.code, str(exc))


def rpc_errors(fn: Callable) -> Callable:
    """Map CompilecastError raised by a grpc.aio handler to its status code.

    Works for unary handlers and for async-generator (server-streaming)
    handlers. Anything else is a bug: it is logged with its traceback and
    reported as INTERNAL without leaking details.
    """
    name = fn.__name__
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def gen_wrapper(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except CompilecastError as exc:
                await _abort(context, exc, name)
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception:
                log.exception("%s failed", name)
                await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error")

        return gen_wrapper

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except CompilecastError as exc:
            await _abort(context, exc, name)
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("%s failed", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error")

    return wrapper

