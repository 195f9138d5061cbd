# The one image the Helm chart runs: `compilecast coordinator` and `compilecast worker`.
FROM python:3.11-slim AS build
# A C compiler for worker/keylib/_hlocanon.c and worker/keylib/_mlircanon.c (the key library's fast paths).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY compilecast ./compilecast
COPY coordinator ./coordinator
COPY worker ./worker
COPY protos ./protos
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[jax,s3]'

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home compilecast
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 10001
ENTRYPOINT ["compilecast"]
CMD ["--help"]
